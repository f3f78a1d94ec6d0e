//! Distributed runs (torchrun, Slurm, `torch.distributed`): the ranks of one or several profiles (one per
//! node, or one per `srun` task) merged into one view. Per rank: its process, host and GPU, peaks (PyTorch
//! allocated and reserved, NVML, CPU RSS), non-torch GPU memory (NVML process bytes − reserved: CUDA
//! context, NCCL, library workspaces), steps done and where it stopped. Across ranks: imbalance (max/min
//! and which rank), per phase too; the rank × GPU matrix of NVML per-process bytes with **foreign contexts**
//! (a rank holding memory on a GPU that is not its own) and their likely cause; per-step peaks aligned by
//! step number, not wall clock; the first rank to fail, with its OOM post-mortem when `on_oom` sent one.
//!
//! Where the facts come from: identity (pid, RANK, LOCAL_RANK, WORLD_SIZE) from the `identity` blobs (each
//! process's hello) and from every marker and allocator sample; the node (`GROUP_RANK`) and attempt
//! (`TORCHELASTIC_RESTART_COUNT`) from the hello, else from the recorder's own launch (`RunMeta::launch`),
//! so the attempts of a restarted job are rows of their own, told apart; per (pid, GPU) NVML bytes from the
//! `gpu_processes` blob the recorder keeps (`GPU_PROCESSES_BLOB`); the OOM post-mortem from `oom` blobs.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde::Serialize;

use super::spans::{spans, Span};
use crate::model::*;
use crate::record::{Blob, Identity, OomPostMortem};

/// Blob names, kept for callers of the v2 names (the kinds are `record::Blob`).
pub const IDENTITY_BLOB: &str = Blob::IDENTITY;
pub const GPU_PROCESSES_BLOB: &str = Blob::GPU_PROCESSES;
pub const OOM_BLOB: &str = Blob::OOM;
pub use crate::record::{GpuIdentity, GpuProcessPeak, GpuProcesses};

/// Where a rank's own GPU was read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceSource {
    /// The GPU its PyTorch allocator samples came from.
    Allocator,
    /// The GPU its Monitor markers read.
    Markers,
    /// Assumed: GPU LOCAL_RANK (torchrun's convention), where no allocator data says.
    LocalRank,
    /// The GPU where NVML saw most of its memory.
    Nvml,
}

/// One rank of the job (one process; a restarted rank has one row per attempt).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RankRow {
    pub rank: u32,
    pub local_rank: Option<u32>,
    pub world_size: Option<u32>,
    /// Its node in the job (torchrun's `GROUP_RANK`, Slurm's `SLURM_NODEID`), when launched so.
    pub group_rank: Option<u32>,
    /// Its attempt: 0 the first time, 1 after one restart (`TORCHELASTIC_RESTART_COUNT`,
    /// `SLURM_RESTART_COUNT`); None where the launch did not say.
    pub restart_count: Option<u32>,
    pub host: String,
    pub pid: u32,
    /// The profile file it was read from.
    pub profile: String,
    /// Other processes that said they are this rank (DataLoader workers inherit RANK).
    pub other_pids: Vec<u32>,
    /// Its GPU (NVML index on its host), None on a CPU-only run.
    pub device: Option<u32>,
    pub device_source: Option<DeviceSource>,
    pub gpu_uuid: Option<String>,
    pub gpu_name: Option<String>,
    pub peak_allocated_bytes: Option<u64>,
    pub peak_reserved_bytes: Option<u64>,
    /// NVML: this process's memory on its own GPU (CUDA context included).
    pub peak_nvml_bytes: Option<u64>,
    /// NVML peak − reserved peak on its own GPU: CUDA context + NCCL + library workspaces.
    pub non_torch_bytes: Option<u64>,
    /// NVML: this process's memory on GPUs that are not its own (foreign contexts).
    pub foreign_nvml_bytes: u64,
    /// The process's CPU RSS peak (kernel high-water mark, per-process samples, its markers).
    pub peak_rss_bytes: Option<u64>,
    /// Steps started (kept and folded).
    pub steps: u64,
    /// The span(s) still open when it stopped, innermost last ("step 7", "phase backward").
    pub stopped_inside: Vec<String>,
    /// When it was last seen, seconds since the Unix epoch (the recorder's clock on its host).
    pub last_seen_unix_s: Option<f64>,
    /// The `on_oom` post-mortem this process sent, if any.
    pub oom: Option<Box<OomPostMortem>>,
}

/// A metric's spread over the ranks.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Imbalance {
    /// e.g. "peak allocated", or "phase backward: peak allocated".
    pub what: String,
    pub max_bytes: u64,
    pub max_rank: u32,
    pub min_bytes: u64,
    pub min_rank: u32,
    pub median_bytes: u64,
    /// max / min (None when min is 0).
    pub max_over_min: Option<f64>,
    pub max_minus_min_bytes: u64,
}

/// One cell of the rank × GPU matrix: a process's NVML memory on one GPU of its host.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MatrixCell {
    /// None: a process of the run that is not a rank (the launcher, a helper).
    pub rank: Option<u32>,
    pub pid: u32,
    pub host: String,
    pub device: u32,
    pub gpu_uuid: Option<String>,
    pub peak_bytes: u64,
    /// When NVML first listed the process on this GPU (ns since that recorder's start).
    pub first_t_ns: u64,
    /// The rank's own GPU.
    pub own: bool,
    /// PyTorch reserved nothing on this GPU in this process: a bare CUDA context (plus libraries).
    pub context_only: bool,
}

/// A rank holding memory on a GPU that is not its own.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ForeignContext {
    pub rank: u32,
    pub pid: u32,
    pub host: String,
    pub device: u32,
    pub own_device: Option<u32>,
    pub bytes: u64,
    /// The likely cause (its sentence, with the fix: `report::ranks::foreign_cause_text`, JSON's `cause`).
    #[serde(skip)]
    pub cause: ForeignCause,
}

