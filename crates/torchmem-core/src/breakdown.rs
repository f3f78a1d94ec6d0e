//! The record types of "what is the memory?": the per-device, per-category breakdown that the Monitor
//! attaches to its step and phase boundary markers (`Marker::breakdown`, the marker JSON's `"breakdown"` key,
//! written by `python/torchmem/_breakdown.py`), the opt-in activations per module, and the exact folded
//! aggregates (`BreakdownAggregate`) that stand in for the breakdowns of markers a long run did not keep.
//!
//! Every size is bytes, counted by storage (a storage shared by views or tied weights counts once). A value
//! that was not measured (no allocator on the CPU, no NVML) is `None`, never 0.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::model::{Edge, Marker, MarkerKind, Origin};

/// Per top-level module: the bytes of its parameters and of their gradients.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModuleBytes {
    #[serde(default)]
    pub parameters: BTreeMap<String, u64>,
    #[serde(default)]
    pub gradients: BTreeMap<String, u64>,
}

impl ModuleBytes {
    pub fn is_empty(&self) -> bool {
        self.parameters.is_empty() && self.gradients.is_empty()
    }
}

/// One device's memory by category at one boundary (one entry of the marker's `"breakdown"` list).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceBreakdown {
    /// `"cuda:0"` (torch's index) or `"cpu"`.
    pub device: String,
    #[serde(default)]
    pub parameters_bytes: Option<u64>,
    #[serde(default)]
    pub gradients_bytes: Option<u64>,
    #[serde(default)]
    pub optimizer_state_bytes: Option<u64>,
    /// Storages autograd saved for backward and alive now, minus parameters and inputs.
    #[serde(default)]
    pub activations_bytes: Option<u64>,
    /// The tensors passed to the model's forward (this step's batch).
    #[serde(default)]
    pub inputs_bytes: Option<u64>,
    /// allocated − the five above (CUDA only: the CPU has no allocator counter).
    #[serde(default)]
    pub other_bytes: Option<i64>,
    #[serde(default)]
    pub allocated_bytes: Option<u64>,
    #[serde(default)]
    pub reserved_bytes: Option<u64>,
    /// reserved − allocated: the caching allocator's cache.
    #[serde(default)]
    pub cache_bytes: Option<u64>,
    /// NVML's process (or device-used) memory − reserved: CUDA context, libraries, other allocators.
    #[serde(default)]
    pub non_torch_bytes: Option<i64>,
    /// The process's RSS (CPU entry only).
    #[serde(default)]
    pub rss_bytes: Option<u64>,
    #[serde(default)]
    pub by_module: ModuleBytes,
    /// Optimizer state bytes per param group, in group order.
    #[serde(default)]
    pub by_param_group: Vec<u64>,
}

impl DeviceBreakdown {
    /// True for a CUDA device's entry (its peaks are the allocator's).
    pub fn is_cuda(&self) -> bool {
        self.device.starts_with("cuda")
    }

    /// The bytes of one category, None where it was not measured (negative differences clamp to 0).
    pub fn get(&self, c: Category) -> Option<u64> {
        let signed = |v: Option<i64>| v.map(|x| x.max(0) as u64);
        match c {
            Category::Parameters => self.parameters_bytes,
            Category::Gradients => self.gradients_bytes,
            Category::OptimizerState => self.optimizer_state_bytes,
            Category::Activations => self.activations_bytes,
            Category::Inputs => self.inputs_bytes,
            Category::Other => signed(self.other_bytes),
            Category::Cache => self.cache_bytes,
            Category::NonTorch => signed(self.non_torch_bytes),
            Category::Allocated => self.allocated_bytes,
            Category::Reserved => self.reserved_bytes,
            Category::Rss => self.rss_bytes,
        }
    }

    /// parameters + gradients + optimizer state + activations + inputs (those measured): what torchmem
    /// can name.
    pub fn named_bytes(&self) -> u64 {
        [
            self.parameters_bytes,
            self.gradients_bytes,
            self.optimizer_state_bytes,
            self.activations_bytes,
            self.inputs_bytes,
        ]
        .iter()
        .flatten()
        .sum()
    }
}

