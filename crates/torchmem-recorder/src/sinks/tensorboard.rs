//! The TensorBoard sink (`torchmem run --tensorboard DIR`): event files TensorBoard reads, written without
//! TensorFlow or the `tensorboard` package. An event file is a TFRecord stream (`u64 length`, masked
//! CRC32C of the length, the data, masked CRC32C of the data) of `Event` protobufs, hand-encoded here:
//! the first carries `file_version = "brain.Event:2"`, each later one `wall_time`, `step` and a
//! `Summary` of `Value{tag, simple_value}` scalars.
//!
//! What is written: the memory samples as the highest value of each second (`torchmem/rss_bytes`,
//! `torchmem/pss_bytes`, `torchmem/cuda_allocated_bytes`, `torchmem/cuda_reserved_bytes`,
//! `torchmem/gpu{N}/used_bytes`, `torchmem/gpu{N}/process_used_bytes`; step = ms since the run started),
//! and at every step, phase and epoch end its exact peaks from the marker (`torchmem/step/peak_*`,
//! `torchmem/phase/{name}/peak_*` at the step the phase ran in, `torchmem/epoch/peak_*`; step = the
//! program's step or epoch index). Where a boundary carries the Monitor's memory breakdown, each measured
//! category as `torchmem/breakdown/{boundary}/{device}/{category}_bytes` (`boundary`: `step_start`,
//! `end_of_forward`, `end_of_backward`, `end_of_optimizer_step`; `device`: `cuda_0`, `cpu`; step = the
//! program's step). A process that says its rank writes into `DIR/rank{N}/`, so TensorBoard
//! shows ranks as runs. `simple_value` is a 32-bit float: byte values keep 7 significant digits.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use torchmem_core::breakdown::{boundary_of, Category};
use torchmem_core::model::{Edge, Marker, MarkerKind};
use torchmem_core::store::Record;

use super::{RecordBatch, RunContext, Sink};

/// The samples' window: each scalar is the highest value seen in it.
pub const WINDOW_NS: u64 = 1_000_000_000;

const CRC32C_TABLE: [u32; 256] = {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 { 0x82f6_3b78 ^ (c >> 1) } else { c >> 1 };
            k += 1;
        }
        table[i] = c;
        i += 1;
    }
    table
};

/// CRC-32C (Castagnoli), as TFRecord uses.
pub fn crc32c(data: &[u8]) -> u32 {
    !data.iter().fold(!0u32, |c, &b| CRC32C_TABLE[((c ^ b as u32) & 0xff) as usize] ^ (c >> 8))
}

/// TFRecord's masked CRC.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    let c = crc32c(data);
    (c.rotate_right(15)).wrapping_add(0xa282_ead8)
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn length_delimited(out: &mut Vec<u8>, tag: u8, bytes: &[u8]) {
    out.push(tag);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// `Event{wall_time = 1, step = 2, file_version = 3 | summary = 5}`; `Summary{repeated Value value = 1}`;
/// `Value{tag = 1, simple_value = 2}` (tensorflow/core/util/event.proto, framework/summary.proto).
pub fn encode_event(wall_time_s: f64, step: i64, file_version: Option<&str>, scalars: &[(String, f32)]) -> Vec<u8> {
    let mut e = Vec::with_capacity(32 + scalars.len() * 48);
    e.push(0x09);
    e.extend_from_slice(&wall_time_s.to_le_bytes());
    if step != 0 {
        e.push(0x10);
        varint(&mut e, step as u64);
    }
    if let Some(v) = file_version {
        length_delimited(&mut e, 0x1a, v.as_bytes());
    }
    if !scalars.is_empty() {
        let mut summary = Vec::new();
        for (tag, value) in scalars {
            let mut v = Vec::with_capacity(tag.len() + 8);
            length_delimited(&mut v, 0x0a, tag.as_bytes());
            v.push(0x15);
            v.extend_from_slice(&value.to_le_bytes());
            length_delimited(&mut summary, 0x0a, &v);
        }
        length_delimited(&mut e, 0x2a, &summary);
    }
    e
}

/// One TFRecord: length, its masked CRC, the data, its masked CRC.
pub fn frame_record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc32c(data).to_le_bytes());
    out
}

/// One events file.
pub struct EventFile {
    path: PathBuf,
    out: BufWriter<File>,
    dirty: bool,
}

impl EventFile {
    pub fn create(dir: &Path, hostname: &str, wall_time_s: f64) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let name = format!("events.out.tfevents.{}.{hostname}.{}.torchmem", wall_time_s as u64, std::process::id());
        let path = dir.join(name);
        let mut f = EventFile { out: BufWriter::new(File::create(&path)?), path, dirty: false };
        f.write(wall_time_s, 0, Some("brain.Event:2"), &[])?;
        f.flush()?;
        Ok(f)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn write(
        &mut self,
        wall_time_s: f64,
        step: i64,
        version: Option<&str>,
        scalars: &[(String, f32)],
    ) -> std::io::Result<()> {
        self.dirty = true;
        self.out.write_all(&frame_record(&encode_event(wall_time_s, step, version, scalars)))
    }

