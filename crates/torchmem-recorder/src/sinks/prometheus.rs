//! The Prometheus sink (`torchmem run --metrics HOST:PORT`, `--metrics-textfile PATH`): renders the run's
//! one live state (`live_state::LiveHandle`, which `Sinks` folds each batch into; the state `top`, `--live`
//! and the status line render too, and the sink keeps no fold of its own) when scraped (or every few
//! seconds for the textfile), with the official `prometheus-client` crate. All gauges, in bytes (Prometheus base units);
//! labels `pid`, `rank`, `local_rank` (when the process said), `device` (NVML index) and `UUID` (DCGM's
//! label name, so `on(UUID)` joins with DCGM_FI_DEV_FB_USED work). A value never measured has no series
//! (no CUDA: no `torchmem_cuda_*` at all, never 0), and a process's series go when it leaves the tree.
//!
//! Series: `torchmem_cuda_{allocated,reserved,peak_allocated,peak_reserved}_bytes` (PyTorch's allocator,
//! per process and device), `torchmem_gpu_process_used_bytes` (NVML, per process and device),
//! `torchmem_gpu_{used,total}_bytes` (NVML, per device), `torchmem_process_{rss,pss,uss}_bytes` (per
//! process), `torchmem_tree_{rss,pss}_bytes` (the whole profiled tree), `torchmem_step`, `torchmem_epoch`
//! (the last index started), `torchmem_phase{phase}` (1 for the phase open now, 0 for the others seen: a
//! state set as a gauge, which every text parser reads), `torchmem_process_info{pid,ppid,host,command} 1`,
//! `torchmem_breakdown_bytes{category,device}` (what the memory is at the process's last step or phase
//! boundary that carried a breakdown: parameters, gradients, optimizer_state, activations, inputs, other,
//! cache, non_torch; `device` is the breakdown's own `cuda:N`/`cpu`; a category not measured has no series).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::live_state::{LiveHandle, LiveState};

use super::http::{MetricsServer, Render};
use super::{RecordBatch, RunContext, Sink};

/// How often the textfile is rewritten.
pub const TEXTFILE_INTERVAL_MS: u64 = 2000;

