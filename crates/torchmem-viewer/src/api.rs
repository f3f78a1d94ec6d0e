//! The viewer's JSON endpoints, one function per route, shared by the HTTP server and the offline page's
//! builder. Every string from a file travels as JSON and is put into the page with `textContent`.

use std::collections::HashMap;

use serde_json::{json, Value};

use crate::trace::{Trace, ALIVE, CATEGORIES};
use crate::Doc;

pub type ApiError = (u16, String);

fn param<'a>(q: &'a HashMap<String, String>, k: &str) -> Option<&'a str> {
    q.get(k).map(String::as_str)
}

fn num<T: std::str::FromStr>(q: &HashMap<String, String>, k: &str) -> Result<T, ApiError> {
    param(q, k).ok_or((400, format!("missing parameter {k}")))?.parse().map_err(|_| (400, format!("bad parameter {k}")))
}

fn doc<'a>(docs: &'a [Doc], q: &HashMap<String, String>) -> Result<&'a Doc, ApiError> {
    let i: usize = num(q, "doc").unwrap_or(0);
    docs.get(i).ok_or((404, format!("no document {i}")))
}

fn memory<'a>(docs: &'a [Doc], q: &HashMap<String, String>) -> Result<&'a Doc, ApiError> {
    match doc(docs, q)? {
        d @ Doc::Memory { .. } => Ok(d),
        Doc::Profile { .. } => Err((400, "this document is a profile, not an allocator trace".into())),
    }
}

/// The description of every document: what the page needs before its first query.
pub fn meta(docs: &[Doc]) -> Value {
    let docs: Vec<Value> = docs
        .iter()
        .map(|d| match d {
            Doc::Memory { name, kind, trace: t, .. } => json!({
                "type": "memory",
                "name": name,
                "kind": kind,
                "device": t.device,
                "events": t.events,
                "allocations": t.allocs.len(),
                "y_max": t.layout_bytes,
                "peak_bytes": t.peak_bytes,
                "peak_event": t.peak_event,
                "sites": t.sites,
                "categories": CATEGORIES,
                "ooms": t.ooms,
                "annotations": &t.annotations[..t.annotations.len().min(20_000)],
                "time_us": [t.time_us.first().unwrap_or(0), t.time_us.last().unwrap_or(0)],
            }),
            Doc::Profile { name, view } => json!({
                "type": "profile",
                "name": name,
                "kind": "torchmem run profile",
                "command": view.command,
                "end_ns": view.end_ns,
                "series": view.series.iter().map(|s| s.name.clone()).collect::<Vec<_>>(),
                "y_max": view.series.iter().flat_map(|s| s.bytes.iter().copied()).max().unwrap_or(1),
            }),
        })
        .collect();
    json!({ "docs": docs, "version": env!("CARGO_PKG_VERSION") })
}

/// Stack ids whose frames contain `q` (case-insensitive), as a bitmap over `snap.stacks`.
fn stack_hits(t: &Trace, q: &str) -> Vec<bool> {
    let q = q.to_lowercase();
    let frames: Vec<bool> =
        (0..t.snap.frames.len() as u32).map(|f| t.snap.frame_text(f).to_lowercase().contains(&q)).collect();
    t.snap.stacks.iter().map(|s| s.iter().any(|&f| frames.get(f as usize) == Some(&true))).collect()
}