    pub fn flush(&mut self) -> std::io::Result<()> {
        if self.dirty {
            self.dirty = false;
            self.out.flush()?;
        }
        Ok(())
    }
}

/// A tag part from a phase name: TensorBoard groups by '/', so a name keeps letters, digits, '_', '-', '.'.
fn tag_part(name: &str) -> String {
    name.chars().map(|c| if c.is_alphanumeric() || matches!(c, '-' | '.') { c } else { '_' }).collect()
}

#[derive(Default)]
struct ProcessSpans {
    rank: Option<u32>,
    /// The step open now, else the last one.
    step: Option<i64>,
    steps_ended: i64,
}

pub struct TensorBoardSink {
    dir: PathBuf,
    hostname: String,
    started_unix_s: f64,
    /// By rank (None: the root directory).
    files: BTreeMap<Option<u32>, EventFile>,
    window_start_ns: u64,
    /// (rank, tag) → the window's highest value.
    window_max: BTreeMap<(Option<u32>, String), f64>,
    /// The latest allocator reading (allocated, reserved bytes) per (pid, device).
    torch: BTreeMap<(Option<u32>, u32), (u64, u64)>,
    spans: BTreeMap<Option<u32>, ProcessSpans>,
}

impl TensorBoardSink {
    pub fn create(dir: &Path, ctx: &RunContext) -> anyhow::Result<Self> {
        if dir.exists() && !dir.is_dir() {
            anyhow::bail!(
                "--tensorboard {}: it is a file, not a directory. Give a directory for the event files",
                dir.display()
            );
        }
        let root = EventFile::create(dir, &ctx.hostname, ctx.started_unix_s).map_err(|e| {
            anyhow::anyhow!(
                "--tensorboard {}: cannot write event files there ({e}). Give a writable directory",
                dir.display()
            )
        })?;
        Ok(TensorBoardSink {
            dir: dir.to_path_buf(),
            hostname: ctx.hostname.clone(),
            started_unix_s: ctx.started_unix_s,
            files: BTreeMap::from([(None, root)]),
            window_start_ns: 0,
            window_max: BTreeMap::new(),
            torch: BTreeMap::new(),
            spans: BTreeMap::new(),
        })
    }

    fn wall(&self, t_ns: u64) -> f64 {
        self.started_unix_s + t_ns as f64 / 1e9
    }

    fn file(&mut self, rank: Option<u32>) -> std::io::Result<&mut EventFile> {
        if !self.files.contains_key(&rank) {
            let dir = match rank {
                Some(r) => self.dir.join(format!("rank{r}")),
                None => self.dir.clone(),
            };
            let f = EventFile::create(&dir, &self.hostname, self.started_unix_s)?;
            self.files.insert(rank, f);
        }
        Ok(self.files.get_mut(&rank).expect("just inserted"))
    }

    fn note(&mut self, rank: Option<u32>, tag: String, value: u64) {
        let e = self.window_max.entry((rank, tag)).or_insert(0.0);
        *e = e.max(value as f64);
    }

    /// Writes the window's scalars (step = the window's start in ms) and opens the next.
    fn close_window(&mut self, next_start_ns: u64) -> std::io::Result<()> {
        let maxes = std::mem::take(&mut self.window_max);
        let step = (self.window_start_ns / 1_000_000) as i64;
        let wall = self.wall(self.window_start_ns);
        let mut by_rank: BTreeMap<Option<u32>, Vec<(String, f32)>> = BTreeMap::new();
        for ((rank, tag), v) in maxes {
            by_rank.entry(rank).or_default().push((tag, v as f32));
        }
        for (rank, scalars) in by_rank {
            self.file(rank)?.write(wall, step, None, &scalars)?;
        }
        self.window_start_ns = next_start_ns - next_start_ns % WINDOW_NS;
        Ok(())
    }

    /// The breakdown a boundary marker carries, one scalar per measured category and device.
    fn breakdown(&mut self, m: &Marker, rank: Option<u32>, step: i64) -> std::io::Result<()> {
        let Some(entries) = m.breakdown.as_ref().filter(|b| !b.is_empty()) else { return Ok(()) };
        let boundary = tag_part(&boundary_of(m));
        let mut scalars = Vec::new();
        for e in entries {
            let device = tag_part(&e.device);
            for c in Category::STACKED {
                if let Some(v) = e.get(c) {
                    scalars.push((format!("torchmem/breakdown/{boundary}/{device}/{}_bytes", c.as_str()), v as f32));
                }
            }
        }
        if scalars.is_empty() {
            return Ok(());
        }
        let wall = self.wall(m.t_ns);
        self.file(rank)?.write(wall, step, None, &scalars)
    }

