//! The live view's own state (no terminal here): `TopModel` is what `torchmem top` shows: the runs found
//! (`LiveSnapshot`s from `torchmem_recorder::live_state`), the host's RAM, the GPUs NVML reports, and the
//! viewer's choices (sort column, direction, selected row), with the rows in display order.

use std::collections::BTreeMap;

use torchmem_core::sources::host::HostMemory;
use torchmem_recorder::live_state::{LiveSnapshot, ProcessNow};

/// The table's columns that can be sorted by (`1`..`7` pick one, `s` moves to the next).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SortKey {
    Pid,
    Rss,
    Pss,
    Gpu,
    Allocated,
    Reserved,
    PeakAllocated,
}

impl SortKey {
    pub const ALL: [SortKey; 7] = [
        SortKey::Pid,
        SortKey::Rss,
        SortKey::Pss,
        SortKey::Gpu,
        SortKey::Allocated,
        SortKey::Reserved,
        SortKey::PeakAllocated,
    ];

    pub fn label(self) -> &'static str {
        match self {
            SortKey::Pid => "PID",
            SortKey::Rss => "RSS",
            SortKey::Pss => "PSS",
            SortKey::Gpu => "GPU",
            SortKey::Allocated => "ALLOC",
            SortKey::Reserved => "RESERVED",
            SortKey::PeakAllocated => "PEAK ALLOC",
        }
    }

    /// The key bound to `c` (`'1'` is the first column).
    pub fn from_digit(c: char) -> Option<SortKey> {
        let i = c.to_digit(10)? as usize;
        (1..=Self::ALL.len()).contains(&i).then(|| Self::ALL[i - 1])
    }

    pub fn next(self) -> SortKey {
        let i = Self::ALL.iter().position(|k| *k == self).unwrap_or(0);
        Self::ALL[(i + 1) % Self::ALL.len()]
    }

    fn value(self, p: &ProcessNow) -> Option<u64> {
        match self {
            SortKey::Pid => Some(u64::from(p.pid)),
            SortKey::Rss => p.rss_bytes,
            SortKey::Pss => p.pss_bytes,
            SortKey::Gpu => p.gpu_bytes,
            SortKey::Allocated => p.allocated_bytes(),
            SortKey::Reserved => p.reserved_bytes(),
            SortKey::PeakAllocated => p.peak_allocated_bytes(),
        }
    }
}

/// One GPU as `top` reads it itself from NVML: device-wide and every process on it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GpuDeviceNow {
    pub index: u32,
    pub name: String,
    pub used_bytes: u64,
    pub total_bytes: u64,
    /// pid → bytes for every process NVML lists on it.
    pub process_bytes: BTreeMap<u32, u64>,
}

/// What `top` knows about the GPUs.
#[derive(Debug, Clone, PartialEq)]
pub enum GpuPanel {
    /// NVML could not be loaded: the reason.
    NoNvml(String),
    Devices(Vec<GpuDeviceNow>),
}

/// Where `top` takes its runs from.
#[derive(Debug, Clone, PartialEq)]
pub enum Source {
    /// Every run registered in these directories.
    All(Vec<String>),
    /// One live run, followed through its state file.
    Follow(String),
    /// A finished profile's last state.
    Replay(String),
}

/// One row of the process table.
#[derive(Debug, Clone, PartialEq)]
pub struct Row<'a> {
    pub run: &'a LiveSnapshot,
    pub process: &'a ProcessNow,
}

/// Everything `torchmem top` shows.
#[derive(Debug, Clone)]
pub struct TopModel {
    pub source: Source,
    pub hostname: String,
    pub runs: Vec<LiveSnapshot>,
    pub host: Option<HostMemory>,
    pub gpus: GpuPanel,
    pub sort: SortKey,
    /// Ascending instead of the default descending.
    pub ascending: bool,
    /// The selected row (display order).
    pub selected: usize,
    /// Now, for the clock in the header and a stalled run's age.
    pub now_unix_s: f64,
}

