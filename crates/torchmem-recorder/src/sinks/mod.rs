//! Where the recorder's records go (issue 9 item 5, py-spy's `Sampler` pattern): the recorder produces
//! `Record`s and hands them, one `RecordBatch` per commit interval, to every `Sink`. The SQLite profile is
//! one sink (`sqlite::SqliteSink`: it takes each batch last and by value, so the profile path costs one move
//! per record and commits exactly where it always did); the live ones (`prometheus`, `tensorboard`) are
//! built only when asked for (`SinkConfig`), and without them the recorder collects nothing extra. The one
//! live sink every run has is `live::LiveSink`: the run's state file for `torchmem top`. The views of the
//! run's latest state (the state file, the Prometheus gauges, `run --live`, `run --status`) share one
//! `live_state::LiveHandle`: `Sinks::flush` folds each batch into it once, before any sink sees the batch.

use std::path::PathBuf;

use torchmem_core::model::{JobPlace, Marker, Profile, RunMeta};
use torchmem_core::sources::gpu::GpuDevice;
use torchmem_core::store::{ProfileWriter, Record};

use crate::live_state::LiveHandle;

pub mod http;
pub mod live;
pub mod prometheus;
pub mod sqlite;
pub mod tensorboard;

/// One process's NVML used memory on one device, as the last tick read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuProcessBytes {
    pub device: u32,
    pub pid: u32,
    pub used_bytes: u64,
}

/// What the recorder produced since the last batch.
#[derive(Debug, Default)]
pub struct RecordBatch {
    /// What the profile stores, in order: samples, kept markers, folded-span rows, blobs.
    pub records: Vec<Record>,
    /// Every marker received, before the keep-or-fold rule (a live view needs each step, not the first
    /// `--keep-spans`). Filled only when a live sink is attached.
    pub markers: Vec<Marker>,
    /// The last tick's NVML per-process readings for the profiled tree (live sinks only).
    pub gpu_processes: Vec<GpuProcessBytes>,
    /// Processes that left the tree since the last batch: their series end.
    pub exited_pids: Vec<u32>,
    /// The batch's time, ns since the run started.
    pub t_ns: u64,
}

/// A consumer of the recorder's records.
pub trait Sink {
    /// Takes one batch (called from the recorder's loop: keep it short, never block on a client).
    fn consume(&mut self, batch: &RecordBatch) -> anyhow::Result<()>;
    /// The same, given the batch to keep; the last sink gets it this way.
    fn consume_owned(&mut self, batch: RecordBatch) -> anyhow::Result<()> {
        self.consume(&batch)
    }
    /// The run ended (`t_ns` since its start): write out what is left, stop serving.
    fn finish(&mut self, t_ns: u64) -> anyhow::Result<()>;
    /// For warnings.
    fn name(&self) -> &'static str;
}

/// What the live sinks know about the run from its start.
#[derive(Debug, Clone, Default)]
pub struct RunContext {
    pub devices: Vec<GpuDevice>,
    pub hostname: String,
    pub command: Vec<String>,
    pub started_unix_s: f64,
    /// The recorder's own rank when it runs as one (`torchrun -m torchmem run`, `srun torchmem run`): its
    /// metrics port may follow its local rank, a taken port falls back to a free one, and its tree-wide
    /// series carry `rank`/`local_rank`.
    pub launch: Option<JobPlace>,
}

/// The sinks of one run: the live ones, then the profile. The recorder pushes records here as it makes
/// them; `flush` hands the batch on at the recorder's commit interval.
pub struct Sinks {
    batch: RecordBatch,
    live: Vec<(Box<dyn Sink>, bool)>,
    /// The run's one live state, folded here once per batch (None: no view of it, no fold).
    state: Option<LiveHandle>,
    store: sqlite::SqliteSink,
}

impl Sinks {
    /// `state`: the run's live state when anything renders it (the sinks built with it, `run --live`,
    /// `run --status`); each batch is folded into it once, before the sinks get the batch.
    pub fn new(store: ProfileWriter, live: Vec<Box<dyn Sink>>, state: Option<LiveHandle>) -> Self {
        Sinks {
            batch: RecordBatch::default(),
            live: live.into_iter().map(|s| (s, false)).collect(),
            state,
            store: sqlite::SqliteSink::new(store),
        }
    }

    /// Whether any sink besides the profile, or the live state, is attached (then markers and NVML
    /// per-process readings are collected for it).
    pub fn live(&self) -> bool {
        !self.live.is_empty() || self.state.is_some()
    }