/// Bands, merged small blocks and the level for a window.
pub fn lod(docs: &[Doc], q: &HashMap<String, String>) -> Result<Value, ApiError> {
    let Doc::Memory { trace: t, index, .. } = memory(docs, q)? else { unreachable!() };
    let t0: f64 = num(q, "t0")?;
    let t1: f64 = num(q, "t1")?;
    let cols: usize = num(q, "cols")?;
    let rows: usize = num(q, "rows")?;
    let pin: Option<u32> = param(q, "pin").and_then(|s| s.parse().ok());
    let hits = param(q, "q").filter(|s| !s.trim().is_empty()).map(|s| stack_hits(t, s.trim()));
    let keep = |id: u32| {
        pin == Some(id)
            || hits.as_ref().is_some_and(|h| {
                let s = t.allocs[id as usize].stack;
                h.get(s as usize) == Some(&true)
            })
    };
    let y0: f64 = num(q, "y0").unwrap_or(0.0);
    let y1: f64 = num(q, "y1").unwrap_or(t.layout_bytes as f64);
    let r = index.query(t, crate::lod::Window { t0, t1, y0, y1, cols, rows }, &keep);
    serde_json::to_value(r).map_err(|e| (500, e.to_string()))
}

/// One allocation: size, lifetime, site, category and its whole stack.
pub fn block_json(t: &Trace, id: u32) -> Option<Value> {
    let a = *t.allocs.get(id as usize)?;
    let (addr, size, t0) = (a.addr, a.size_bytes, a.t0);
    let end = if a.t1 == ALIVE { None } else { Some(a.t1) };
    let time = |e: u32| t.time_us.get(e as usize);
    Some(json!({
        "id": id,
        "addr": format!("0x{addr:x}"),
        "size": size,
        "t0": t0,
        "t1": end,
        "time0_us": time(t0),
        "time1_us": end.and_then(time),
        "lifetime_us": end.and_then(time).zip(time(t0)).map(|(b, a)| b - a),
        "site": t.sites.get(t.site(id) as usize),
        "category": CATEGORIES[t.category(id) as usize],
        "before_history": t.before_history(id),
        "stack": t.stack_text(a.stack),
    }))
}

pub fn block(docs: &[Doc], q: &HashMap<String, String>) -> Result<Value, ApiError> {
    let Doc::Memory { trace: t, .. } = memory(docs, q)? else { unreachable!() };
    block_json(t, num(q, "id")?).ok_or((404, "no such allocation".into()))
}

/// The allocation under a point (event `t`, byte offset `y` of the layout), if any.
pub fn hit(docs: &[Doc], q: &HashMap<String, String>) -> Result<Value, ApiError> {
    let Doc::Memory { trace: t, index, .. } = memory(docs, q)? else { unreachable!() };
    let x: f64 = num(q, "t")?;
    let y: f64 = num(q, "y")?;
    let e = x.floor().max(0.0) as u32;
    let mut found = None;
    index.overlapping(&t.allocs, e, e + 1, |id, a| {
        if (a.y as f64) <= y && y < (a.y + a.size_bytes.max(1)) as f64 {
            found = Some(id);
        }
    });
    Ok(match found {
        Some(id) => block_json(t, id).unwrap_or(Value::Null),
        None => Value::Null,
    })
}

/// The segments alive after event `t`, with their blocks (free bytes are the gaps).
pub fn segments(docs: &[Doc], q: &HashMap<String, String>) -> Result<Value, ApiError> {
    let Doc::Memory { trace: t, .. } = memory(docs, q)? else { unreachable!() };
    let e: u32 = num::<f64>(q, "t")?.floor().clamp(0.0, t.events.saturating_sub(1) as f64) as u32;
    Ok(segments_json(t, e))
}

pub fn segments_json(t: &Trace, e: u32) -> Value {
    let segs = t.segments_at(e);
    let reserved: u64 = segs.iter().map(|s| s.total_bytes).sum();
    let used: u64 = segs.iter().flat_map(|s| s.blocks.iter().map(|b| b.1)).sum();
    let shown: Vec<_> = segs.into_iter().take(400).collect();
    json!({"t": e, "reserved_bytes": reserved, "allocated_bytes": used, "segments": shown})
}

