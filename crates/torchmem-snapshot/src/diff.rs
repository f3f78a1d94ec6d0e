//! `torchmem snapshot diff A B`: what grew between two snapshots, by allocation site, comparing the
//! blocks alive at the end of each (from the segments), plus the change of the device totals.

use std::collections::HashMap;

use serde::Serialize;

use crate::model::*;
use crate::sites::site_label;

#[derive(Debug, Clone, Serialize)]
pub struct DiffRow {
    pub site: String,
    pub before_bytes: u64,
    pub after_bytes: u64,
    pub delta_bytes: i64,
    pub before_count: u64,
    pub after_count: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Diff {
    pub reserved_before_bytes: u64,
    pub reserved_after_bytes: u64,
    pub allocated_before_bytes: u64,
    pub allocated_after_bytes: u64,
    pub rows: Vec<DiffRow>,
}

fn by_site(snap: &Snapshot) -> HashMap<String, (u64, u64)> {
    let mut m: HashMap<String, (u64, u64)> = HashMap::new();
    let mut cache: HashMap<StackId, String> = HashMap::new();
    for s in &snap.segments {
        for b in &s.blocks {
            if b.state == BlockState::ActiveAllocated {
                let label = cache.entry(b.stack).or_insert_with(|| site_label(snap, b.stack)).clone();
                let e = m.entry(label).or_default();
                e.0 += b.size_bytes;
                e.1 += 1;
            }
        }
    }
    m
}

/// Compares the live blocks of two snapshots by site; rows sorted by growth, largest first.
pub fn diff(a: &Snapshot, b: &Snapshot) -> Diff {
    let ma = by_site(a);
    let mb = by_site(b);
    let mut rows: Vec<DiffRow> = Vec::new();
    let mut keys: Vec<&String> = ma.keys().chain(mb.keys()).collect();
    keys.sort();
    keys.dedup();
    for k in keys {
        let (ab, ac) = ma.get(k).copied().unwrap_or((0, 0));
        let (bb, bc) = mb.get(k).copied().unwrap_or((0, 0));
        if ab == bb && ac == bc {
            continue;
        }
        rows.push(DiffRow {
            site: k.clone(),
            before_bytes: ab,
            after_bytes: bb,
            delta_bytes: bb as i64 - ab as i64,
            before_count: ac,
            after_count: bc,
        });
    }
    rows.sort_by(|x, y| y.delta_bytes.cmp(&x.delta_bytes).then_with(|| x.site.cmp(&y.site)));
    let tot = |s: &Snapshot| {
        let r: u64 = s.segments.iter().map(|g| g.total_bytes).sum();
        let al: u64 = s
            .segments
            .iter()
            .flat_map(|g| &g.blocks)
            .filter(|b| b.state == BlockState::ActiveAllocated)
            .map(|b| b.size_bytes)
            .sum();
        (r, al)
    };
    let (ra, aa) = tot(a);
    let (rb, ab) = tot(b);
    Diff {
        reserved_before_bytes: ra,
        reserved_after_bytes: rb,
        allocated_before_bytes: aa,
        allocated_after_bytes: ab,
        rows,
    }
}