/// Why a rank holds memory on a GPU that is not its own, from when the context appeared.
#[derive(Debug, Clone, PartialEq)]
pub enum ForeignCause {
    /// More than half a second after the rank's own context: something put memory there later.
    Later { after_s: f64, after: Option<MarkerAt> },
    /// With or before the rank's own context: CUDA was used before `torch.cuda.set_device`.
    Early { after: Option<MarkerAt> },
}

/// The marker a rank had reached when something happened.
#[derive(Debug, Clone, PartialEq)]
pub struct MarkerAt {
    pub kind: MarkerKind,
    pub name: String,
    pub edge: Edge,
}

/// Why the first rank to fail is said to have failed (its words: `report::ranks::failure_text`).
#[derive(Debug, Clone, PartialEq)]
pub enum Failure {
    /// It sent an `on_oom` post-mortem.
    Oom,
    /// It stopped inside these spans ("step 7", "phase backward"), the other ranks of its attempt running
    /// this many seconds longer where they did.
    StoppedInside { spans: Vec<String>, others_longer_s: Option<f64> },
}

/// What the merge warns about (its sentence: `report::ranks::warning_text`).
#[derive(Debug, Clone, PartialEq)]
pub enum RankWarning {
    /// The same rank of the same attempt in two profiles: (profile, pid, host) of each.
    SameRankTwice { rank: u32, first: (String, u32, String), second: (String, u32, String) },
    /// The ranks say different WORLD_SIZEs.
    WorldSizesDisagree { sizes: Vec<u32> },
    /// WORLD_SIZE says ranks that no profile holds.
    MissingRanks { world_size: u32, ranks: Vec<u32> },
}

/// One rank's peaks inside one step, for step-aligned timelines.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepPeak {
    /// The step's number (its index when the program gave one, else its ordinal in that rank).
    pub step: i64,
    pub duration_ns: Option<u64>,
    pub peak_allocated_bytes: Option<u64>,
    pub peak_reserved_bytes: Option<u64>,
    pub peak_rss_bytes: Option<u64>,
}

/// The rank that failed first.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FirstFailure {
    pub rank: u32,
    pub pid: u32,
    pub host: String,
    /// The attempt it failed in (a restarted job's first attempt, typically).
    pub restart_count: Option<u32>,
    /// An `on_oom` post-mortem, or the spans it stopped inside (JSON's `what`: "CUDA out of memory", "stopped
    /// inside step 7").
    #[serde(skip)]
    pub what: Failure,
    pub oom: Option<Box<OomPostMortem>>,
}

/// One attempt of the job (a torchrun restart starts a new one): its ranks and the profiles holding them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Attempt {
    /// None: the launch did not say (not torchrun, or an older profile).
    pub restart_count: Option<u32>,
    pub ranks: Vec<u32>,
    pub profiles: Vec<String>,
}

/// The merged view of every rank.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RankReport {
    pub world_size: Option<u32>,
    pub hosts: Vec<String>,
    pub profiles: Vec<String>,
    /// Every rank's process, by rank, then attempt.
    pub ranks: Vec<RankRow>,
    /// The job's attempts in order (one unless it was restarted); imbalance compares the last one's ranks.
    pub attempts: Vec<Attempt>,
    /// Ranks 0..world_size that no profile holds.
    pub missing_ranks: Vec<u32>,
    pub imbalance: Vec<Imbalance>,
    pub matrix: Vec<MatrixCell>,
    pub foreign_contexts: Vec<ForeignContext>,
    /// Per rank (same order as `ranks`): its steps' peaks in order.
    pub steps: Vec<Vec<StepPeak>>,
    pub first_failure: Option<FirstFailure>,
    /// Problems with the inputs (the same rank in two profiles, …), one sentence each.
    #[serde(skip)]
    pub warnings: Vec<RankWarning>,
}

/// Every process's identity a profile knows, by pid (the most complete one seen).
fn identities(p: &Profile) -> BTreeMap<u32, Origin> {
    let mut out: BTreeMap<u32, Origin> = BTreeMap::new();
    let mut note = |o: &Origin| {
        if let Some(pid) = o.pid {
            let e = out.entry(pid).or_insert(*o);
            if e.rank.is_none() && o.rank.is_some() {
                *e = *o;
            }
        }
    };
    for b in &p.blobs {
        if let Blob::Identity(i) = b {
            note(&i.origin);
        }
    }
    p.markers.iter().for_each(|m| note(&m.origin));
    p.torch.iter().for_each(|s| note(&s.origin));
    p.aggregates.iter().for_each(|a| note(&a.origin));
    p.line_profile_origins.iter().for_each(&mut note);
    out
}

/// Every process's node and attempt, by pid: from its hello, else from the recorder's own launch (the
/// recorder ran as one rank: its program inherited the same variables).
fn launches(p: &Profile) -> BTreeMap<u32, Launch> {
    let mut out: BTreeMap<u32, Launch> = BTreeMap::new();
    for b in &p.blobs {
        if let Blob::Identity(Identity { origin: Origin { pid: Some(pid), .. }, launch: l, .. }) = b {
            let e = out.entry(*pid).or_default();
            e.group_rank = l.group_rank.or(e.group_rank);
            e.restart_count = l.restart_count.or(e.restart_count);
        }
    }
    out
}

/// Whether any profile holds a rank (a distributed launch): the rank view applies.
pub fn is_distributed(profiles: &[Profile]) -> bool {
    profiles.iter().any(|p| identities(p).values().any(|o| o.rank.is_some()))
}

fn most_common<T: Ord + Copy>(items: impl Iterator<Item = T>) -> Option<T> {
    let mut n: BTreeMap<T, usize> = BTreeMap::new();
    for i in items {
        *n.entry(i).or_default() += 1;
    }
    n.into_iter().max_by_key(|&(k, c)| (c, std::cmp::Reverse(k))).map(|(k, _)| k)
}

/// The median (the mean of the middle two for an even count).
fn median(mut v: Vec<u64>) -> u64 {
    v.sort_unstable();
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        v[n / 2 - 1] / 2 + v[n / 2] / 2 + (v[n / 2 - 1] % 2 + v[n / 2] % 2) / 2
    }
}

