//! The offline, self-contained HTML report of a snapshot: memory over time stacked by allocation
//! site, the peak's composition as an icicle chart of Python stacks, and a map of segments. Only
//! aggregates are embedded (≤ 1000 time buckets, pruned stack tree, capped segment runs), so a
//! 1 GB snapshot gives a page of a few hundred KB. No network resources: inline CSS, JS and SVG.

use std::collections::HashMap;

use serde_json::{json, Value as J};

use crate::fmt::{bytes, html_escape};
use crate::model::*;
use crate::replay::{device_trace, live_at, Change, LiveBlock, LiveSet};
use crate::sites::{self, site_label};
use crate::summary::Summary;

const MAX_SERIES: usize = 12;
const MAX_BUCKETS: usize = 1000;
const MAX_SEGMENTS: usize = 300;
const MAX_RUNS_PER_SEGMENT: usize = 200;

/// Memory over time for one device, stacked by site: `series` names, `t_us` per bucket, `levels[s][b]`.
fn timeline(snap: &Snapshot, device: usize, peak_index: Option<usize>) -> J {
    let idxs = device_trace(snap, device);
    if idxs.is_empty() {
        return J::Null;
    }
    // Series: the largest sites at the peak, then "other".
    let at_peak = live_at(snap, device, peak_index);
    let rows = sites::group_sites(snap, &at_peak);
    let mut names: Vec<String> = rows.iter().take(MAX_SERIES).map(|r| r.site.clone()).collect();
    let other = names.len();
    names.push("other sites".into());
    let index_of: HashMap<&str, usize> = names.iter().enumerate().take(other).map(|(i, n)| (n.as_str(), i)).collect();
    let mut stack_series: HashMap<StackId, usize> = HashMap::new();
    let mut series_of = |stack: StackId| -> usize {
        *stack_series
            .entry(stack)
            .or_insert_with(|| index_of.get(site_label(snap, stack).as_str()).copied().unwrap_or(other))
    };
    // Initial levels: blocks alive before the first event.
    let mut level = vec![0i128; names.len()];
    let mut live = LiveSet::new();
    for b in live_at(snap, device, None) {
        level[series_of(b.stack)] += b.size_bytes as i128;
        live.seed(b);
    }
    let n = idxs.len();
    let buckets = n.min(MAX_BUCKETS);
    let mut out_levels = vec![vec![0u64; buckets]; names.len()];
    let mut out_t = vec![0i64; buckets];
    let mut best_total: Vec<i128> = vec![i128::MIN; buckets];
    let mut total: i128 = level.iter().sum();
    for (i, e) in idxs.iter().enumerate() {
        match live.apply(e) {
            Change::Alloc { size_bytes, stack, .. } => {
                level[series_of(stack)] += size_bytes as i128;
                total += size_bytes as i128;
            }
            Change::Free { block } => {
                level[series_of(block.stack)] -= block.size_bytes as i128;
                total -= block.size_bytes as i128;
            }
            Change::FreeWithoutAlloc { .. } | Change::None => {}
        }
        let b = i * buckets / n;
        if total > best_total[b] {
            best_total[b] = total;
            out_t[b] = e.time_us;
            for (s, l) in level.iter().enumerate() {
                out_levels[s][b] = (*l).max(0) as u64;
            }
        }
    }
    json!({ "series": names, "t_us": out_t, "levels": out_levels })
}