impl TopModel {
    pub fn new(source: Source) -> Self {
        TopModel {
            source,
            hostname: String::new(),
            runs: Vec::new(),
            host: None,
            gpus: GpuPanel::NoNvml(String::new()),
            sort: SortKey::Rss,
            ascending: false,
            selected: 0,
            now_unix_s: 0.0,
        }
    }

    /// The rows, sorted by the chosen column (a value never measured sorts last either way), ties by pid.
    pub fn rows(&self) -> Vec<Row<'_>> {
        let mut rows: Vec<Row<'_>> =
            self.runs.iter().flat_map(|run| run.processes.iter().map(move |process| Row { run, process })).collect();
        let key = self.sort;
        rows.sort_by(|a, b| {
            let (va, vb) = (key.value(a.process), key.value(b.process));
            let by = match (va, vb) {
                (Some(x), Some(y)) if self.ascending => x.cmp(&y),
                (Some(x), Some(y)) => y.cmp(&x),
                (Some(_), None) => std::cmp::Ordering::Less,
                (None, Some(_)) => std::cmp::Ordering::Greater,
                (None, None) => std::cmp::Ordering::Equal,
            };
            by.then(a.process.pid.cmp(&b.process.pid))
        });
        rows
    }

    /// The run the selected row belongs to (else the first run).
    pub fn selected_run(&self) -> Option<&LiveSnapshot> {
        let rows = self.rows();
        rows.get(self.selected.min(rows.len().saturating_sub(1))).map(|r| r.run).or(self.runs.first())
    }

    /// A key press; returns false for the keys that quit.
    pub fn key(&mut self, c: char) -> bool {
        match c {
            'q' => return false,
            's' => self.sort = self.sort.next(),
            'r' => self.ascending = !self.ascending,
            'j' => self.move_selection(1),
            'k' => self.move_selection(-1),
            c => {
                if let Some(k) = SortKey::from_digit(c) {
                    if k == self.sort {
                        self.ascending = !self.ascending;
                    } else {
                        self.sort = k;
                        self.ascending = false;
                    }
                }
            }
        }
        true
    }

    pub fn move_selection(&mut self, by: i64) {
        let n = self.rows().len() as i64;
        self.selected = (self.selected as i64 + by).clamp(0, (n - 1).max(0)) as usize;
    }

    /// Keeps the selection on an existing row after the runs changed.
    pub fn clamp_selection(&mut self) {
        self.move_selection(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use torchmem_recorder::live_state::fixtures::two_process_run;

    #[test]
    fn rows_sort_by_the_chosen_column_and_keys_change_it() {
        let mut m = TopModel::new(Source::All(vec![]));
        m.runs = vec![two_process_run()];
        let pids = |m: &TopModel| m.rows().iter().map(|r| r.process.pid).collect::<Vec<_>>();
        assert_eq!(pids(&m), vec![4242, 4243], "RSS, largest first");
        assert!(m.key('1'));
        assert_eq!((m.sort, pids(&m)), (SortKey::Pid, vec![4243, 4242]));
        m.key('1');
        assert!(m.ascending, "the same key again flips the direction");
        assert_eq!(pids(&m), vec![4242, 4243]);
        m.key('5');
        assert_eq!(m.sort, SortKey::Allocated);
        assert_eq!(pids(&m), vec![4242, 4243], "a process without an allocator sorts last");
        m.key('r');
        assert_eq!(pids(&m), vec![4242, 4243], "... either way");
        m.key('s');
        assert_eq!(m.sort, SortKey::Reserved);
        m.sort = SortKey::PeakAllocated;
        m.key('s');
        assert_eq!(m.sort, SortKey::Pid, "s cycles round");
        m.key('j');
        m.key('j');
        assert_eq!(m.selected, 1, "the selection stays on the rows");
        assert!(!m.key('q'));
        assert_eq!(SortKey::from_digit('8'), None);
    }
}