/// Spread of `value` over the rows that have it (at least 2 ranks).
fn imbalance_of(what: &str, values: &[(u32, u64)]) -> Option<Imbalance> {
    if values.len() < 2 {
        return None;
    }
    let &(max_rank, max_bytes) = values.iter().max_by_key(|(r, b)| (*b, std::cmp::Reverse(*r)))?;
    let &(min_rank, min_bytes) = values.iter().min_by_key(|(r, b)| (*b, *r))?;
    Some(Imbalance {
        what: what.into(),
        max_bytes,
        max_rank,
        min_bytes,
        min_rank,
        median_bytes: median(values.iter().map(|v| v.1).collect()),
        max_over_min: (min_bytes > 0).then(|| max_bytes as f64 / min_bytes as f64),
        max_minus_min_bytes: max_bytes - min_bytes,
    })
}

/// A per-rank metric of the imbalance table.
type Metric = dyn Fn(&RankRow) -> Option<u64>;
/// (first start, phase name, unit, (rank, bytes) per rank).
type PhaseValues<'a> = (u64, String, &'a str, Vec<(u32, u64)>);

/// A rank's process inside one profile, with what the analysis needs of it.
struct RankProc<'a> {
    profile: &'a Profile,
    origin: Origin,
    pid: u32,
    row: RankRow,
    spans: Vec<Span<'a>>,
}

/// The likely cause of a foreign context, from when it appeared against the rank's own GPU and the marker
/// the rank had reached by then.
fn foreign_cause(first_foreign_ns: u64, first_own_ns: Option<u64>, markers: &[&Marker]) -> ForeignCause {
    let before = markers.iter().rev().find(|m| m.t_ns <= first_foreign_ns);
    let after = before.map(|m| MarkerAt { kind: m.kind, name: m.name.clone(), edge: m.edge });
    match first_own_ns {
        Some(own) if first_foreign_ns > own + 500_000_000 => {
            ForeignCause::Later { after_s: (first_foreign_ns - own) as f64 / 1e9, after }
        }
        _ => ForeignCause::Early { after },
    }
}