/// Icicle tree of Python frames (outermost first) of the blocks alive at the peak.
fn icicle(snap: &Snapshot, blocks: &[LiveBlock]) -> J {
    struct Node {
        name: String,
        bytes: u64,
        children: HashMap<String, usize>,
    }
    let mut nodes = vec![Node { name: "all live blocks".into(), bytes: 0, children: HashMap::new() }];
    let mut path_cache: HashMap<StackId, Vec<String>> = HashMap::new();
    for b in blocks {
        let path = path_cache.entry(b.stack).or_insert_with(|| {
            let mut p: Vec<String> = sites::python_frames(snap, b.stack, 24);
            p.reverse();
            if p.is_empty() {
                p.push("(no frames recorded)".into());
            }
            p
        });
        nodes[0].bytes += b.size_bytes;
        let mut cur = 0usize;
        for name in path.iter() {
            let next = match nodes[cur].children.get(name) {
                Some(&c) => c,
                None => {
                    let id = nodes.len();
                    nodes.push(Node { name: name.clone(), bytes: 0, children: HashMap::new() });
                    nodes[cur].children.insert(name.clone(), id);
                    id
                }
            };
            nodes[next].bytes += b.size_bytes;
            cur = next;
        }
    }
    let total = nodes[0].bytes.max(1);
    // Emit iteratively-bounded JSON (depth ≤ 25 by construction), pruning nodes < 0.2 % of total.
    fn emit(nodes: &[Node], i: usize, total: u64) -> J {
        let mut kids: Vec<usize> =
            nodes[i].children.values().copied().filter(|&c| nodes[c].bytes * 500 >= total).collect();
        kids.sort_by(|a, b| nodes[*b].bytes.cmp(&nodes[*a].bytes).then_with(|| nodes[*a].name.cmp(&nodes[*b].name)));
        kids.truncate(40);
        json!({ "n": nodes[i].name, "v": nodes[i].bytes, "c": kids.iter().map(|&c| emit(nodes, c, total)).collect::<Vec<_>>() })
    }
    emit(&nodes, 0, total)
}

/// Segments as runs of block states, largest segments first.
fn segment_map(snap: &Snapshot) -> J {
    let mut segs: Vec<&Segment> = snap.segments.iter().collect();
    segs.sort_by(|a, b| b.total_bytes.cmp(&a.total_bytes).then(a.address.cmp(&b.address)));
    let shown = segs.len().min(MAX_SEGMENTS);
    let mut out = Vec::with_capacity(shown);
    for s in segs.iter().take(shown) {
        let mut runs: Vec<(u8, u64)> = Vec::new();
        for b in &s.blocks {
            let st = match b.state {
                BlockState::ActiveAllocated => 0u8,
                BlockState::ActivePendingFree => 1,
                BlockState::Inactive => 2,
            };
            match runs.last_mut() {
                Some((ls, lb)) if *ls == st => *lb += b.size_bytes,
                _ => runs.push((st, b.size_bytes)),
            }
        }
        if runs.len() > MAX_RUNS_PER_SEGMENT {
            // Merge the smallest neighbours into "mixed" (3) runs so the bar stays drawable.
            let chunk = runs.len().div_ceil(MAX_RUNS_PER_SEGMENT);
            runs = runs
                .chunks(chunk)
                .map(|c| {
                    let sz: u64 = c.iter().map(|r| r.1).sum();
                    let st = if c.iter().all(|r| r.0 == c[0].0) { c[0].0 } else { 3 };
                    (st, sz)
                })
                .collect();
        }
        out.push(json!({
            "addr": format!("{:#x}", s.address),
            "device": s.device,
            "type": s.segment_type,
            "total": s.total_bytes,
            "runs": runs.iter().map(|(s, b)| json!([s, b])).collect::<Vec<_>>(),
        }));
    }
    json!({ "segments": out, "hidden": segs.len() - shown })
}

/// Renders the whole page.
pub fn render(snap: &Snapshot, summary: &Summary, name: &str) -> String {
    let dev = summary.devices.iter().find(|d| d.trace_entries > 0).or(summary.devices.first());
    let (device, peak_index) = dev.map(|d| (d.device, d.peak_index)).unwrap_or((0, None));
    let has_trace = dev.is_some_and(|d| d.trace_entries > 0);
    let peak_blocks: Vec<LiveBlock> = if has_trace {
        live_at(snap, device, peak_index)
    } else {
        snap.segments
            .iter()
            .flat_map(|s| s.blocks.iter())
            .filter(|b| b.state != BlockState::Inactive)
            .map(|b| LiveBlock { addr: b.address, size_bytes: b.size_bytes, stack: b.stack, before_history: false })
            .collect()
    };
    let data = json!({
        "name": name,
        "device": device,
        "timeline": if has_trace { timeline(snap, device, peak_index) } else { J::Null },
        "icicle": icicle(snap, &peak_blocks),
        "segments": segment_map(snap),
    });
    // `</` must not appear inside the script element.
    let data_text = serde_json::to_string(&data).unwrap_or_else(|_| "{}".into()).replace("</", "<\\/");
    let mut cards = String::new();
    for d in &summary.devices {
        cards.push_str(&format!(
            "<div class=card><h3>Device {}</h3><table>\
             <tr><td>reserved</td><td>{}</td></tr><tr><td>allocated</td><td>{}</td></tr>\
             <tr><td>reserved but unallocated</td><td>{}</td></tr><tr><td>inactive split</td><td>{}</td></tr>\
             <tr><td>largest free block</td><td>{}</td></tr><tr><td>traced peak (requested)</td><td>{}</td></tr>\
             <tr><td>trace entries</td><td>{}</td></tr></table><p class=note>{}</p></div>",
            d.device,
            bytes(d.reserved_bytes),
            bytes(d.allocated_bytes),
            bytes(d.reserved_unallocated_bytes),
            bytes(d.inactive_split_bytes),
            bytes(d.largest_free_block_bytes),
            bytes(d.peak_requested_bytes),
            d.trace_entries,
            html_escape(&d.history.note)
        ));
    }
    let actions: String = summary
        .action_counts
        .iter()
        .map(|(a, n)| format!("<tr><td>{}</td><td>{n}</td></tr>", html_escape(a)))
        .collect();
    TEMPLATE
        .replace("{{TITLE}}", &html_escape(name))
        .replace("{{CARDS}}", &cards)
        .replace("{{ACTIONS}}", &actions)
        .replace("{{DATA}}", &data_text)
}