    fn marker(&mut self, m: &Marker) -> std::io::Result<()> {
        let s = self.spans.entry(m.origin.pid).or_default();
        s.rank = m.origin.rank.or(s.rank);
        let rank = s.rank;
        if m.kind == MarkerKind::Step && m.edge == Edge::Start {
            s.step = Some(m.index.unwrap_or(s.steps_ended));
        }
        let step_now = s.step.unwrap_or(s.steps_ended);
        self.breakdown(m, rank, step_now)?;
        let s = self.spans.entry(m.origin.pid).or_default();
        let (prefix, step) = match (m.kind, m.edge) {
            (MarkerKind::Step, Edge::Start) => return Ok(()),
            (MarkerKind::Step, Edge::End) => {
                let step = m.index.or(s.step).unwrap_or(s.steps_ended);
                s.steps_ended += 1;
                ("torchmem/step".to_string(), step)
            }
            (MarkerKind::Phase, Edge::End) => (format!("torchmem/phase/{}", tag_part(&m.name)), s.step.unwrap_or(0)),
            (MarkerKind::Epoch, Edge::End) => ("torchmem/epoch".to_string(), m.index.unwrap_or(0)),
            _ => return Ok(()),
        };
        let mem = &m.memory;
        let scalars: Vec<(String, f32)> = [
            ("peak_allocated_bytes", mem.peak_allocated_bytes),
            ("peak_reserved_bytes", mem.peak_reserved_bytes),
            ("peak_rss_bytes", mem.peak_rss_bytes),
            ("allocated_bytes", mem.allocated_bytes),
            ("rss_bytes", mem.rss_bytes),
        ]
        .into_iter()
        .filter_map(|(name, v)| v.map(|v| (format!("{prefix}/{name}"), v as f32)))
        .collect();
        if scalars.is_empty() {
            return Ok(());
        }
        let wall = self.wall(m.t_ns);
        self.file(rank)?.write(wall, step, None, &scalars)
    }

    fn apply(&mut self, batch: &RecordBatch) -> std::io::Result<()> {
        for r in &batch.records {
            let t_ns = match r {
                Record::Cpu(s) => s.t_ns,
                Record::Gpu(g) => g.t_ns,
                Record::Torch(t) => t.t_ns,
                _ => continue,
            };
            if t_ns >= self.window_start_ns + WINDOW_NS {
                self.close_window(t_ns)?;
            }
            match r {
                Record::Cpu(s) => {
                    self.note(None, "torchmem/rss_bytes".into(), s.rss_bytes);
                    if let Some(p) = s.pss_bytes {
                        self.note(None, "torchmem/pss_bytes".into(), p);
                    }
                }
                Record::Gpu(g) => {
                    self.note(None, format!("torchmem/gpu{}/used_bytes", g.device), g.used_bytes);
                    if let Some(p) = g.process_bytes {
                        self.note(None, format!("torchmem/gpu{}/process_used_bytes", g.device), p);
                    }
                }
                Record::Torch(t) => {
                    let rank = t.origin.rank;
                    self.torch.insert((t.origin.pid, t.device), (t.allocated_bytes, t.reserved_bytes));
                    // The process's total over its devices.
                    let (a, res) = self
                        .torch
                        .iter()
                        .filter(|((p, _), _)| *p == t.origin.pid)
                        .fold((0, 0), |(a, r), (_, (x, y))| (a + x, r + y));
                    self.note(rank, "torchmem/cuda_allocated_bytes".into(), a);
                    self.note(rank, "torchmem/cuda_reserved_bytes".into(), res);
                }
                _ => {}
            }
        }
        for m in &batch.markers {
            self.marker(m)?;
        }
        for pid in &batch.exited_pids {
            self.torch.retain(|(p, _), _| *p != Some(*pid));
        }
        for f in self.files.values_mut() {
            f.flush()?;
        }
        Ok(())
    }
}

impl Sink for TensorBoardSink {
    fn consume(&mut self, batch: &RecordBatch) -> anyhow::Result<()> {
        self.apply(batch).map_err(|e| anyhow::anyhow!("writing into {}: {e}", self.dir.display()))
    }

    fn finish(&mut self, t_ns: u64) -> anyhow::Result<()> {
        if !self.window_max.is_empty() {
            self.close_window(t_ns.max(self.window_start_ns))?;
        }
        for f in self.files.values_mut() {
            f.flush()?;
        }
        Ok(())
    }

    fn name(&self) -> &'static str {
        "TensorBoard"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_the_standard_check_value() {
        // The CRC-32C check value (RFC 3720 B.4 and every CRC catalogue).
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8a91_36aa);
    }

    #[test]
    fn an_event_encodes_as_protobuf() {
        let e = encode_event(1.5, 300, None, &[("a".into(), 2.0)]);
        let mut want = vec![0x09];
        want.extend_from_slice(&1.5f64.to_le_bytes());
        want.extend_from_slice(&[0x10, 0xac, 0x02]); // 300 as a varint
        want.extend_from_slice(&[0x2a, 0x0a, 0x0a, 0x08, 0x0a, 0x01, b'a', 0x15]);
        want.extend_from_slice(&2.0f32.to_le_bytes());
        assert_eq!(e, want);
        let framed = frame_record(&e);
        assert_eq!(u64::from_le_bytes(framed[..8].try_into().unwrap()), e.len() as u64);
        assert_eq!(&framed[12..12 + e.len()], &e[..]);
    }
}