impl RankReport {
    /// Merges the ranks of several profiles (one per node or per task; one profile alone works too).
    pub fn build(profiles: &[Profile]) -> RankReport {
        let mut warnings = Vec::new();
        let mut procs: Vec<RankProc> = Vec::new();
        let mut matrix: Vec<MatrixCell> = Vec::new();
        let mut gpu_of: Vec<(usize, GpuProcesses)> = Vec::new();
        for (pi, p) in profiles.iter().enumerate() {
            let ids = identities(p);
            let launch_of = launches(p);
            let recorder_launch = p.meta.launch.map(|j| j.launch).unwrap_or_default();
            let launch = |pid: u32| {
                let l = launch_of.get(&pid).copied().unwrap_or_default();
                Launch {
                    group_rank: l.group_rank.or(recorder_launch.group_rank),
                    restart_count: l.restart_count.or(recorder_launch.restart_count),
                }
            };
            let gp = GpuProcesses::of(p).unwrap_or_default();
            let host = p.meta.hostname.clone();
            // (rank, attempt) -> pids that said they are it: a restarted rank is a new row.
            let mut by_rank: BTreeMap<(u32, Option<u32>), Vec<u32>> = BTreeMap::new();
            for (pid, o) in &ids {
                if let Some(r) = o.rank {
                    by_rank.entry((r, launch(*pid).restart_count)).or_default().push(*pid);
                }
            }
            let activity = |pid: u32| {
                p.markers.iter().filter(|m| m.origin.pid == Some(pid)).count()
                    + p.torch.iter().filter(|s| s.origin.pid == Some(pid)).count()
            };
            for ((rank, _), pids) in by_rank {
                // The rank's process: its most active one (workers inherit RANK but mark nothing); ties: first.
                let main = *pids.iter().max_by_key(|&&pid| (activity(pid), std::cmp::Reverse(pid))).expect("non-empty");
                let origin = ids[&main];
                let others: Vec<u32> = pids.iter().copied().filter(|&q| q != main).collect();
                let mut row = Self::rank_row(p, &gp, rank, main, origin, others, &host);
                let l = launch(main);
                (row.group_rank, row.restart_count) = (l.group_rank, l.restart_count);
                procs.push(RankProc { profile: p, origin, pid: main, row, spans: Vec::new() });
            }
            gpu_of.push((pi, gp));
        }
        for rp in &mut procs {
            let pid = rp.pid;
            rp.spans = spans(&rp.profile.markers).into_iter().filter(|s| s.origin.pid == Some(pid)).collect();
            let open: Vec<String> = rp
                .spans
                .iter()
                .filter(|s| s.end_t_ns.is_none() && s.kind != MarkerKind::Epoch)
                .map(|s| match (s.kind, s.index) {
                    (MarkerKind::Step, Some(i)) => format!("step {i}"),
                    (MarkerKind::Step, None) => "step".to_string(),
                    (k, _) => format!("{} {}", k.as_str(), s.name),
                })
                .collect();
            let folded_open: Vec<String> = rp
                .profile
                .aggregates
                .iter()
                .filter(|a| a.origin.pid == Some(pid) && a.open_count > 0 && a.kind != MarkerKind::Epoch)
                .map(|a| format!("{} {}", a.kind.as_str(), a.name))
                .collect();
            rp.row.stopped_inside = open.into_iter().chain(folded_open).collect();
        }
        procs.sort_by(|a, b| {
            (a.row.rank, a.row.restart_count, a.row.last_seen_unix_s.map(|s| s as u64)).cmp(&(
                b.row.rank,
                b.row.restart_count,
                b.row.last_seen_unix_s.map(|s| s as u64),
            ))
        });
        // The same rank of the same attempt from two profiles of different hosts (or runs).
        for w in procs.windows(2) {
            let same = w[0].row.rank == w[1].row.rank && w[0].row.restart_count == w[1].row.restart_count;
            if same && w[0].row.profile != w[1].row.profile {
                warnings.push(RankWarning::SameRankTwice {
                    rank: w[0].row.rank,
                    first: (w[0].row.profile.clone(), w[0].pid, w[0].row.host.clone()),
                    second: (w[1].row.profile.clone(), w[1].pid, w[1].row.host.clone()),
                });
            }
        }
        // The matrix and foreign contexts.
        let mut foreign = Vec::new();
        for (pi, gp) in &gpu_of {
            let p = &profiles[*pi];
            let ids = identities(p);
            let uuid_of =
                |d: u32| gp.devices.iter().find(|g| g.index == d).map(|g| g.uuid.clone()).filter(|u| !u.is_empty());
            for cell in &gp.processes {
                let rp = procs.iter().find(|rp| std::ptr::eq(rp.profile, p) && rp.pid == cell.pid);
                // A worker of a rank (same RANK, another pid) is shown under that rank.
                let rank = rp.map(|r| r.row.rank).or_else(|| ids.get(&cell.pid).and_then(|o| o.rank));
                let own_device = rp.and_then(|r| r.row.device).or_else(|| {
                    procs
                        .iter()
                        .find(|r| std::ptr::eq(r.profile, p) && Some(r.row.rank) == rank)
                        .and_then(|r| r.row.device)
                });
                let own = own_device == Some(cell.device);
                let allocated_here = p
                    .torch
                    .iter()
                    .any(|s| s.origin.pid == Some(cell.pid) && s.device == cell.device && s.reserved_bytes > 0);
                matrix.push(MatrixCell {
                    rank,
                    pid: cell.pid,
                    host: p.meta.hostname.clone(),
                    device: cell.device,
                    gpu_uuid: uuid_of(cell.device),
                    peak_bytes: cell.peak_bytes,
                    first_t_ns: cell.first_t_ns,
                    own,
                    context_only: !allocated_here,
                });
                if let (Some(rank), Some(_)) = (rank, own_device) {
                    if !own && cell.peak_bytes > 0 {
                        let first_own = gp
                            .processes
                            .iter()
                            .filter(|c| {
                                Some(c.device) == own_device && ids.get(&c.pid).and_then(|o| o.rank) == Some(rank)
                            })
                            .map(|c| c.first_t_ns)
                            .min();
                        let markers: Vec<&Marker> =
                            p.markers.iter().filter(|m| m.origin.pid == Some(cell.pid)).collect();
                        foreign.push(ForeignContext {
                            rank,
                            pid: cell.pid,
                            host: p.meta.hostname.clone(),
                            device: cell.device,
                            own_device,
                            bytes: cell.peak_bytes,
                            cause: foreign_cause(cell.first_t_ns, first_own, &markers),
                        });
                    }
                }
            }
        }
        matrix.sort_by(|a, b| {
            (&a.host, a.rank.is_none(), a.rank, a.pid, a.device).cmp(&(
                &b.host,
                b.rank.is_none(),
                b.rank,
                b.pid,
                b.device,
            ))
        });
        for f in &foreign {
            if let Some(rp) = procs.iter_mut().find(|r| r.row.rank == f.rank && r.row.host == f.host) {
                rp.row.foreign_nvml_bytes += f.bytes;
            }
        }
        // Step-aligned peaks.
        let steps: Vec<Vec<StepPeak>> = procs
            .iter()
            .map(|rp| {
                let torch: Vec<&TorchSample> =
                    rp.profile.torch.iter().filter(|s| s.origin.pid == Some(rp.pid)).collect();
                rp.spans
                    .iter()
                    .filter(|s| s.kind == MarkerKind::Step)
                    .enumerate()
                    .map(|(i, s)| step_peak(i, s, &torch))
                    .collect()
            })
            .collect();
        // The attempts, in order; imbalance compares the ranks of the last one (a rank against itself
        // in an earlier attempt is no imbalance).
        let mut by_attempt: BTreeMap<Option<u32>, (BTreeSet<u32>, Vec<String>)> = BTreeMap::new();
        for rp in &procs {
            let e = by_attempt.entry(rp.row.restart_count).or_default();
            e.0.insert(rp.row.rank);
            if !e.1.contains(&rp.row.profile) {
                e.1.push(rp.row.profile.clone());
            }
        }
        let attempts: Vec<Attempt> = by_attempt
            .into_iter()
            .map(|(restart_count, (ranks, mut profiles))| {
                profiles.sort();
                Attempt { restart_count, ranks: ranks.into_iter().collect(), profiles }
            })
            .collect();
        let last_attempt = attempts.last().and_then(|a| a.restart_count);
        let latest: Vec<&RankProc> = procs.iter().filter(|r| r.row.restart_count == last_attempt).collect();
        let imbalance = Self::imbalances(&latest);
        let first_failure = Self::first_failure(&procs);
        let world_size = most_common(procs.iter().filter_map(|r| r.origin.world_size));
        let sizes: BTreeSet<u32> = procs.iter().filter_map(|r| r.origin.world_size).collect();
        if sizes.len() > 1 {
            warnings.push(RankWarning::WorldSizesDisagree { sizes: sizes.iter().copied().collect() });
        }
        let missing_ranks = match world_size {
            Some(n) => {
                let have: BTreeSet<u32> = procs.iter().map(|r| r.row.rank).collect();
                (0..n).filter(|r| !have.contains(r)).collect()
            }
            None => Vec::new(),
        };
        if !missing_ranks.is_empty() {
            warnings
                .push(RankWarning::MissingRanks { world_size: world_size.unwrap_or(0), ranks: missing_ranks.clone() });
        }
        let mut hosts: Vec<String> = profiles.iter().map(|p| p.meta.hostname.clone()).collect();
        hosts.sort();
        hosts.dedup();
        RankReport {
            world_size,
            hosts,
            profiles: profiles.iter().map(|p| p.path.display().to_string()).collect(),
            ranks: procs.iter().map(|r| r.row.clone()).collect(),
            attempts,
            missing_ranks,
            imbalance,
            matrix,
            foreign_contexts: foreign,
            steps,
            first_failure,
            warnings,
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn rank_row(
        p: &Profile,
        gp: &GpuProcesses,
        rank: u32,
        pid: u32,
        origin: Origin,
        other_pids: Vec<u32>,
        host: &str,
    ) -> RankRow {
        let torch: Vec<&TorchSample> = p.torch.iter().filter(|s| s.origin.pid == Some(pid)).collect();
        let markers: Vec<&Marker> = p.markers.iter().filter(|m| m.origin.pid == Some(pid)).collect();
        let aggs: Vec<&SpanAggregate> = p.aggregates.iter().filter(|a| a.origin.pid == Some(pid)).collect();
        let nvml_here: Vec<&GpuProcessPeak> = gp.processes.iter().filter(|c| c.pid == pid).collect();
        let n_gpus = gp.devices.len().max(p.meta.gpu_total_bytes.len()) as u32;
        let (device, source) = if let Some(d) = most_common(torch.iter().map(|s| s.device)) {
            (Some(d), Some(DeviceSource::Allocator))
        } else if let Some(d) = most_common(markers.iter().filter_map(|m| m.device)) {
            (Some(d), Some(DeviceSource::Markers))
        } else if let Some(lr) = origin.local_rank.filter(|&lr| lr < n_gpus && nvml_here.iter().any(|c| c.device == lr))
        {
            (Some(lr), Some(DeviceSource::LocalRank))
        } else if let Some(c) = nvml_here.iter().max_by_key(|c| c.peak_bytes) {
            (Some(c.device), Some(DeviceSource::Nvml))
        } else {
            (None, None)
        };
        let on_device = |d: Option<u32>| d.is_none() || d == device;
        let peak_allocated = torch
            .iter()
            .filter(|s| Some(s.device) == device)
            .map(|s| s.peak_allocated_bytes.max(s.allocated_bytes))
            .max()
            .map(|t| {
                let m =
                    markers.iter().filter(|m| on_device(m.device)).filter_map(|m| m.memory.peak_allocated_bytes).max();
                let a = aggs.iter().filter(|a| on_device(a.device)).filter_map(|a| a.totals.peak_allocated_bytes).max();
                opt_max(Some(t), opt_max(m, a)).unwrap_or(t)
            });
        let peak_reserved = torch
            .iter()
            .filter(|s| Some(s.device) == device)
            .map(|s| s.peak_reserved_bytes.max(s.reserved_bytes))
            .max()
            .map(|t| {
                let m =
                    markers.iter().filter(|m| on_device(m.device)).filter_map(|m| m.memory.peak_reserved_bytes).max();
                let a = aggs.iter().filter(|a| on_device(a.device)).filter_map(|a| a.totals.peak_reserved_bytes).max();
                opt_max(Some(t), opt_max(m, a)).unwrap_or(t)
            });
        let single_gpu = n_gpus == 1;
        let peak_nvml =
            nvml_here.iter().filter(|c| Some(c.device) == device).map(|c| c.peak_bytes).max().or_else(|| {
                // Profiles without the per-GPU blob: the per-process samples (summed over GPUs) on a one-GPU host.
                if single_gpu {
                    p.process_samples
                        .iter()
                        .filter(|s| s.pid == pid)
                        .filter_map(|s| s.gpu_bytes)
                        .max()
                        .filter(|&b| b > 0)
                } else {
                    None
                }
            });
        let hwm = p.blobs.iter().rev().find_map(|b| match b {
            Blob::Vmhwm(v) => Some(v.pids.get(&pid).copied()),
            _ => None,
        });
        let hwm = hwm.flatten();
        let rss = opt_max(
            hwm,
            opt_max(
                p.process_samples.iter().filter(|s| s.pid == pid).map(|s| s.rss_bytes).max(),
                markers.iter().filter_map(|m| opt_max(m.memory.rss_bytes, m.memory.peak_rss_bytes)).max(),
            ),
        );
        let steps = markers.iter().filter(|m| m.kind == MarkerKind::Step && m.edge == Edge::Start).count() as u64
            + aggs.iter().filter(|a| a.kind == MarkerKind::Step).map(|a| a.totals.count).sum::<u64>();
        let last_ns = p
            .processes
            .iter()
            .find(|i| i.pid == pid)
            .map(|i| i.last_t_ns)
            .into_iter()
            .chain(markers.last().map(|m| m.t_ns))
            .chain(torch.last().map(|s| s.t_ns))
            .max();
        let oom = p.blobs.iter().find_map(|b| match b {
            Blob::Oom(o) if o.pid == pid => Some(o.clone()),
            _ => None,
        });
        let gpu = |d: u32| gp.devices.iter().find(|g| g.index == d);
        RankRow {
            rank,
            local_rank: origin.local_rank,
            world_size: origin.world_size,
            group_rank: None,
            restart_count: None,
            host: host.to_string(),
            pid,
            profile: p.path.display().to_string(),
            other_pids,
            device,
            device_source: source,
            gpu_uuid: device.and_then(gpu).map(|g| g.uuid.clone()).filter(|u| !u.is_empty()),
            gpu_name: device
                .and_then(|d| gpu(d).map(|g| g.name.clone()).or_else(|| p.meta.gpu_names.get(d as usize).cloned())),
            peak_allocated_bytes: peak_allocated,
            peak_reserved_bytes: peak_reserved,
            peak_nvml_bytes: peak_nvml,
            non_torch_bytes: match (peak_nvml, peak_reserved) {
                (Some(n), Some(r)) => Some(n.saturating_sub(r)),
                (Some(n), None) => Some(n),
                _ => None,
            },
            foreign_nvml_bytes: 0,
            peak_rss_bytes: rss,
            steps,
            stopped_inside: Vec::new(),
            last_seen_unix_s: last_ns.map(|t| p.meta.started_unix_s + t as f64 / 1e9),
            oom,
        }
    }

    fn imbalances(procs: &[&RankProc]) -> Vec<Imbalance> {
        let mut out = Vec::new();
        let metric = |f: &dyn Fn(&RankRow) -> Option<u64>| -> Vec<(u32, u64)> {
            procs.iter().filter_map(|r| Some((r.row.rank, f(&r.row)?))).collect()
        };
        let metrics: [(&str, &Metric); 5] = [
            ("peak allocated", &|r| r.peak_allocated_bytes),
            ("peak reserved", &|r| r.peak_reserved_bytes),
            ("peak NVML", &|r| r.peak_nvml_bytes),
            ("non-torch GPU", &|r| r.non_torch_bytes),
            ("peak CPU RSS", &|r| r.peak_rss_bytes),
        ];
        for (what, f) in metrics {
            out.extend(imbalance_of(what, &metric(f)));
        }
        // Per phase: each rank's highest value inside that phase, PyTorch allocated and CPU RSS.
        type PerPhase = BTreeMap<(String, &'static str), Vec<(u32, u64)>>;
        let mut per_phase: PerPhase = BTreeMap::new();
        let mut first_seen: HashMap<String, u64> = HashMap::new();
        for &rp in procs {
            let mut mine: BTreeMap<(&str, &'static str), u64> = BTreeMap::new();
            let mut put = |name, unit, v: Option<u64>| {
                if let Some(v) = v {
                    let e = mine.entry((name, unit)).or_insert(0);
                    *e = (*e).max(v);
                }
            };
            for s in rp.spans.iter().filter(|s| s.kind == MarkerKind::Phase) {
                first_seen
                    .entry(s.name.to_string())
                    .and_modify(|t| *t = (*t).min(s.start_t_ns))
                    .or_insert(s.start_t_ns);
                let exit = s.exit.cloned().unwrap_or_default();
                let alloc = opt_max(exit.peak_allocated_bytes, opt_max(exit.allocated_bytes, s.entry.allocated_bytes));
                put(s.name, "peak allocated", alloc);
                put(s.name, "peak CPU RSS", opt_max(exit.peak_rss_bytes, opt_max(exit.rss_bytes, s.entry.rss_bytes)));
            }
            for a in
                rp.profile.aggregates.iter().filter(|a| a.origin.pid == Some(rp.pid) && a.kind == MarkerKind::Phase)
            {
                first_seen.entry(a.name.clone()).or_insert(a.first_start_t_ns);
                put(a.name.as_str(), "peak allocated", a.totals.peak_allocated_bytes);
                put(a.name.as_str(), "peak CPU RSS", a.totals.peak_rss_bytes);
            }
            for ((name, unit), v) in mine {
                per_phase.entry((name.to_string(), unit)).or_default().push((rp.row.rank, v));
            }
        }
        let mut phases: Vec<PhaseValues> = per_phase
            .into_iter()
            .map(|((n, unit), v)| (first_seen.get(&n).copied().unwrap_or(0), n, unit, v))
            .collect();
        phases.sort_by(|a, b| (a.0, &a.1, a.2).cmp(&(b.0, &b.1, b.2)));
        for (_, name, unit, values) in phases {
            out.extend(imbalance_of(&format!("phase {name}: {unit}"), &values));
        }
        out
    }

    fn first_failure(procs: &[RankProc]) -> Option<FirstFailure> {
        let at = |r: &RankRow| r.oom.as_ref().and_then(|o| o.unix_s).or(r.last_seen_unix_s).unwrap_or(f64::INFINITY);
        let oom = procs.iter().filter(|r| r.row.oom.is_some()).min_by(|a, b| at(&a.row).total_cmp(&at(&b.row)));
        if let Some(r) = oom {
            return Some(FirstFailure {
                rank: r.row.rank,
                pid: r.pid,
                host: r.row.host.clone(),
                restart_count: r.row.restart_count,
                what: Failure::Oom,
                oom: r.row.oom.clone(),
            });
        }
        let stopped = procs
            .iter()
            .filter(|r| !r.row.stopped_inside.is_empty())
            .min_by(|a, b| at(&a.row).total_cmp(&at(&b.row)))?;
        let others_later = procs
            .iter()
            .filter(|r| r.pid != stopped.pid && r.row.restart_count == stopped.row.restart_count)
            .filter_map(|r| r.row.last_seen_unix_s)
            .fold(None::<f64>, |m, t| Some(m.map_or(t, |m| m.max(t))));
        let others_longer_s = match (others_later, stopped.row.last_seen_unix_s) {
            (Some(o), Some(s)) if o > s => Some(o - s),
            _ => None,
        };
        Some(FirstFailure {
            rank: stopped.row.rank,
            pid: stopped.pid,
            host: stopped.row.host.clone(),
            restart_count: stopped.row.restart_count,
            what: Failure::StoppedInside { spans: stopped.row.stopped_inside.clone(), others_longer_s },
            oom: None,
        })
    }
}

fn step_peak(ordinal: usize, s: &Span, torch: &[&TorchSample]) -> StepPeak {
    let exit = s.exit.cloned().unwrap_or_default();
    let end = s.end_t_ns.unwrap_or(u64::MAX);
    let inside: Vec<&&TorchSample> = torch
        .iter()
        .filter(|t| t.t_ns >= s.start_t_ns && t.t_ns <= end && s.device.is_none_or(|d| d == t.device))
        .collect();
    let alloc = opt_max(
        exit.peak_allocated_bytes,
        opt_max(opt_max(exit.allocated_bytes, s.entry.allocated_bytes), inside.iter().map(|t| t.allocated_bytes).max()),
    );
    let reserved = opt_max(
        exit.peak_reserved_bytes,
        opt_max(opt_max(exit.reserved_bytes, s.entry.reserved_bytes), inside.iter().map(|t| t.reserved_bytes).max()),
    );
    StepPeak {
        step: s.index.unwrap_or(ordinal as i64),
        duration_ns: s.duration_ns(),
        peak_allocated_bytes: alloc,
        peak_reserved_bytes: reserved,
        peak_rss_bytes: opt_max(exit.peak_rss_bytes, opt_max(exit.rss_bytes, s.entry.rss_bytes)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The warnings as the report says them.
    fn warnings(r: &RankReport) -> Vec<String> {
        r.warnings.iter().map(crate::report::ranks::warning_text).collect()
    }

    const MIB: u64 = 1 << 20;

    fn origin(pid: u32, rank: u32) -> Origin {
        Origin { pid: Some(pid), rank: Some(rank), local_rank: Some(rank), world_size: Some(2) }
    }

    fn torch(pid: u32, rank: u32, device: u32, t: u64, alloc: u64, reserved: u64) -> TorchSample {
        TorchSample {
            t_ns: t,
            device,
            allocated_bytes: alloc,
            reserved_bytes: reserved,
            peak_allocated_bytes: alloc,
            peak_reserved_bytes: reserved,
            active_bytes: alloc,
            inactive_split_bytes: 0,
            origin: origin(pid, rank),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn marker(
        pid: u32,
        rank: u32,
        t: u64,
        kind: MarkerKind,
        edge: Edge,
        name: &str,
        idx: Option<i64>,
        rss: u64,
    ) -> Marker {
        Marker {
            index: idx,
            memory: MarkerMemory { rss_bytes: Some(rss), ..Default::default() },
            origin: origin(pid, rank),
            ..Marker::new(t, kind, edge, name)
        }
    }

    /// A node with 2 GPUs: rank 0 (pid 10) on GPU 0, rank 1 (pid 11) on GPU 1 with a stray context on
    /// GPU 0 made at its start (before its own), and the launcher (pid 9) with no GPU memory.
    fn node() -> Profile {
        let gp = GpuProcesses {
            devices: vec![
                GpuIdentity { index: 0, uuid: "GPU-aaa".into(), name: "H200".into() },
                GpuIdentity { index: 1, uuid: "GPU-bbb".into(), name: "H200".into() },
            ],
            processes: vec![
                GpuProcessPeak { pid: 10, device: 0, peak_bytes: 3000 * MIB, first_t_ns: 100, last_t_ns: 900 },
                GpuProcessPeak { pid: 11, device: 0, peak_bytes: 612 * MIB, first_t_ns: 100, last_t_ns: 900 },
                GpuProcessPeak { pid: 11, device: 1, peak_bytes: 2500 * MIB, first_t_ns: 150, last_t_ns: 900 },
            ],
        };
        let mut markers = Vec::new();
        for (pid, rank, rss) in [(10u32, 0u32, 100 * MIB), (11, 1, 300 * MIB)] {
            for step in 0..3i64 {
                let t = 200 + step as u64 * 100 + rank as u64;
                markers.push(marker(pid, rank, t, MarkerKind::Step, Edge::Start, "step", Some(step), rss));
                markers.push(marker(pid, rank, t + 10, MarkerKind::Phase, Edge::Start, "forward", None, rss));
                markers.push(marker(
                    pid,
                    rank,
                    t + 20,
                    MarkerKind::Phase,
                    Edge::End,
                    "forward",
                    None,
                    rss + step as u64 * MIB,
                ));
                markers.push(marker(pid, rank, t + 50, MarkerKind::Step, Edge::End, "step", Some(step), rss));
            }
        }
        markers.sort_by_key(|m| m.t_ns);
        Profile {
            path: "node-a.sqlite".into(),
            meta: RunMeta { hostname: "node-a".into(), started_unix_s: 1000.0, ..Default::default() },
            torch: vec![torch(10, 0, 0, 300, 1000 * MIB, 2000 * MIB), torch(11, 1, 1, 300, 800 * MIB, 1500 * MIB)],
            markers,
            blobs: vec![
                Blob::Identity(Identity {
                    origin: Origin { pid: Some(9), ..Default::default() },
                    ..Default::default()
                }),
                Blob::GpuProcesses(gp),
            ],
            ..Default::default()
        }
    }

    #[test]
    fn ranks_get_their_gpu_peaks_non_torch_and_the_stray_context_is_flagged() {
        let r = RankReport::build(&[node()]);
        assert_eq!(
            r.ranks.iter().map(|x| (x.rank, x.pid, x.device)).collect::<Vec<_>>(),
            [(0, 10, Some(0)), (1, 11, Some(1))]
        );
        let r1 = &r.ranks[1];
        assert_eq!(r1.gpu_uuid.as_deref(), Some("GPU-bbb"));
        assert_eq!(
            (r1.peak_allocated_bytes, r1.peak_reserved_bytes, r1.peak_nvml_bytes),
            (Some(800 * MIB), Some(1500 * MIB), Some(2500 * MIB))
        );
        assert_eq!(r1.non_torch_bytes, Some(1000 * MIB));
        assert_eq!(r1.foreign_nvml_bytes, 612 * MIB);
        assert_eq!(r.foreign_contexts.len(), 1);
        let f = &r.foreign_contexts[0];
        assert_eq!((f.rank, f.device, f.own_device, f.bytes), (1, 0, Some(1), 612 * MIB));
        let cause = crate::report::ranks::foreign_cause_text(&f.cause);
        assert!(cause.contains("before `torch.cuda.set_device"), "{cause}");
        let cell = r.matrix.iter().find(|c| c.pid == 11 && c.device == 0).unwrap();
        assert!(!cell.own && cell.context_only);
        assert!(r.matrix.iter().find(|c| c.pid == 10).unwrap().own);
        assert_eq!(r.world_size, Some(2));
        assert!(r.missing_ranks.is_empty());
        assert_eq!(r.ranks[0].steps, 3);
        assert_eq!(r.steps[1].iter().map(|s| s.step).collect::<Vec<_>>(), [0, 1, 2]);
        let nvml = r.imbalance.iter().find(|i| i.what == "peak NVML").unwrap();
        assert_eq!((nvml.max_rank, nvml.min_rank), (0, 1));
        let fwd = r.imbalance.iter().find(|i| i.what == "phase forward: peak CPU RSS").unwrap();
        assert_eq!((fwd.max_rank, fwd.max_bytes, fwd.min_bytes), (1, 302 * MIB, 102 * MIB));
        assert!(r.first_failure.is_none());
    }

    #[test]
    fn a_late_foreign_context_points_at_torch_load() {
        let mut p = node();
        let mut gp = GpuProcesses::of(&p).unwrap();
        gp.processes[1].first_t_ns = 2_000_000_000;
        p.blobs[1] = Blob::GpuProcesses(gp);
        let r = RankReport::build(&[p]);
        let cause = crate::report::ranks::foreign_cause_text(&r.foreign_contexts[0].cause);
        assert!(cause.contains("map_location"), "{cause}");
    }

    #[test]
    fn a_rank_that_died_inside_a_step_is_the_first_failure_and_a_missing_rank_is_said() {
        let mut p = node();
        p.markers.push(marker(11, 1, 1000, MarkerKind::Step, Edge::Start, "step", Some(3), MIB));
        p.markers.push(marker(11, 1, 1010, MarkerKind::Phase, Edge::Start, "backward", None, MIB));
        p.markers.push(marker(10, 0, 5000, MarkerKind::Mark, Edge::Point, "done", None, MIB));
        for m in &mut p.markers {
            m.origin.world_size = Some(3);
        }
        let r = RankReport::build(&[p]);
        let f = r.first_failure.clone().expect("rank 1 stopped");
        assert_eq!(f.rank, 1);
        let what = crate::report::ranks::failure_text(&f.what);
        assert!(what.contains("step 3") && what.contains("phase backward"), "{what}");
        assert_eq!(r.missing_ranks, [2]);
        assert!(warnings(&r)[0].contains("rank(s) 2"), "{:?}", r.warnings);
    }

    #[test]
    fn an_oom_post_mortem_makes_its_rank_the_first_failure() {
        let mut p = node();
        let oom = serde_json::json!({"pid": 10, "device": 0, "requested_bytes": 1u64 << 30});
        p.blobs.push(Blob::from_parts(OOM_BLOB.into(), oom));
        let r = RankReport::build(&[p]);
        let f = r.first_failure.unwrap();
        assert_eq!((f.rank, crate::report::ranks::failure_text(&f.what).as_str()), (0, "CUDA out of memory"));
        assert_eq!(f.oom.unwrap().requested_bytes, Some(1u64 << 30));
    }

    #[test]
    fn the_same_rank_in_two_profiles_is_warned_about() {
        let a = node();
        let mut b = node();
        b.path = "node-b.sqlite".into();
        b.meta.hostname = "node-b".into();
        let r = RankReport::build(&[a, b]);
        assert_eq!(r.ranks.len(), 4);
        assert_eq!(r.hosts, ["node-a", "node-b"]);
        assert!(warnings(&r).iter().any(|w| w.contains("rank 0 is in node-a.sqlite")), "{:?}", r.warnings);
        let mut c = node();
        c.markers.iter_mut().for_each(|m| m.origin.world_size = Some(4));
        let r = RankReport::build(&[node(), c]);
        assert!(warnings(&r).iter().any(|w| w.contains("disagree on WORLD_SIZE (2, 4)")), "{:?}", r.warnings);
    }

    #[test]
    fn a_restarted_job_has_one_row_per_rank_and_attempt_and_no_duplicate_warning() {
        // Attempt 0: the hello says restart 0 (torchrun's workers). Attempt 1: no restart in the hello, the
        // recorder's own launch says 1 (`torchrun -m torchmem run`, an older extension).
        let mut first = node();
        first.path = "a0.sqlite".into();
        for pid in [10u32, 11] {
            let hello = serde_json::json!({"pid": pid, "rank": pid - 10, "group_rank": 0, "restart_count": 0});
            first.blobs.push(Blob::from_parts(IDENTITY_BLOB.into(), hello));
        }
        let mut second = node();
        second.path = "a1.sqlite".into();
        second.meta.launch =
            Some(JobPlace { launch: Launch { restart_count: Some(1), group_rank: Some(0) }, ..Default::default() });
        for m in second.markers.iter_mut().filter(|m| m.origin.rank == Some(1)) {
            m.memory.rss_bytes = Some(50 * MIB); // rank 1 is the smaller one in attempt 1
        }
        let r = RankReport::build(&[second, first]);
        assert_eq!(
            r.ranks.iter().map(|x| (x.rank, x.restart_count, x.group_rank, x.profile.as_str())).collect::<Vec<_>>(),
            [
                (0, Some(0), Some(0), "a0.sqlite"),
                (0, Some(1), Some(0), "a1.sqlite"),
                (1, Some(0), Some(0), "a0.sqlite"),
                (1, Some(1), Some(0), "a1.sqlite")
            ]
        );
        assert_eq!(
            r.attempts.iter().map(|a| (a.restart_count, a.ranks.clone(), a.profiles.clone())).collect::<Vec<_>>(),
            [(Some(0), vec![0, 1], vec!["a0.sqlite".to_string()]), (Some(1), vec![0, 1], vec!["a1.sqlite".into()])]
        );
        assert!(
            !warnings(&r).iter().any(|w| w.contains("rank 0 is in")),
            "attempts are not duplicates: {:?}",
            r.warnings
        );
        // Imbalance compares the last attempt's ranks: there rank 1 is the smaller.
        let fwd = r.imbalance.iter().find(|i| i.what == "phase forward: peak CPU RSS").unwrap();
        assert_eq!((fwd.max_rank, fwd.min_rank), (0, 1), "{fwd:?}");
        // The same attempt of a rank in two profiles is still a duplicate.
        let mut twin = node();
        twin.path = "b.sqlite".into();
        let r = RankReport::build(&[node(), twin]);
        assert!(warnings(&r).iter().any(|w| w.contains("rank 0 is in node-a.sqlite")), "{:?}", r.warnings);
        assert_eq!(r.attempts.len(), 1);
    }

    #[test]
    fn a_run_without_ranks_is_not_distributed() {
        let mut p = node();
        for m in &mut p.markers {
            m.origin.rank = None;
        }
        for s in &mut p.torch {
            s.origin.rank = None;
        }
        assert!(!is_distributed(&[p]));
        assert!(is_distributed(&[node()]));
    }
}