/// One category of the breakdown. `Allocated`, `Reserved` and `Rss` are the totals the categories add up to,
/// kept alongside so a boundary's table can show them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Category {
    Parameters,
    Gradients,
    OptimizerState,
    Activations,
    Inputs,
    Other,
    Cache,
    NonTorch,
    Allocated,
    Reserved,
    Rss,
}

impl Category {
    pub const ALL: [Category; 11] = [
        Category::Parameters,
        Category::Gradients,
        Category::OptimizerState,
        Category::Activations,
        Category::Inputs,
        Category::Other,
        Category::Cache,
        Category::NonTorch,
        Category::Allocated,
        Category::Reserved,
        Category::Rss,
    ];
    /// The categories that stack up to the process's memory on a device (the chart's layers, in order).
    pub const STACKED: [Category; 8] = [
        Category::Parameters,
        Category::Gradients,
        Category::OptimizerState,
        Category::Activations,
        Category::Inputs,
        Category::Other,
        Category::Cache,
        Category::NonTorch,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Category::Parameters => "parameters",
            Category::Gradients => "gradients",
            Category::OptimizerState => "optimizer_state",
            Category::Activations => "activations",
            Category::Inputs => "inputs",
            Category::Other => "other",
            Category::Cache => "cache",
            Category::NonTorch => "non_torch",
            Category::Allocated => "allocated",
            Category::Reserved => "reserved",
            Category::Rss => "rss",
        }
    }

    /// How the reports name it.
    pub fn label(self) -> &'static str {
        match self {
            Category::Parameters => "parameters",
            Category::Gradients => "gradients",
            Category::OptimizerState => "optimizer state",
            Category::Activations => "activations",
            Category::Inputs => "inputs",
            Category::Other => "other",
            Category::Cache => "allocator cache",
            Category::NonTorch => "non-PyTorch",
            Category::Allocated => "allocated",
            Category::Reserved => "reserved",
            Category::Rss => "RSS",
        }
    }

    pub fn parse(s: &str) -> Option<Category> {
        Category::ALL.into_iter().find(|c| c.as_str() == s)
    }
}

/// The boundary a marker stands for when it carries a breakdown: `"step start"`, `"end of forward"`,
/// `"end of backward"`, `"end of optimizer step"` (any phase end: `"end of NAME"`); another marker kind
/// that carries one is named by its kind, edge and name.
pub fn boundary_of(m: &Marker) -> String {
    match (m.kind, m.edge) {
        (MarkerKind::Step, Edge::Start) => "step start".into(),
        (MarkerKind::Phase, Edge::End) => format!("end of {}", m.name),
        (kind, edge) => format!("{} {} {}", kind.as_str(), edge.as_str(), m.name),
    }
}

/// Where a boundary sits in a training step, for ordering tables: step start, forward, backward, optimizer,
/// then the rest by name.
pub fn boundary_rank(boundary: &str) -> (u8, String) {
    let r = match boundary {
        "step start" => 0,
        "end of forward" => 1,
        "end of backward" => 2,
        "end of optimizer step" | "end of optimizer" => 3,
        _ => 4,
    };
    (r, boundary.to_string())
}

/// Count, sum and highest value of one category over some boundaries (exact: rows add with `merge`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CategoryStat {
    /// Boundaries where the category was measured.
    pub count: u64,
    pub sum_bytes: u64,
    pub max_bytes: u64,
}

impl CategoryStat {
    pub fn add(&mut self, bytes: u64) {
        self.count += 1;
        self.sum_bytes = self.sum_bytes.saturating_add(bytes);
        self.max_bytes = self.max_bytes.max(bytes);
    }
    pub fn merge(&mut self, o: &CategoryStat) {
        self.count += o.count;
        self.sum_bytes = self.sum_bytes.saturating_add(o.sum_bytes);
        self.max_bytes = self.max_bytes.max(o.max_bytes);
    }
    /// The mean, None when never measured.
    pub fn mean_bytes(&self) -> Option<u64> {
        (self.count > 0).then(|| (self.sum_bytes as u128 / self.count as u128) as u64)
    }
}