    pub fn push(&mut self, record: Record) {
        self.batch.records.push(record);
    }

    /// A marker as received, before folding (kept only for live sinks).
    pub fn saw_marker(&mut self, marker: &Marker) {
        if self.live() {
            self.batch.markers.push(marker.clone());
        }
    }

    /// The last tick's NVML per-process readings (live sinks only; replaces the previous tick's).
    pub fn saw_gpu_processes(&mut self, readings: impl FnOnce() -> Vec<GpuProcessBytes>) {
        if self.live() {
            self.batch.gpu_processes = readings();
        }
    }

    pub fn saw_exit(&mut self, pid: u32) {
        if self.live() {
            self.batch.exited_pids.push(pid);
        }
    }

    /// Hands the batch to every sink: the live ones first (a failing one warns once and carries on), then
    /// the profile, whose error is the caller's.
    pub fn flush(&mut self, t_ns: u64) -> torchmem_core::Result<()> {
        let mut batch = std::mem::take(&mut self.batch);
        batch.t_ns = t_ns;
        if self.live() {
            if let Some(state) = &self.state {
                state.fold(&batch);
            }
            for (sink, warned) in &mut self.live {
                if let Err(e) = sink.consume(&batch) {
                    if !*warned {
                        eprintln!("torchmem: warning: the {} output: {e:#}", sink.name());
                        *warned = true;
                    }
                }
            }
            batch.markers = Vec::new();
            batch.gpu_processes = Vec::new();
            batch.exited_pids = Vec::new();
        }
        self.store.write(batch)
    }

    /// Ends every sink: the last batch, then the live sinks' finish, then the profile's metadata.
    pub fn finish_with(mut self, end: impl FnOnce(&mut RunMeta), duration_ns: u64) -> torchmem_core::Result<Profile> {
        let mut batch = std::mem::take(&mut self.batch);
        batch.t_ns = duration_ns;
        if let Some(state) = &self.state {
            state.fold(&batch);
        }
        for (sink, _) in &mut self.live {
            if let Err(e) = sink.consume(&batch).and_then(|_| sink.finish(duration_ns)) {
                eprintln!("torchmem: warning: finishing the {} output: {e:#}", sink.name());
            }
        }
        if let Some(state) = &self.state {
            state.finish(None);
        }
        // A failure here is counted like any other (the run's end says it).
        let _ = self.store.write(batch);
        self.store.finish_with(end, duration_ns)
    }

    /// Why the profile stopped being written, and what was lost so far; None while all is written.
    pub fn write_failure(&self) -> Option<&torchmem_core::model::WriteFailure> {
        self.store.failure()
    }
}

/// Which live sinks to attach to a run (built from `torchmem run`'s options).
#[derive(Debug, Clone, Default)]
pub struct SinkConfig {
    /// Serve Prometheus metrics at this `HOST:PORT` (see [`http::parse_listen_address`]).
    pub metrics: Option<String>,
    /// Add the recorder's local rank to the metrics port (one recorder per rank on a node).
    pub metrics_port_offset_local_rank: bool,
    /// Write the same metrics to this node_exporter textfile.
    pub metrics_textfile: Option<PathBuf>,
    /// Write TensorBoard event files into this directory.
    pub tensorboard: Option<PathBuf>,
}

