//! The sentences of analysis findings: `analysis/` decides (typed records), this module says it in English for
//! every report (text, Markdown, HTML, JSON's `message`, the Monitor's warnings).

use crate::analysis::Growth;

/// The growth warning's sentence: which series, per what, by how much, and the usual cause.
pub fn growth_message(g: &Growth) -> String {
    let (what, unit) = (g.what.as_str(), g.unit.as_str());
    format!(
        "{what} grew every {unit} for {} {unit}s, by {} per {unit} on average: something keeps tensors alive across {unit}s (e.g. `total_loss += loss` instead of `loss.item()`, or a list of outputs)",
        g.units,
        crate::units::format_delta(g.per_unit_bytes)
    )
}

/// A growth finding as JSON: its fields and its sentence (`message`).
pub fn growth_json(g: &Growth) -> serde_json::Value {
    let mut v = serde_json::to_value(g).unwrap_or_default();
    v["message"] = growth_message(g).into();
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::{GrowthSeries, GrowthUnit};

    #[test]
    fn the_sentence_names_the_series_unit_and_rate() {
        let g = Growth { unit: GrowthUnit::Step, what: GrowthSeries::CpuRss, per_unit_bytes: 8 << 20, units: 5 };
        let m = growth_message(&g);
        assert!(m.starts_with("CPU RSS grew every step for 5 steps, by +8.0 MiB per step"), "{m}");
        let j = growth_json(&g);
        assert_eq!((j["unit"].as_str(), j["what"].as_str()), (Some("step"), Some("CPU RSS")));
        assert_eq!(j["message"].as_str(), Some(m.as_str()));
    }
}