/// The composition of the memory alive after event `t` (the peak by default) as an icicle of Python stacks.
pub fn icicle(docs: &[Doc], q: &HashMap<String, String>) -> Result<Value, ApiError> {
    let Doc::Memory { trace: t, .. } = memory(docs, q)? else { unreachable!() };
    let e = match param(q, "t") {
        Some(_) => num::<f64>(q, "t")?.floor().clamp(0.0, t.events.saturating_sub(1) as f64) as u32,
        None => t.peak_event,
    };
    Ok(json!({"t": e, "root": t.icicle_at(e, 0.005, 24)}))
}

/// Allocations whose stack matches a `file:line` or op substring.
pub fn search(docs: &[Doc], q: &HashMap<String, String>) -> Result<Value, ApiError> {
    let Doc::Memory { trace: t, .. } = memory(docs, q)? else { unreachable!() };
    let query = param(q, "q").unwrap_or("");
    let (ids, total) = t.search(query, 10_000);
    Ok(json!({"q": query, "ids": ids, "total": total}))
}

pub fn profile(docs: &[Doc], q: &HashMap<String, String>) -> Result<Value, ApiError> {
    match doc(docs, q)? {
        Doc::Profile { view, .. } => Ok(view.query(num(q, "t0")?, num(q, "t1")?, num(q, "cols")?)),
        Doc::Memory { .. } => Err((400, "this document is an allocator trace, not a profile".into())),
    }
}

/// Two traces at their peaks, by allocation site: the `top` sites that changed most, then one row for the
/// rest, so that each column adds up to its trace's peak.
pub fn diff(docs: &[Doc], q: &HashMap<String, String>) -> Result<Value, ApiError> {
    let pick = |k: &str| -> Result<&Trace, ApiError> {
        let i: usize = num(q, k)?;
        match docs.get(i) {
            Some(Doc::Memory { trace, .. }) => Ok(trace),
            _ => Err((400, format!("document {i} is not an allocator trace"))),
        }
    };
    let (a, b) = (pick("a")?, pick("b")?);
    let (sa, sb) = (a.sites_at(a.peak_event), b.sites_at(b.peak_event));
    let mut names: Vec<&String> = sa.keys().chain(sb.keys()).collect();
    names.sort();
    names.dedup();
    let get = |m: &HashMap<String, (u64, u64)>, n: &str| m.get(n).copied().unwrap_or((0, 0));
    let mut rows: Vec<(String, u64, u64, i64)> = names
        .into_iter()
        .map(|n| {
            let (x, y) = (get(&sa, n).0, get(&sb, n).0);
            (n.clone(), x, y, y as i64 - x as i64)
        })
        .collect();
    rows.sort_by_key(|r| (std::cmp::Reverse(r.3.unsigned_abs()), r.0.clone()));
    let top = 15;
    let mut out: Vec<Value> = rows
        .iter()
        .take(top)
        .map(|r| json!({"site": r.0, "a_bytes": r.1, "b_bytes": r.2, "delta_bytes": r.3}))
        .collect();
    if rows.len() > top {
        let (x, y): (u64, u64) = rows[top..].iter().fold((0, 0), |acc, r| (acc.0 + r.1, acc.1 + r.2));
        out.push(json!({"site": format!("({} other sites)", rows.len() - top), "a_bytes": x, "b_bytes": y,
            "delta_bytes": y as i64 - x as i64}));
    }
    Ok(json!({"a_peak_bytes": a.peak_bytes, "b_peak_bytes": b.peak_bytes, "rows": out}))
}

/// Dispatches one API route (`lod`, `block`, …).
pub fn handle(docs: &[Doc], route: &str, q: &HashMap<String, String>) -> Result<Value, ApiError> {
    match route {
        "meta" => Ok(meta(docs)),
        "lod" => lod(docs, q),
        "block" => block(docs, q),
        "hit" => hit(docs, q),
        "segments" => segments(docs, q),
        "icicle" => icicle(docs, q),
        "diff" => diff(docs, q),
        "search" => search(docs, q),
        "profile" => profile(docs, q),
        _ => Err((404, format!("no endpoint {route}"))),
    }
}