type Labels = Vec<(&'static str, String)>;

/// How the sink renders a run's live state (`crate::live_state::LiveState`, the one fold behind `top`'s
/// state file and the status line too) as gauges. It holds no state of its own.
#[derive(Debug, Clone, Default)]
pub struct MetricsView {
    /// `rank`/`local_rank` of the recorder itself when it runs as one rank (one `torchmem run` per rank):
    /// its tree-wide series carry them, so the ranks of a node stay apart.
    recorder: Labels,
}

impl MetricsView {
    pub fn new(ctx: &RunContext) -> Self {
        MetricsView {
            recorder: ctx
                .launch
                .map(|l| {
                    [("rank", l.origin.rank), ("local_rank", l.origin.local_rank)]
                        .into_iter()
                        .filter_map(|(k, v)| Some((k, v?.to_string())))
                        .collect()
                })
                .unwrap_or_default(),
        }
    }

    /// pid, rank and local_rank, as far as known.
    fn who(live: &LiveState, pid: Option<u32>) -> Labels {
        let mut l = Labels::new();
        if let Some(pid) = pid {
            l.push(("pid", pid.to_string()));
            if let Some(o) = live.identity.get(&pid) {
                if let Some(r) = o.rank {
                    l.push(("rank", r.to_string()));
                }
                if let Some(r) = o.local_rank {
                    l.push(("local_rank", r.to_string()));
                }
            }
        }
        l
    }

    fn on_device(live: &LiveState, mut l: Labels, device: u32) -> Labels {
        l.push(("device", device.to_string()));
        if let Some(u) = live.device_uuids.get(&device).filter(|u| !u.is_empty()) {
            l.push(("UUID", u.clone()));
        }
        l
    }

    /// A registry holding `live`'s current values.
    pub fn registry(&self, live: &LiveState) -> Registry {
        let who = |pid: Option<u32>| Self::who(live, pid);
        let on_device = |l: Labels, device: u32| Self::on_device(live, l, device);
        // Families are registered at the end, and only those with a series: a value never measured (no
        // CUDA) has no HELP/TYPE lines either.
        let families = std::cell::RefCell::new(Vec::new());
        let gauge = |name: &'static str, help: &'static str| {
            let f = Family::<Labels, Gauge>::default();
            families.borrow_mut().push((name, help, f.clone()));
            f
        };
        let set = |f: &Family<Labels, Gauge>, l: &Labels, v: u64| {
            f.get_or_create(l).set(v.min(i64::MAX as u64) as i64);
        };
        let alloc = gauge("torchmem_cuda_allocated_bytes", "Bytes PyTorch's caching allocator has handed out");
        let reserved = gauge("torchmem_cuda_reserved_bytes", "Bytes PyTorch's caching allocator holds from the driver");
        let peak_alloc = gauge(
            "torchmem_cuda_peak_allocated_bytes",
            "PyTorch's peak allocated bytes since the process started (the highest the allocator reached)",
        );
        let peak_res = gauge(
            "torchmem_cuda_peak_reserved_bytes",
            "PyTorch's peak reserved bytes since the process started (the highest the allocator reached)",
        );
        for ((pid, device), t) in &live.torch {
            let l = on_device(who(*pid), *device);
            set(&alloc, &l, t.allocated_bytes);
            set(&reserved, &l, t.reserved_bytes);
            set(&peak_alloc, &l, t.peak_allocated_bytes);
            set(&peak_res, &l, t.peak_reserved_bytes);
        }
        let gpu_proc = gauge(
            "torchmem_gpu_process_used_bytes",
            "GPU memory NVML counts for the process on the device (CUDA context included)",
        );
        for ((device, pid), b) in &live.gpu_process {
            set(&gpu_proc, &on_device(who(Some(*pid)), *device), *b);
        }
        let used = gauge("torchmem_gpu_used_bytes", "GPU memory used on the device, all processes (NVML)");
        let total = gauge("torchmem_gpu_total_bytes", "GPU memory on the device (NVML)");
        for (device, g) in &live.gpus {
            let l = on_device(Labels::new(), *device);
            set(&used, &l, g.used_bytes);
            set(&total, &l, g.total_bytes);
        }
        let rss = gauge("torchmem_process_rss_bytes", "Resident set size of the process");
        let pss = gauge("torchmem_process_pss_bytes", "Proportional set size of the process (shared pages split)");
        let uss = gauge("torchmem_process_uss_bytes", "Unique set size of the process (private pages)");
        let info = gauge("torchmem_process_info", "A process of the profiled tree (value 1)");
        for (pid, p) in &live.processes {
            let l = who(Some(*pid));
            for (f, v) in [(&rss, p.rss_bytes), (&pss, p.pss_bytes), (&uss, p.uss_bytes)] {
                if let Some(v) = v {
                    set(f, &l, v);
                }
            }
            let mut l = l;
            l.push(("ppid", p.ppid.to_string()));
            l.push(("host", live.base.hostname.clone()));
            l.push(("command", p.command.chars().take(200).collect()));
            set(&info, &l, 1);
        }
        let tree_rss = gauge("torchmem_tree_rss_bytes", "Summed RSS of the whole profiled process tree");
        let tree_pss = gauge("torchmem_tree_pss_bytes", "Summed PSS of the whole profiled process tree");
        if let Some(v) = live.base.tree.rss_bytes {
            set(&tree_rss, &self.recorder, v);
        }
        if let Some(v) = live.base.tree.pss_bytes {
            set(&tree_pss, &self.recorder, v);
        }
        let breakdown = gauge(
            "torchmem_breakdown_bytes",
            "What the memory is at the last step or phase boundary, by category (counted by storage)",
        );
        for (pid, s) in &live.spans {
            for e in &s.breakdown {
                for c in torchmem_core::breakdown::Category::STACKED {
                    if let Some(v) = e.get(c) {
                        let mut l = who(*pid);
                        l.push(("category", c.as_str().to_string()));
                        l.push(("device", e.device.clone()));
                        set(&breakdown, &l, v);
                    }
                }
            }
        }
        let step = gauge("torchmem_step", "The program's current step index");
        let epoch = gauge("torchmem_epoch", "The program's current epoch index");
        let phase = gauge("torchmem_phase", "1 for the phase open now (innermost), 0 for the other phases seen");
        for (pid, s) in &live.spans {
            let l = who(*pid);
            if let Some(v) = s.step {
                step.get_or_create(&l).set(v);
            }
            if let Some(v) = s.epoch {
                epoch.get_or_create(&l).set(v);
            }
            for name in &s.phases_seen {
                let mut pl = l.clone();
                pl.push(("phase", name.clone()));
                phase.get_or_create(&pl).set(i64::from(s.phases_open.last() == Some(name)));
            }
        }
        let mut reg = Registry::default();
        for (name, help, f) in families.into_inner() {
            if has_series(&f) {
                reg.register(name, help, f);
            }
        }
        reg
    }

    /// `live` in the Prometheus text format (0.0.4), or OpenMetrics.
    pub fn encode(&self, live: &LiveState, openmetrics: bool) -> (String, &'static str) {
        let reg = self.registry(live);
        let mut out = String::new();
        if openmetrics {
            prometheus_client::encoding::text::encode(&mut out, &reg).expect("encoding into a String");
            (out, "application/openmetrics-text; version=1.0.0; charset=utf-8")
        } else {
            prometheus_client::encoding::prometheus_text::encode(&mut out, &reg).expect("encoding into a String");
            (out, prometheus_client::encoding::prometheus_text::CONTENT_TYPE)
        }
    }
}

/// Whether a family holds any series (the crate has no `len`: encode it alone and look for a sample line).
fn has_series(f: &Family<Labels, Gauge>) -> bool {
    let mut reg = Registry::default();
    reg.register("x", "", f.clone());
    let mut out = String::new();
    prometheus_client::encoding::prometheus_text::encode(&mut out, &reg).is_ok()
        && out.lines().any(|l| !l.starts_with('#'))
}

/// Writes `text` to `path` atomically: a temporary file beside it (not `*.prom`, so the collector never
/// reads it half-written), then renamed over it.
pub fn write_textfile(path: &Path, text: &str) -> std::io::Result<()> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

pub struct PrometheusSink {
    /// The run's live state (folded by `Sinks`, shared with the HTTP thread and the other views).
    live: LiveHandle,
    view: MetricsView,
    server: Option<MetricsServer>,
    textfile: Option<PathBuf>,
    last_textfile: Option<Instant>,
}

impl PrometheusSink {
    /// Binds the server (when `listen` is given) and checks the textfile's directory, before the run. The
    /// gauges render `live`, which the run's `Sinks` folds the batches into.
    pub fn start(
        listen: Option<&str>,
        textfile: Option<&Path>,
        ctx: &RunContext,
        live: &LiveHandle,
    ) -> anyhow::Result<Self> {
        let view = MetricsView::new(ctx);
        if let Some(p) = textfile {
            if p.extension().is_none_or(|e| e != "prom") {
                anyhow::bail!(
                    "--metrics-textfile {}: the name must end in .prom (node_exporter's textfile collector reads only *.prom files)",
                    p.display()
                );
            }
            // Another exporter's textfile is never replaced (`output_path::check_output`'s rule).
            crate::output_path::check_output(
                p,
                &[],
                None,
                "--metrics-textfile",
                crate::output_path::OutputKind::PromTextfile,
            )?;
            // The first write says now whether the directory is writable.
            write_textfile(p, &live.read(|s| view.encode(s, false)).0).map_err(|e| {
                anyhow::anyhow!(
                    "--metrics-textfile {}: cannot write it ({e}). Give a writable directory (node_exporter's --collector.textfile.directory)",
                    p.display()
                )
            })?;
        }
        let server = match listen {
            Some(addr) => {
                let (live, view) = (live.clone(), view.clone());
                let render: Render = Arc::new(move |om| live.read(|s| view.encode(s, om)));
                let server = match MetricsServer::start(addr, render.clone()) {
                    // A recorder that is one rank of a job: a taken port must not end the rank (and the job).
                    Err(e) if ctx.launch.is_some() && e.downcast_ref::<super::http::PortInUse>().is_some() => {
                        let (host, _) = addr.rsplit_once(':').unwrap_or((addr, ""));
                        let server = MetricsServer::start(&format!("{host}:0"), render)?;
                        eprintln!(
                            "torchmem: warning: {e}; this rank's recorder serves on a free port instead (--metrics-port-offset local-rank gives each rank of a node its own)"
                        );
                        server
                    }
                    other => other?,
                };
                let rank = ctx.launch.and_then(|l| l.origin.rank).map(|r| format!(" (rank {r})")).unwrap_or_default();
                eprintln!("torchmem: Prometheus metrics at http://{}/metrics{rank}", server.local_addr());
                Some(server)
            }
            None => None,
        };
        Ok(PrometheusSink {
            live: live.clone(),
            view,
            server,
            textfile: textfile.map(Path::to_path_buf),
            last_textfile: Some(Instant::now()),
        })
    }

    /// The server's address (tests).
    pub fn local_addr(&self) -> Option<std::net::SocketAddr> {
        self.server.as_ref().map(|s| s.local_addr())
    }

    /// The metrics now (what a scrape gets).
    pub fn encode(&self, openmetrics: bool) -> (String, &'static str) {
        self.live.read(|s| self.view.encode(s, openmetrics))
    }

    fn write_textfile_now(&mut self, text: impl FnOnce() -> String) -> anyhow::Result<()> {
        if let Some(p) = &self.textfile {
            write_textfile(p, &text()).map_err(|e| anyhow::anyhow!("writing {}: {e}", p.display()))?;
            self.last_textfile = Some(Instant::now());
        }
        Ok(())
    }
}

impl Sink for PrometheusSink {
    /// The batch is already in the live state (`Sinks` folded it): rewrite the textfile when due.
    fn consume(&mut self, _batch: &RecordBatch) -> anyhow::Result<()> {
        if self.textfile.is_some()
            && self.last_textfile.is_none_or(|t| t.elapsed() >= Duration::from_millis(TEXTFILE_INTERVAL_MS))
        {
            let (live, view) = (&self.live, &self.view);
            let text = live.read(|s| view.encode(s, false).0);
            self.write_textfile_now(|| text)?;
        }
        Ok(())
    }

    /// The run ended: the last textfile has no process series (a textfile left behind must not show a
    /// finished job's memory as current); the devices' NVML series stay. The shared state itself is not
    /// changed (the other views still show the run's last readings).
    fn finish(&mut self, _t_ns: u64) -> anyhow::Result<()> {
        if self.textfile.is_some() {
            let mut last = self.live.read(LiveState::clone);
            last.end_of_run();
            let text = self.view.encode(&last, false).0;
            self.write_textfile_now(|| text)?;
        }
        self.server = None;
        Ok(())
    }

    fn name(&self) -> &'static str {
        "Prometheus metrics"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use torchmem_core::model::{Edge, Marker, MarkerKind, Origin, ProcessInfo, ProcessSample, TorchSample};
    use torchmem_core::record::Record;
    use torchmem_core::sources::gpu::GpuDevice;

    fn origin(pid: u32, rank: Option<u32>) -> Origin {
        Origin { pid: Some(pid), rank, local_rank: rank, world_size: rank.map(|_| 2) }
    }

    fn marker(pid: u32, kind: MarkerKind, edge: Edge, name: &str, index: Option<i64>) -> Marker {
        Marker { index, origin: origin(pid, Some(1)), ..Marker::new(1, kind, edge, name) }
    }

    #[test]
    fn series_carry_identity_and_end_with_their_process() {
        let ctx = RunContext {
            devices: vec![GpuDevice { index: 0, name: "fake".into(), uuid: "GPU-abc".into(), total_bytes: 80 << 30 }],
            hostname: "h1".into(),
            ..Default::default()
        };
        let (view, mut st) = (MetricsView::new(&ctx), LiveState::new(&ctx, 1, None, None));
        let torch = TorchSample {
            t_ns: 1,
            device: 0,
            allocated_bytes: 1 << 20,
            reserved_bytes: 2 << 20,
            peak_allocated_bytes: 3 << 20,
            peak_reserved_bytes: 4 << 20,
            active_bytes: 0,
            inactive_split_bytes: 0,
            origin: origin(42, Some(1)),
        };
        let batch = RecordBatch {
            records: vec![
                Record::ProcessSeen(ProcessInfo {
                    pid: 42,
                    ppid: 1,
                    cmdline: "python t.py".into(),
                    first_t_ns: 0,
                    last_t_ns: 0,
                }),
                Record::Process(ProcessSample {
                    t_ns: 1,
                    pid: 42,
                    rss_bytes: 5,
                    pss_bytes: Some(4),
                    uss_bytes: None,
                    gpu_bytes: None,
                }),
                Record::Torch(torch.clone()),
            ],
            markers: vec![
                marker(42, MarkerKind::Step, Edge::Start, "step", Some(7)),
                marker(42, MarkerKind::Phase, Edge::Start, "forward", None),
                marker(42, MarkerKind::Phase, Edge::End, "forward", None),
                marker(42, MarkerKind::Phase, Edge::Start, "backward", None),
            ],
            ..Default::default()
        };
        st.apply(&batch);
        let (text, _) = view.encode(&st, false);
        let l = r#"pid="42",rank="1",local_rank="1""#;
        assert!(
            text.contains(&format!(r#"torchmem_cuda_allocated_bytes{{{l},device="0",UUID="GPU-abc"}} 1048576"#)),
            "{text}"
        );
        assert!(text.contains(&format!("torchmem_step{{{l}}} 7")), "{text}");
        // A later sample's peak is the allocator's since torchmem's last window reset (lower here): the peak
        // gauges keep the highest since the start.
        let later = TorchSample { t_ns: 2, allocated_bytes: 1 << 19, peak_allocated_bytes: 1 << 20, ..torch.clone() };
        st.apply(&RecordBatch { records: vec![Record::Torch(later)], ..Default::default() });
        let (text, _) = view.encode(&st, false);
        let dev = r#"device="0",UUID="GPU-abc""#;
        assert!(text.contains(&format!("torchmem_cuda_allocated_bytes{{{l},{dev}}} 524288")), "{text}");
        assert!(text.contains(&format!("torchmem_cuda_peak_allocated_bytes{{{l},{dev}}} 3145728")), "{text}");
        assert!(text.contains(&format!("torchmem_cuda_peak_reserved_bytes{{{l},{dev}}} 4194304")), "{text}");
        assert!(text.contains(&format!(r#"torchmem_phase{{{l},phase="backward"}} 1"#)), "{text}");
        assert!(text.contains(&format!(r#"torchmem_phase{{{l},phase="forward"}} 0"#)), "{text}");
        assert!(text.contains(&format!("torchmem_process_pss_bytes{{{l}}} 4")), "{text}");
        assert!(!text.contains("torchmem_process_uss_bytes"), "never measured: no series, no HELP\n{text}");
        assert!(!text.contains("torchmem_gpu_used_bytes"), "no NVML reading: no series\n{text}");
        assert!(text.contains(r#"command="python t.py""#), "{text}");
        assert!(!text.contains("torchmem_breakdown_bytes"), "no breakdown yet: no series\n{text}");
        // A boundary with a breakdown (hand-built): its categories become gauges, the unmeasured ones not.
        let mut end = marker(42, MarkerKind::Phase, Edge::End, "backward", None);
        end.breakdown = Some(vec![torchmem_core::model::DeviceBreakdown {
            device: "cuda:0".into(),
            parameters_bytes: Some(1000),
            gradients_bytes: Some(1000),
            cache_bytes: Some(77),
            ..Default::default()
        }]);
        st.apply(&RecordBatch { markers: vec![end], ..Default::default() });
        let (text, _) = view.encode(&st, false);
        assert!(
            text.contains(&format!(r#"torchmem_breakdown_bytes{{{l},category="gradients",device="cuda:0"}} 1000"#)),
            "{text}"
        );
        assert!(text.contains(&format!(r#"torchmem_breakdown_bytes{{{l},category="cache",device="cuda:0"}} 77"#)));
        assert!(!text.contains(r#"category="activations""#), "not measured: no series\n{text}");
        st.apply(&RecordBatch { exited_pids: vec![42], ..Default::default() });
        let (text, _) = view.encode(&st, true);
        assert!(!text.contains(r#"pid="42""#), "a process's series end with it\n{text}");
        assert!(text.ends_with("# EOF\n"));
    }

    #[test]
    fn a_rank_recorder_labels_its_tree_and_a_hello_labels_a_process_at_once() {
        use torchmem_core::model::{JobPlace, Origin};
        let place = JobPlace {
            origin: Origin { rank: Some(3), local_rank: Some(1), world_size: Some(4), ..Default::default() },
            ..Default::default()
        };
        let ctx = RunContext { launch: Some(place), ..Default::default() };
        let (view, mut st) = (MetricsView::new(&ctx), LiveState::new(&ctx, 1, None, None));
        let hello = serde_json::json!({"pid": 42, "rank": 3, "local_rank": 1, "world_size": 4, "t_ns": 1});
        st.apply(&RecordBatch {
            records: vec![
                Record::Cpu(torchmem_core::model::CpuSample {
                    t_ns: 1,
                    rss_bytes: 9,
                    pss_bytes: None,
                    uss_bytes: None,
                    process_count: 1,
                }),
                Record::Blob {
                    t_ns: 1,
                    origin: Default::default(),
                    blob: torchmem_core::record::Blob::from_parts("identity".into(), hello),
                },
                Record::Process(ProcessSample {
                    t_ns: 1,
                    pid: 42,
                    rss_bytes: 5,
                    pss_bytes: None,
                    uss_bytes: None,
                    gpu_bytes: None,
                }),
            ],
            ..Default::default()
        });
        let (text, _) = view.encode(&st, false);
        assert!(text.contains(r#"torchmem_tree_rss_bytes{rank="3",local_rank="1"} 9"#), "{text}");
        assert!(text.contains(r#"torchmem_process_rss_bytes{pid="42",rank="3",local_rank="1"} 5"#), "{text}");
    }

    #[test]
    fn textfile_is_replaced_atomically_and_must_be_a_prom_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("torchmem.prom");
        write_textfile(&p, "a 1\n").unwrap();
        write_textfile(&p, "a 2\n").unwrap();
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "a 2\n");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1, "no temporary file left");
        let bad = PrometheusSink::start(
            None,
            Some(&dir.path().join("m.txt")),
            &RunContext::default(),
            &LiveHandle::default(),
        );
        assert!(bad.err().unwrap().to_string().contains("must end in .prom"));
        let missing = PrometheusSink::start(
            None,
            Some(&dir.path().join("no/such/m.prom")),
            &RunContext::default(),
            &LiveHandle::default(),
        );
        assert!(missing.err().unwrap().to_string().contains("does not exist"));
    }

    #[test]
    fn another_exporters_textfile_is_never_replaced_ours_is() {
        let dir = tempfile::tempdir().unwrap();
        let theirs = dir.path().join("node.prom");
        std::fs::write(&theirs, "# HELP node_load1 x\nnode_load1 0.5\n").unwrap();
        let e = PrometheusSink::start(None, Some(&theirs), &RunContext::default(), &LiveHandle::default())
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("is not a textfile of torchmem's metrics") && e.contains("never overwrites"), "{e}");
        assert_eq!(std::fs::read_to_string(&theirs).unwrap(), "# HELP node_load1 x\nnode_load1 0.5\n");
        let ours = dir.path().join("torchmem.prom");
        std::fs::write(&ours, "# HELP torchmem_tree_rss_bytes x\ntorchmem_tree_rss_bytes 9\n").unwrap();
        assert!(PrometheusSink::start(None, Some(&ours), &RunContext::default(), &LiveHandle::default()).is_ok());
        let empty = dir.path().join("empty.prom");
        std::fs::write(&empty, "").unwrap();
        assert!(PrometheusSink::start(None, Some(&empty), &RunContext::default(), &LiveHandle::default()).is_ok());
    }
}
