//! The run's memory journey: an ordered list of stages (device checked, model initialised, forward, backward,
//! optimizer step, peak, cache emptied) with the memory at each, rendered as text or as a Mermaid `journey`
//! diagram whose 1–5 scores reflect memory pressure (5 = plenty of room, 1 = nearly full).

use serde::{Deserialize, Serialize};

use crate::units::{format_bytes, format_opt_bytes};

/// Groups stages in the diagram.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum JourneySection {
    /// A stage of no known section (written "" before this enum).
    #[default]
    #[serde(alias = "")]
    Run,
    Setup,
    Training,
    Cleanup,
}

impl JourneySection {
    pub fn as_str(self) -> &'static str {
        match self {
            JourneySection::Run => "Run",
            JourneySection::Setup => "Setup",
            JourneySection::Training => "Training",
            JourneySection::Cleanup => "Cleanup",
        }
    }
}

/// What a stage's pressure is measured on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum PressureOn {
    /// Whatever the stage has (reserved, else allocated, else RSS).
    #[default]
    #[serde(rename = "")]
    Any,
    /// Reserved against the GPU's total (a stage before CUDA started holds no GPU memory).
    #[serde(rename = "gpu")]
    Gpu,
    /// RSS against the host's RAM.
    #[serde(rename = "cpu")]
    Cpu,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct JourneyStage {
    pub name: String,
    /// Groups stages in the diagram.
    #[serde(default)]
    pub section: JourneySection,
    #[serde(default)]
    pub allocated_bytes: Option<u64>,
    #[serde(default)]
    pub reserved_bytes: Option<u64>,
    #[serde(default)]
    pub rss_bytes: Option<u64>,
    /// What the memory is measured against: the GPU's total (with CUDA) or the host's RAM (CPU only).
    #[serde(default)]
    pub capacity_bytes: Option<u64>,
    /// What pressure is measured on.
    #[serde(default)]
    pub measure: PressureOn,
}

impl JourneyStage {
    /// The memory that counts for pressure: reserved on a GPU run (what the allocator holds), RSS otherwise.
    pub fn used_bytes(&self) -> Option<u64> {
        match self.measure {
            PressureOn::Gpu => Some(self.reserved_bytes.or(self.allocated_bytes).unwrap_or(0)),
            PressureOn::Cpu => self.rss_bytes,
            PressureOn::Any => self.reserved_bytes.or(self.allocated_bytes).or(self.rss_bytes),
        }
    }

    fn measure_label(&self) -> &'static str {
        match self.measure {
            PressureOn::Gpu => "GPU ",
            PressureOn::Cpu => "RAM ",
            PressureOn::Any => "",
        }
    }

    /// Fraction of capacity in use, 0..=1 (None when either side is unknown).
    pub fn pressure(&self) -> Option<f64> {
        let cap = self.capacity_bytes.filter(|c| *c > 0)?;
        Some((self.used_bytes()? as f64 / cap as f64).clamp(0.0, 1.0))
    }

    /// Mermaid score: 5 below 20 % of capacity, then one less per 20 %, 1 from 80 % on.
    pub fn score(&self) -> u8 {
        match self.pressure() {
            None => 3,
            Some(p) => (5 - ((p * 5.0).floor() as i64).clamp(0, 4)) as u8,
        }
    }

    fn memory_text(&self) -> String {
        let mut parts = Vec::new();
        if self.allocated_bytes.is_some() || self.reserved_bytes.is_some() {
            parts.push(format!(
                "allocated {} reserved {}",
                format_opt_bytes(self.allocated_bytes),
                format_opt_bytes(self.reserved_bytes)
            ));
        }
        if let Some(rss) = self.rss_bytes {
            parts.push(format!("RSS {}", format_bytes(rss)));
        }
        if parts.is_empty() {
            "-".into()
        } else {
            parts.join(", ")
        }
    }
}

