//! The sentences of analysis findings: `analysis/` decides (typed records), this module says it in English for
//! every report (text, Markdown, HTML, JSON's `message`, the Monitor's warnings).

use crate::analysis::leaks::{site_name, KeptIn, Leak, LeakKind, LeakReport};
use crate::analysis::Growth;
use crate::units::{format_bytes, format_delta};

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

/// "list `kept` (put there at train.py:18 `kept.append(out)`)": what keeps a line's tensors.
pub fn kept_in_phrase(k: &KeptIn) -> String {
    let mut out = match &k.name {
        Some(n) if k.container == "variable" => format!("the variable `{n}`"),
        Some(n) => format!("{} `{n}`", k.container),
        None => format!("a {}", k.container),
    };
    if let (Some(f), Some(l)) = (&k.file, k.line) {
        let code = if k.source.is_empty() { String::new() } else { format!(" `{}`", k.source) };
        out.push_str(&format!(" (put there at {}{code})", site_name(f, l)));
    }
    out
}

/// A leak finding's sentence: the line, what it keeps alive and how fast, what holds it, and the fix.
pub fn leak_message(f: &Leak) -> String {
    let name = site_name(&f.file, f.line);
    let code = if f.source.is_empty() { String::new() } else { format!(" `{}`", f.source) };
    let kind = f.kind.as_str();
    let per = format_delta(f.per_step_bytes);
    if f.kind == LeakKind::PythonObject {
        return format!(
            "{name}{code} keeps Python objects alive: {per} per step ({} in {} blocks allocated there since the probe began); a container grows every step",
            format_bytes(f.live_bytes),
            f.live_count,
        );
    }
    // Objects from the last probe step are alive at its end in any loop: the earlier steps are judged.
    let judged = f.probe_steps.max(1).saturating_sub(1).max(1);
    let (live_count, steps_alive) = (f.live_count, f.steps_alive);
    let mut message = match &f.kept_in {
        // "makes CPU tensors kept in list `kept` (put there at train.py:18 `kept.append(out)`)".
        Some(k) => format!(
            "{name}{code} makes {kind}s kept in {}: {per} per step, {live_count} live from {steps_alive} of {judged} earlier probe steps",
            kept_in_phrase(k),
        ),
        None => format!(
            "{name}{code} keeps {kind}s alive: {per} per step, {live_count} live from {steps_alive} of {judged} earlier probe steps",
        ),
    };
    let nodes = f.graph_nodes.unwrap_or(0);
    if f.holds_graph && (f.graph_per_step_bytes.is_some() || !f.kept_tensors) {
        let saved = f.graph_saved_bytes.unwrap_or(0);
        let grows = match f.graph_per_step_bytes {
            Some(gp) => format!("{} per step", format_delta(gp)),
            None if f.graph_saves_unread => {
                "its saved tensors could not be read (a saved-tensor hook recomputes them), its nodes grow every step"
                    .into()
            }
            None => "its saved tensors were freed by backward, its nodes grow every step".into(),
        };
        message = format!(
            "{name}{code} keeps each step's autograd graph alive: a {kind} from this line has a grad_fn whose graph holds {} of saved tensors ({nodes} nodes{}), {grows}; keep `.item()` or `.detach()` of it instead",
            format_bytes(saved),
            if f.graph_truncated { ", walk stopped at its budget" } else { "" },
        );
        if !f.holds_tensors_of.is_empty() {
            message.push_str(&format!(" (the graph holds the tensors of {})", f.holds_tensors_of.join(", ")));
        }
        if let Some(k) = &f.kept_in {
            message.push_str(&format!("; kept in {}", kept_in_phrase(k)));
        }
    } else if f.kept_in.is_some() {
        if f.holds_graph {
            message.push_str(&format!(
                ", each with its autograd graph ({nodes} nodes; its saved tensors were freed by backward)"
            ));
        }
        message.push_str("; drop old entries or keep `.item()`/`.detach().cpu()` of what you need");
    } else {
        message.push_str("; something (a list, dict or cache) keeps them: drop old entries or keep `.item()`/`.detach().cpu()` of what you need");
    }
    message
}

/// Fills in a probe report's sentences: each finding's `message`, and `unexplained` when growth was seen but
/// no line holds it. `analysis::leaks::leak_findings` decides; every front end that shows a report calls this.
pub fn describe_leaks(r: &mut LeakReport) {
    for f in &mut r.findings {
        f.message = leak_message(f);
    }
    r.unexplained = match (&r.growth, r.findings.is_empty()) {
        (Some(g), true) => Some(format!(
            "{} grew by {} per step over {} steps, but no line kept tensors or Python objects alive during the {} probe steps (a cache that filled up, or memory outside tensors and Python objects)",
            g.what.as_str(),
            format_delta(g.per_step_bytes),
            g.window_steps,
            r.probe_steps.max(1),
        )),
        _ => None,
    };
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