const TEMPLATE: &str = r##"<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:">
<title>torchmem snapshot: {{TITLE}}</title>
<style>
body{font:13px/1.4 system-ui,sans-serif;margin:16px;color:#222;background:#fafafa}
h1{font-size:18px} h2{font-size:15px;margin-top:24px}
.cards{display:flex;gap:12px;flex-wrap:wrap}.card{background:#fff;border:1px solid #ddd;border-radius:6px;padding:8px 12px}
.card h3{margin:0 0 6px;font-size:14px} td{padding:1px 8px 1px 0} .note{color:#666;max-width:420px}
svg{background:#fff;border:1px solid #ddd} .legend span{display:inline-block;margin-right:12px}
.legend i{display:inline-block;width:10px;height:10px;margin-right:4px}
#tip{position:fixed;pointer-events:none;background:#333;color:#fff;padding:4px 6px;border-radius:4px;font-size:12px;display:none;max-width:600px}
</style></head><body>
<h1>Allocator snapshot: {{TITLE}}</h1>
<div class=cards>{{CARDS}}<div class=card><h3>Trace actions</h3><table>{{ACTIONS}}</table></div></div>
<h2>Memory over time, stacked by allocation site (requested bytes; the largest sites at the peak)</h2>
<svg id=timeline width=1100 height=320></svg><div id=timeline-legend class=legend></div>
<h2>Composition at the peak (icicle of Python stacks, outermost frame on top)</h2>
<svg id=icicle width=1100 height=360></svg>
<h2>Segments (largest first): <span style="color:#4c78a8">allocated</span>, <span style="color:#f58518">pending free</span>, <span style="color:#bbb">inactive</span>, <span style="color:#9467bd">mixed</span></h2>
<svg id=segments width=1100 height=100></svg>
<div id=tip></div>
<script id=data type="application/json">{{DATA}}</script>
<script>
"use strict";
const D = JSON.parse(document.getElementById("data").textContent);
const NS = "http://www.w3.org/2000/svg";
const COLORS = ["#4c78a8","#f58518","#e45756","#72b7b2","#54a24b","#eeca3b","#b279a2","#ff9da6","#9d755d","#bab0ac","#1f77b4","#2ca02c","#cccccc"];
const tip = document.getElementById("tip");
function fmt(b){const u=["B","KiB","MiB","GiB","TiB"];let i=0;while(b>=1024&&i<4){b/=1024;i++;}return (i?b.toFixed(2):b)+" "+u[i];}
function el(tag, attrs, parent){const e=document.createElementNS(NS,tag);for(const k in attrs)e.setAttribute(k,attrs[k]);if(parent)parent.appendChild(e);return e;}
function hover(e, text){e.addEventListener("mousemove",ev=>{tip.style.display="block";tip.style.left=(ev.clientX+12)+"px";tip.style.top=(ev.clientY+12)+"px";tip.textContent=text;});e.addEventListener("mouseleave",()=>{tip.style.display="none";});}
function drawTimeline(){
  const svg=document.getElementById("timeline"), T=D.timeline;
  if(!T){el("text",{x:20,y:40},svg).textContent="No trace in this snapshot (record with _record_memory_history).";return;}
  const W=+svg.getAttribute("width")-70, H=+svg.getAttribute("height")-40, n=T.t_us.length;
  let max=1; for(let b=0;b<n;b++){let s=0;for(const l of T.levels)s+=l[b];if(s>max)max=s;}
  const x=b=>60+(n>1?b*W/(n-1):W/2), y=v=>10+H-v*H/max;
  const base=new Array(n).fill(0);
  T.levels.forEach((lv,si)=>{
    const top=base.map((v,b)=>v+lv[b]);
    let d="M"+x(0)+","+y(top[0]);
    for(let b=1;b<n;b++)d+="L"+x(b)+","+y(top[b]);
    for(let b=n-1;b>=0;b--)d+="L"+x(b)+","+y(base[b]);
    const p=el("path",{d:d+"Z",fill:COLORS[si%COLORS.length],class:"band"},svg);
    hover(p,T.series[si]+" — peak "+fmt(Math.max(...lv)));
    for(let b=0;b<n;b++)base[b]=top[b];
  });
  for(let k=0;k<=4;k++){const v=max*k/4;el("text",{x:4,y:y(v)+4,"font-size":10},svg).textContent=fmt(v);el("line",{x1:60,x2:60+W,y1:y(v),y2:y(v),stroke:"#eee"},svg);}
  const span=(T.t_us[n-1]-T.t_us[0])/1000;
  el("text",{x:60,y:H+30,"font-size":10},svg).textContent="time → ("+span.toFixed(1)+" ms across "+n+" buckets; each bucket shows its highest moment)";
  const leg=document.getElementById("timeline-legend");
  T.series.forEach((s,i)=>{const sp=document.createElement("span");const c=document.createElement("i");c.style.background=COLORS[i%COLORS.length];sp.appendChild(c);sp.appendChild(document.createTextNode(s));leg.appendChild(sp);});
}
function drawIcicle(){
  const svg=document.getElementById("icicle"), root=D.icicle, W=+svg.getAttribute("width"), RH=18;
  let maxDepth=0;
  function walk(nd,x0,w,depth){
    if(w<0.5)return; maxDepth=Math.max(maxDepth,depth);
    const r=el("rect",{x:x0,y:depth*RH,width:Math.max(w-1,0.5),height:RH-1,fill:COLORS[depth%COLORS.length],class:"node"},svg);
    hover(r,nd.n+" — "+fmt(nd.v)+" ("+(100*nd.v/Math.max(root.v,1)).toFixed(1)+"%)");
    if(w>60){const t=el("text",{x:x0+3,y:depth*RH+13,"font-size":11,"pointer-events":"none"},svg);t.textContent=(nd.n.replace(/^[^:]*\//,"")+" "+fmt(nd.v)).slice(0,Math.floor(w/6.5));}
    let cx=x0; for(const c of nd.c){const cw=w*c.v/Math.max(nd.v,1);walk(c,cx,cw,depth+1);cx+=cw;}
  }
  walk(root,0,W,0);
  svg.setAttribute("height",(maxDepth+1)*RH+4);
}
function drawSegments(){
  const svg=document.getElementById("segments"), S=D.segments.segments, W=+svg.getAttribute("width")-170, RH=10;
  const SC=["#4c78a8","#f58518","#bbbbbb","#9467bd"]; let maxT=1; for(const s of S)maxT=Math.max(maxT,s.total);
  S.forEach((s,i)=>{
    const y=i*RH; el("text",{x:0,y:y+8,"font-size":8},svg).textContent=s.addr+" "+fmt(s.total);
    const w=Math.max(W*Math.sqrt(s.total/maxT),2); let x=170;
    for(const [st,b] of s.runs){const rw=w*b/Math.max(s.total,1);const r=el("rect",{x:x,y:y,width:Math.max(rw,0.3),height:RH-2,fill:SC[st],class:"run"},svg);hover(r,["allocated","pending free","inactive","mixed"][st]+" "+fmt(b)+" in segment "+s.addr);x+=rw;}
  });
  svg.setAttribute("height",Math.max(S.length*RH+20,30));
  if(D.segments.hidden)el("text",{x:0,y:S.length*RH+16,"font-size":10},svg).textContent="… and "+D.segments.hidden+" smaller segments";
}
drawTimeline(); drawIcicle(); drawSegments();
document.body.setAttribute("data-rendered","1");
</script></body></html>
"##;
