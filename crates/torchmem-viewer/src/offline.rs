//! The offline page (`torchmem view FILE -o PAGE.html`): one self-contained file, the same script and style
//! as the served page inlined and allowed by their SHA-256 in a CSP meta tag (`connect-src 'none'`: the
//! page cannot reach any network), the data embedded as a JSON data block (never executed; `<`, `>` and `&`
//! escaped so no string can close it). Detail is bounded: the allocations that cover the most of the chart
//! (bytes × lifetime) are embedded until the byte budget is spent; the level envelope and the segments at
//! the peak always are.

use std::collections::HashMap;

use serde_json::{json, Value};

use crate::sha256::csp_hash;
use crate::trace::{Trace, ALIVE};
use crate::{api, Doc, PAGE_CSS, PAGE_JS};

/// Default budget for the embedded detail.
pub const DEFAULT_BUDGET_BYTES: usize = 20 << 20;

/// Columns of the embedded level envelope.
const LEVEL_COLS: usize = 4096;

fn memory_data(t: &Trace, index: &crate::lod::LodIndex, budget: usize) -> Value {
    let mut order: Vec<u32> = (0..t.allocs.len() as u32).collect();
    let weight = |i: u32| {
        let a = &t.allocs[i as usize];
        let end = if a.t1 == ALIVE { t.events } else { a.t1 };
        a.size_bytes as f64 * (end.saturating_sub(a.t0).max(1)) as f64
    };
    order.sort_by(|&a, &b| weight(b).total_cmp(&weight(a)));
    let mut frames: Vec<String> = Vec::new();
    let mut frame_ids: HashMap<u32, usize> = HashMap::new();
    let mut stacks: Vec<Vec<usize>> = Vec::new();
    let mut stack_ids: HashMap<u32, usize> = HashMap::new();
    let mut rows: Vec<Value> = Vec::new();
    let mut spent = 0usize;
    for &i in &order {
        let a = &t.allocs[i as usize];
        let mut cost = 60;
        if !stack_ids.contains_key(&a.stack) {
            for &f in t.snap.stack(a.stack) {
                cost += 8;
                if !frame_ids.contains_key(&f) {
                    cost += t.snap.frame_text(f).len() + 4;
                }
            }
        }
        if spent + cost > budget {
            break;
        }
        spent += cost;
        let s = match stack_ids.get(&a.stack) {
            Some(&s) => s,
            None => {
                let fs: Vec<usize> = t
                    .snap
                    .stack(a.stack)
                    .iter()
                    .map(|&f| {
                        *frame_ids.entry(f).or_insert_with(|| {
                            frames.push(t.snap.frame_text(f));
                            frames.len() - 1
                        })
                    })
                    .collect();
                stacks.push(fs);
                stack_ids.insert(a.stack, stacks.len() - 1);
                stacks.len() - 1
            }
        };
        let end = if a.t1 == ALIVE { t.events } else { a.t1 };
        let (t0, y, size) = (a.t0, a.y, a.size_bytes);
        rows.push(json!([i, t0, end, y, size, t.site(i), t.category(i), s, t.before_history(i) as u8]));
    }
    let whole = crate::lod::Window {
        t0: 0.0,
        t1: t.events as f64,
        y0: 0.0,
        y1: t.layout_bytes as f64,
        cols: LEVEL_COLS,
        rows: 1,
    };
    let full = index.query(t, whole, &|_| false);
    json!({
        "allocs": rows,
        "stacks": stacks,
        "frames": frames,
        "left_out": t.allocs.len() - rows.len(),
        "level_max": full.level_max,
        "level_min": full.level_min,
        "segments_at_peak": api::segments_json(t, t.peak_event),
        "icicle_at_peak": {"t": t.peak_event, "root": t.icicle_at(t.peak_event, 0.005, 24)},
        "time_us": [t.time_us.first().unwrap_or(0), t.time_us.last().unwrap_or(0)],
    })
}