/// The breakdowns of the boundaries that were folded instead of kept (every step after the first
/// `keep_spans`), per process (pid, rank), boundary and device: per category count, sum and max, so the
/// mean and max over all boundaries stay exact however long the run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BreakdownAggregate {
    pub origin: Origin,
    pub boundary: String,
    pub device: String,
    /// Boundaries folded into this row.
    pub count: u64,
    pub categories: BTreeMap<Category, CategoryStat>,
}

/// What identifies one breakdown aggregate row: (pid, rank, boundary, device).
pub type BreakdownKey = (Option<u32>, Option<u32>, String, String);

impl BreakdownAggregate {
    pub fn new(origin: Origin, boundary: String, device: String) -> Self {
        BreakdownAggregate { origin, boundary, device, count: 0, categories: BTreeMap::new() }
    }

    pub fn key(&self) -> BreakdownKey {
        (self.origin.pid, self.origin.rank, self.boundary.clone(), self.device.clone())
    }

    /// Adds one boundary's entry for this device.
    pub fn add(&mut self, b: &DeviceBreakdown) {
        self.count += 1;
        for c in Category::ALL {
            if let Some(v) = b.get(c) {
                self.categories.entry(c).or_default().add(v);
            }
        }
    }

    /// Adds another row of the same key.
    pub fn merge(&mut self, o: &BreakdownAggregate) {
        self.count += o.count;
        for (c, s) in &o.categories {
            self.categories.entry(*c).or_default().merge(s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_interface_record() {
        let json = r#"{"device":"cuda:0","parameters_bytes":10,"gradients_bytes":10,"optimizer_state_bytes":20,
            "activations_bytes":5,"inputs_bytes":1,"other_bytes":-3,"allocated_bytes":43,"reserved_bytes":64,
            "cache_bytes":21,"non_torch_bytes":300,"rss_bytes":null,
            "by_module":{"parameters":{"encoder":6,"head":4},"gradients":{"encoder":6}},"by_param_group":[12,8]}"#;
        let b: DeviceBreakdown = serde_json::from_str(json).unwrap();
        assert_eq!(b.by_module.parameters["encoder"], 6);
        assert_eq!(b.by_param_group, [12, 8]);
        assert_eq!(b.get(Category::Other), Some(0), "a negative difference clamps to 0");
        assert_eq!(b.get(Category::Rss), None);
        assert_eq!(b.named_bytes(), 46);
        let cpu: DeviceBreakdown =
            serde_json::from_str(r#"{"device":"cpu","parameters_bytes":4,"activations_bytes":null}"#).unwrap();
        assert_eq!((cpu.get(Category::Allocated), cpu.by_module.is_empty()), (None, true));
        assert_eq!(
            (cpu.get(Category::Activations), cpu.get(Category::Gradients)),
            (None, None),
            "absent or null: not measured"
        );
        assert_eq!(cpu.named_bytes(), 4);
        assert!(serde_json::from_str::<DeviceBreakdown>(r#"{"parameters_bytes":4}"#).is_err(), "device is required");
    }

    #[test]
    fn aggregates_add_and_merge_exactly() {
        let b = |p: u64| DeviceBreakdown { device: "cpu".into(), parameters_bytes: Some(p), ..Default::default() };
        let mut a = BreakdownAggregate::new(Origin::default(), "step start".into(), "cpu".into());
        let mut c = a.clone();
        a.add(&b(10));
        a.add(&b(30));
        c.add(&b(20));
        a.merge(&c);
        let s = a.categories[&Category::Parameters];
        assert_eq!((a.count, s.count, s.sum_bytes, s.max_bytes, s.mean_bytes()), (3, 3, 60, 30, Some(20)));
        assert!(!a.categories.contains_key(&Category::Allocated), "never measured on the CPU");
    }
}