impl SinkConfig {
    /// Builds the sinks asked for; every way this can fail (port taken, directory not writable) is said
    /// here, before the program starts. The metrics render `state`: give the same handle to `Sinks::new`,
    /// which folds the batches into it.
    pub fn build(&self, ctx: &RunContext, state: &LiveHandle) -> anyhow::Result<Vec<Box<dyn Sink>>> {
        let mut sinks: Vec<Box<dyn Sink>> = Vec::new();
        let metrics = match &self.metrics {
            Some(a) if self.metrics_port_offset_local_rank => {
                Some(http::offset_port(a, ctx.launch.and_then(|l| l.origin.local_rank).unwrap_or(0))?)
            }
            a => a.clone(),
        };
        if metrics.is_some() || self.metrics_textfile.is_some() {
            sinks.push(Box::new(prometheus::PrometheusSink::start(
                metrics.as_deref(),
                self.metrics_textfile.as_deref(),
                ctx,
                state,
            )?));
        }
        if let Some(dir) = &self.tensorboard {
            sinks.push(Box::new(tensorboard::TensorBoardSink::create(dir, ctx)?));
        }
        Ok(sinks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::live_state::fixtures::{cpu, process, torch};
    use crate::live_state::LiveSnapshot;

    /// One record stream through a run's sinks: the state file and the Prometheus sink (textfile and what
    /// a scrape gets) render the same state, folded once per batch however many views there are.
    #[test]
    fn every_view_renders_the_one_fold() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = RunContext { hostname: "h1".into(), command: vec!["t.py".into()], ..Default::default() };
        let state = LiveHandle::for_run(&ctx);
        let profile = dir.path().join("p.sqlite");
        let writer = ProfileWriter::create(&profile, &RunMeta::default()).unwrap();
        // A program pid that has exited (a live pid's /proc RSS would replace the batch's reading).
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let program = child.id();
        child.wait().unwrap();
        state.set_program(program, &profile);
        let textfile = dir.path().join("torchmem.prom");
        let metrics = prometheus::PrometheusSink::start(Some("127.0.0.1:0"), Some(&textfile), &ctx, &state).unwrap();
        let addr = metrics.local_addr().unwrap();
        let scrape = || {
            use std::io::{Read, Write};
            let mut s = std::net::TcpStream::connect(addr).unwrap();
            s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
            let mut out = String::new();
            s.read_to_string(&mut out).unwrap();
            out
        };
        let mut live: Vec<Box<dyn Sink>> = vec![Box::new(metrics)];
        let registered = live::LiveSink::start(&state, &dir.path().join("live"));
        let state_file = registered.path().unwrap().to_path_buf();
        live.push(Box::new(registered));
        let mut sinks = Sinks::new(writer, live, Some(state.clone()));
        assert!(sinks.live(), "markers and NVML readings are collected for the state");

        for r in process(program, "python t.py", 64) {
            sinks.push(r);
        }
        sinks.push(cpu(64));
        sinks.push(Record::Torch(torch(program, 10, 20)));
        sinks.flush(1).unwrap();
        assert_eq!(state.folds(), 1, "one fold per batch, not one per view");
        let file: LiveSnapshot = serde_json::from_str(&std::fs::read_to_string(&state_file).unwrap()).unwrap();
        assert_eq!(file.tree.rss_bytes, Some(64 << 20));
        assert_eq!(file.tree.allocated_bytes, Some(10 << 20));
        assert_eq!(file.program_pid, Some(program));
        // The textfile was written at start (empty state) and is rewritten every 2 s: what a scrape gets
        // is the state now.
        let prom = textfile.exists().then(|| std::fs::read_to_string(&textfile).unwrap()).unwrap();
        assert!(!prom.contains("torchmem_tree_rss_bytes"), "written at start, before any batch\n{prom}");
        let got = scrape();
        assert!(got.contains(&format!("torchmem_tree_rss_bytes {}", 64u64 << 20)), "{got}");
        let l = format!(r#"pid="{program}",rank="0""#);
        assert!(got.contains(&format!("torchmem_cuda_allocated_bytes{{{l},device=\"0\"}} {}", 10u64 << 20)));

        sinks.push(Record::Torch(torch(program, 30, 40)));
        sinks.flush(2).unwrap();
        assert_eq!(state.folds(), 2);
        assert!(scrape().contains(&format!("torchmem_cuda_allocated_bytes{{{l},device=\"0\"}} {}", 30u64 << 20)));
        let profile = sinks.finish_with(|_| {}, 3).unwrap();
        assert_eq!(state.folds(), 3, "the last batch, folded once too");
        assert_eq!(profile.torch.len(), 2, "the profile got every record");
        assert!(!state_file.exists(), "the state file goes with the run");
        let prom = std::fs::read_to_string(&textfile).unwrap();
        assert!(!prom.contains("torchmem_tree_rss_bytes") && !prom.contains("pid="), "ended: {prom}");
        // The textfile's end of the run does not change the state the other views render.
        let last = state.snapshot();
        assert!(last.finished);
        assert_eq!(last.tree.allocated_bytes, Some(30 << 20));
    }

    /// Without any view of the live state, nothing is folded and nothing extra collected.
    #[test]
    fn no_view_no_fold() {
        let dir = tempfile::tempdir().unwrap();
        let writer = ProfileWriter::create(&dir.path().join("p.sqlite"), &RunMeta::default()).unwrap();
        let mut sinks = Sinks::new(writer, Vec::new(), None);
        assert!(!sinks.live());
        sinks.push(cpu(64));
        sinks.flush(1).unwrap();
        sinks.finish_with(|_| {}, 2).unwrap();
    }
}