/// The JSON the offline page embeds.
pub fn data(docs: &[Doc], budget_bytes: usize) -> Value {
    let mems = docs.iter().filter(|d| matches!(d, Doc::Memory { .. })).count().max(1);
    let per_doc: Vec<Value> = docs
        .iter()
        .map(|d| match d {
            Doc::Memory { trace, index, .. } => memory_data(trace, index, budget_bytes / mems),
            Doc::Profile { view, .. } => json!({"query": view.query(0.0, view.end_ns as f64, 4000)}),
        })
        .collect();
    let mems: Vec<usize> = (0..docs.len()).filter(|&i| matches!(docs[i], Doc::Memory { .. })).collect();
    let diff = match mems[..] {
        [a, b, ..] => {
            let q = [("a".to_string(), a.to_string()), ("b".to_string(), b.to_string())].into_iter().collect();
            api::diff(docs, &q).unwrap_or(Value::Null)
        }
        _ => Value::Null,
    };
    json!({"offline": true, "meta": api::meta(docs), "docs": per_doc, "diff": diff})
}

/// JSON safe inside an HTML data block: no `<`, `>` or `&` can end it or start markup.
pub fn json_for_html(v: &Value) -> String {
    serde_json::to_string(v)
        .unwrap_or_default()
        .replace('<', "\\u003c")
        .replace('>', "\\u003e")
        .replace('&', "\\u0026")
        .replace('\u{2028}', "\\u2028")
        .replace('\u{2029}', "\\u2029")
}

/// The offline CSP: the inline script and style by hash, nothing else, no network.
pub fn offline_csp() -> String {
    format!(
        "default-src 'none'; script-src {}; style-src {}; img-src data:; connect-src 'none'; base-uri 'none'; form-action 'none'",
        csp_hash(PAGE_JS),
        csp_hash(PAGE_CSS)
    )
}

/// The whole offline page.
pub fn render(docs: &[Doc], budget_bytes: usize) -> String {
    crate::page(
        &format!("<meta http-equiv=\"Content-Security-Policy\" content=\"{}\">", offline_csp()),
        &format!("<style>{PAGE_CSS}</style>"),
        &format!(
            "<script id=\"tm-data\" type=\"application/json\">{}</script>",
            json_for_html(&data(docs, budget_bytes))
        ),
        &format!("<script>{PAGE_JS}</script>"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_json_cannot_close_its_block() {
        let v = json!({"s": "</script><img src=x onerror=alert(1)>&amp;\u{2028}"});
        let text = json_for_html(&v);
        assert!(!text.contains('<') && !text.contains('>') && !text.contains('&'), "{text}");
        let back: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(back, v);
    }

    #[test]
    fn the_budget_bounds_the_embedded_detail_largest_first() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/sim-h200/gpt2_adamw_amp__recorded.pickle.gz");
        let docs = vec![crate::load(&path, None).unwrap()];
        let Doc::Memory { trace, .. } = &docs[0] else { panic!("a trace") };
        let all = data(&docs, DEFAULT_BUDGET_BYTES);
        assert_eq!(all["docs"][0]["left_out"], 0);
        assert_eq!(all["docs"][0]["allocs"].as_array().unwrap().len(), trace.allocs.len());
        let small = data(&docs, 20_000);
        let kept = small["docs"][0]["allocs"].as_array().unwrap();
        assert!(!kept.is_empty() && kept.len() < trace.allocs.len());
        assert_eq!(small["docs"][0]["left_out"].as_u64().unwrap() as usize, trace.allocs.len() - kept.len());
        assert!(json_for_html(&small).len() < 20_000 + 200_000, "level and segments are extra, but bounded");
        // The first kept allocation covers the most of the chart (bytes x lifetime).
        let cover = |a: &crate::trace::Alloc| {
            let end = if a.t1 == ALIVE { trace.events } else { a.t1 };
            a.size_bytes as f64 * end.saturating_sub(a.t0).max(1) as f64
        };
        let best = trace.allocs.iter().map(cover).fold(0.0, f64::max);
        let first = kept[0][0].as_u64().unwrap() as usize;
        assert_eq!(cover(&trace.allocs[first]), best);
    }

    #[test]
    fn offline_page_has_the_hash_csp_and_no_network() {
        let page = render(&[], DEFAULT_BUDGET_BYTES);
        assert!(page.starts_with("<!DOCTYPE html>") && page.contains("<title>torchmem"));
        assert!(page.contains("connect-src 'none'"));
        assert!(page.contains(&csp_hash(PAGE_JS)));
        assert!(!page.contains("unsafe-inline") && !page.contains("src=\"http"));
        // The inline script is the asset byte for byte (its hash must match).
        assert!(page.contains(&format!("<script>{PAGE_JS}</script>")));
    }
}