/// One line per stage: name, memory, share of capacity.
pub fn render_text(stages: &[JourneyStage]) -> String {
    let mut out = String::from("Memory journey\n");
    if stages.is_empty() {
        out.push_str("  (no stages recorded)\n");
        return out;
    }
    let width = stages.iter().map(|s| s.name.len()).max().unwrap_or(0);
    for (i, s) in stages.iter().enumerate() {
        let share = match (s.pressure(), s.capacity_bytes) {
            (Some(p), Some(cap)) => format!("  ({}{:.1}% of {})", s.measure_label(), p * 100.0, format_bytes(cap)),
            _ => String::new(),
        };
        out.push_str(&format!("  {:>2}. {:<width$}  {}{}\n", i + 1, s.name, s.memory_text(), share));
    }
    out
}

/// Mermaid task text may not contain `:`, `;` or `#`, which the journey grammar reserves.
fn mermaid_safe(text: &str) -> String {
    text.chars().map(|c| if matches!(c, ':' | ';' | '#' | '\n') { ' ' } else { c }).collect()
}

/// A Mermaid `journey` diagram; paste it into any Markdown renderer that supports Mermaid.
pub fn render_mermaid(stages: &[JourneyStage], title: &str) -> String {
    let mut out = format!("journey\n    title {}\n", mermaid_safe(title));
    let mut current_section: Option<&str> = None;
    for s in stages {
        let section = s.section.as_str();
        if current_section != Some(section) {
            out.push_str(&format!("    section {}\n", mermaid_safe(section)));
            current_section = Some(section);
        }
        let actor = match s.measure {
            PressureOn::Gpu => "GPU",
            PressureOn::Cpu => "CPU",
            PressureOn::Any if s.allocated_bytes.is_some() || s.reserved_bytes.is_some() => "GPU",
            PressureOn::Any => "CPU",
        };
        out.push_str(&format!(
            "      {} ({}): {}: {}\n",
            mermaid_safe(&s.name),
            mermaid_safe(&s.memory_text()),
            s.score(),
            actor
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn stage(name: &str, reserved: u64) -> JourneyStage {
        JourneyStage {
            name: name.into(),
            section: JourneySection::Training,
            allocated_bytes: Some(reserved / 2),
            reserved_bytes: Some(reserved),
            rss_bytes: None,
            capacity_bytes: Some(10 * GIB),
            measure: PressureOn::Any,
        }
    }

    #[test]
    fn scores_follow_pressure() {
        assert_eq!(stage("a", GIB).score(), 5);
        assert_eq!(stage("a", 3 * GIB).score(), 4);
        assert_eq!(stage("a", 5 * GIB).score(), 3);
        assert_eq!(stage("a", 7 * GIB).score(), 2);
        assert_eq!(stage("a", 9 * GIB).score(), 1);
        assert_eq!(stage("a", 10 * GIB).score(), 1);
        let unknown = JourneyStage { name: "x".into(), ..Default::default() };
        assert_eq!(unknown.score(), 3);
    }

    #[test]
    fn mermaid_is_well_formed() {
        let m = render_mermaid(&[stage("Forward: step 1", GIB), stage("Peak", 9 * GIB)], "My run");
        let lines: Vec<&str> = m.lines().collect();
        assert_eq!(lines[0], "journey");
        assert_eq!(lines[1], "    title My run");
        assert_eq!(lines[2], "    section Training");
        assert!(
            lines[3].starts_with("      Forward  step 1 (allocated 512.0 MiB reserved 1.00 GiB): 5: GPU"),
            "{}",
            lines[3]
        );
        assert!(lines[4].ends_with(": 1: GPU"));
        // exactly two colons per task line: name: score: actors
        assert!(lines[3..].iter().all(|l| l.matches(':').count() == 2));
    }

    #[test]
    fn a_gpu_journey_measures_every_stage_on_the_gpu() {
        let before_cuda = JourneyStage {
            name: "Device checked".into(),
            rss_bytes: Some(9 * GIB),
            capacity_bytes: Some(10 * GIB),
            measure: PressureOn::Gpu,
            ..Default::default()
        };
        // 9 GiB of RSS says nothing about the GPU, which holds nothing of ours before CUDA starts.
        assert_eq!(before_cuda.score(), 5);
        assert!(render_text(&[before_cuda]).contains("(GPU 0.0% of 10.00 GiB)"));
    }

    #[test]
    fn text_lists_every_stage() {
        let t = render_text(&[stage("Forward", GIB)]);
        assert!(t.contains("1. Forward") && t.contains("10.0% of 10.00 GiB"), "{t}");
    }
}
