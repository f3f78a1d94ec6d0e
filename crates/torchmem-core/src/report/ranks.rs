//! The report's distributed sections, from `analysis::ranks::RankReport`: the job header, the per-rank
//! table, imbalance, the rank × GPU matrix with foreign contexts, step-aligned peaks and the first rank to
//! fail. Built as `cells::Table`s, so text, Markdown and HTML draw them like every other table; JSON gets
//! the `ranks` list and the job-wide `distributed` object; HTML also one step-aligned chart per rank. The
//! analysis's typed findings (a foreign context's cause, the first failure, the merge's warnings) get their
//! English here (`foreign_cause_text`, `failure_text`, `warning_text`).

use serde_json::{json, Value};

use crate::analysis::ranks::{Failure, ForeignCause, RankReport, RankWarning, StepPeak};
use crate::report::cells::Table;
use crate::units::{escape_html, format_bytes, format_opt_bytes};

fn table(title: &str, empty: &str, headers: &[&str], numeric: &[bool]) -> Table {
    Table {
        title: title.into(),
        headers: headers.iter().map(|h| h.to_string()).collect(),
        numeric: numeric.to_vec(),
        rows: Vec::new(),
        notes: Vec::new(),
        empty: empty.into(),
    }
}

fn opt<T: ToString>(v: Option<T>) -> String {
    v.map(|v| v.to_string()).unwrap_or_else(|| "-".into())
}

fn gpu_label(device: Option<u32>, uuid: Option<&str>) -> String {
    match (device, uuid) {
        (Some(d), Some(u)) => format!("GPU {d} ({})", u.chars().take(12).collect::<String>()),
        (Some(d), None) => format!("GPU {d}"),
        _ => "-".into(),
    }
}

/// Whether the job was restarted (torchrun's `--max-restarts`, a Slurm requeue): then every rank row,
/// step column and chart says its attempt.
fn restarted(r: &RankReport) -> bool {
    r.attempts.len() > 1 || r.ranks.iter().any(|x| x.restart_count.unwrap_or(0) > 0)
}

/// "rank 1" or, in a restarted job, "rank 1 restart 0".
fn rank_label(r: &RankReport, rank: u32, restart_count: Option<u32>) -> String {
    match restart_count.filter(|_| restarted(r)) {
        Some(n) => format!("rank {rank} restart {n}"),
        None => format!("rank {rank}"),
    }
}

/// The job's facts as (key, value) lines.
pub fn header_lines(r: &RankReport) -> Vec<(String, String)> {
    let ranks = if restarted(r) {
        let distinct: std::collections::BTreeSet<u32> = r.ranks.iter().map(|x| x.rank).collect();
        format!(
            "{} of WORLD_SIZE {} in {} attempts ({} rank processes)",
            distinct.len(),
            opt(r.world_size),
            r.attempts.len(),
            r.ranks.len()
        )
    } else {
        format!("{} of WORLD_SIZE {}", r.ranks.len(), opt(r.world_size))
    };
    let mut out = vec![
        ("ranks".to_string(), ranks),
        ("hosts".to_string(), r.hosts.join(", ")),
        ("profiles".to_string(), r.profiles.join(", ")),
    ];
    if restarted(r) {
        // Which attempt each file is.
        for a in &r.attempts {
            let ranks = a.ranks.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", ");
            out.push((
                a.restart_count.map(|n| format!("restart {n}")).unwrap_or_else(|| "attempt ?".into()),
                format!("ranks {ranks}: {}", a.profiles.join(", ")),
            ));
        }
    }
    if let Some(f) = &r.first_failure {
        let attempt = f.restart_count.filter(|_| restarted(r)).map(|n| format!(", restart {n}")).unwrap_or_default();
        out.push((
            "first to fail".into(),
            format!("rank {} (pid {}, {}{attempt}): {}", f.rank, f.pid, f.host, failure_text(&f.what)),
        ));
    }
    out
}

/// Inserts a column before column `at` (its header, whether numeric, one cell per row).
fn insert_column(t: &mut Table, at: usize, header: &str, numeric: bool, cells: Vec<String>) {
    t.headers.insert(at, header.into());
    t.numeric.insert(at, numeric);
    for (row, cell) in t.rows.iter_mut().zip(cells) {
        row.insert(at, cell);
    }
}

/// Every table of the distributed sections, in report order.
pub fn tables(r: &RankReport) -> Vec<Table> {
    let gpu = r.ranks.iter().any(|x| x.device.is_some() || x.peak_allocated_bytes.is_some());
    let mut out = Vec::new();
    let mut t = if gpu {
        table(
            "Ranks",
            "no rank in these profiles",
            &[
                "rank",
                "local",
                "host",
                "pid",
                "GPU",
                "peak allocated",
                "peak reserved",
                "peak NVML",
                "non-torch",
                "foreign",
                "peak RSS",
                "steps",
                "stopped inside",
            ],
            &[true, true, false, true, false, true, true, true, true, true, true, true, false],
        )
    } else {
        table(
            "Ranks",
            "no rank in these profiles",
            &["rank", "local", "host", "pid", "peak RSS", "steps", "stopped inside"],
            &[true, true, false, true, true, true, false],
        )
    };
    for x in &r.ranks {
        let stopped = if x.stopped_inside.is_empty() { "-".to_string() } else { x.stopped_inside.join(", ") };
        t.rows.push(if gpu {
            vec![
                x.rank.to_string(),
                opt(x.local_rank),
                x.host.clone(),
                x.pid.to_string(),
                gpu_label(x.device, x.gpu_uuid.as_deref()),
                format_opt_bytes(x.peak_allocated_bytes),
                format_opt_bytes(x.peak_reserved_bytes),
                format_opt_bytes(x.peak_nvml_bytes),
                format_opt_bytes(x.non_torch_bytes),
                if x.foreign_nvml_bytes > 0 { format_bytes(x.foreign_nvml_bytes) } else { "-".into() },
                format_opt_bytes(x.peak_rss_bytes),
                x.steps.to_string(),
                stopped,
            ]
        } else {
            vec![
                x.rank.to_string(),
                opt(x.local_rank),
                x.host.clone(),
                x.pid.to_string(),
                format_opt_bytes(x.peak_rss_bytes),
                x.steps.to_string(),
                stopped,
            ]
        });
    }
    // The node (GROUP_RANK) and the attempt, after the local rank, when the launch said them.
    if restarted(r) || r.ranks.iter().any(|x| x.restart_count.is_some()) {
        let cells = r.ranks.iter().map(|x| opt(x.restart_count)).collect();
        insert_column(&mut t, 2, "restart", true, cells);
    }
    if r.ranks.iter().any(|x| x.group_rank.is_some()) {
        insert_column(&mut t, 2, "node", true, r.ranks.iter().map(|x| opt(x.group_rank)).collect());
    }
    if restarted(r) {
        t.notes.push("restart: the attempt (torchrun's TORCHELASTIC_RESTART_COUNT): 0 the first time, 1 after one restart; imbalance compares the last attempt's ranks.".into());
    }
    if gpu {
        t.notes.push("non-torch = peak NVML − peak reserved on the rank's own GPU: CUDA context + NCCL + library workspaces (cuBLAS, cuDNN). foreign = NVML memory on GPUs that are not the rank's own.".into());
    } else {
        t.notes.push("GPU: no CUDA device in these profiles, so there are no GPU columns (not zeros).".into());
    }
    t.notes.push("peak RSS: the rank's own process (kernel high-water mark), not the tree's sum.".into());
    out.push(t);

    let mut t = table(
        "Imbalance",
        "fewer than 2 ranks with a value",
        &["memory", "max", "rank", "min", "rank", "median", "max/min", "max − min"],
        &[false, true, true, true, true, true, true, true],
    );
    for i in &r.imbalance {
        t.rows.push(vec![
            i.what.clone(),
            format_bytes(i.max_bytes),
            i.max_rank.to_string(),
            format_bytes(i.min_bytes),
            i.min_rank.to_string(),
            format_bytes(i.median_bytes),
            i.max_over_min.map(|v| format!("{v:.2}×")).unwrap_or_else(|| "-".into()),
            format_bytes(i.max_minus_min_bytes),
        ]);
    }
    out.push(t);

    if gpu || !r.matrix.is_empty() {
        let mut t = table(
            "Rank × GPU (NVML, per process)",
            "no NVML per-process reading in these profiles (no GPU, or recorded before torchmem kept them)",
            &["rank", "pid", "host", "GPU", "peak", "whose", "note"],
            &[true, true, false, false, true, false, false],
        );
        for c in &r.matrix {
            let whose = match (c.rank, c.own) {
                (None, _) => "not a rank".to_string(),
                (Some(_), true) => "own GPU".to_string(),
                (Some(_), false) => "FOREIGN".to_string(),
            };
            t.rows.push(vec![
                opt(c.rank),
                c.pid.to_string(),
                c.host.clone(),
                gpu_label(Some(c.device), c.gpu_uuid.as_deref()),
                format_bytes(c.peak_bytes),
                whose,
                if c.context_only { "no PyTorch memory here: context only".into() } else { String::new() },
            ]);
        }
        for f in &r.foreign_contexts {
            t.notes.push(format!(
                "FOREIGN CONTEXT: rank {} (pid {}, {}) holds {} on GPU {}, its own is {}: {}",
                f.rank,
                f.pid,
                f.host,
                format_bytes(f.bytes),
                f.device,
                opt(f.own_device.map(|d| format!("GPU {d}"))),
                foreign_cause_text(&f.cause)
            ));
        }
        out.push(t);
    }

    let mut t = step_table(r, gpu);
    t.notes.push(if gpu {
        "Peak PyTorch allocated inside each step, by step number (not wall clock: clocks differ across nodes).".into()
    } else {
        "Peak CPU RSS of each rank's process inside each step, by step number (not wall clock).".into()
    });
    out.push(t);

    if let Some(f) = &r.first_failure {
        let mut t = table("First rank to fail", "", &["rank", "pid", "host", "what"], &[true, true, false, false]);
        t.rows.push(vec![f.rank.to_string(), f.pid.to_string(), f.host.clone(), failure_text(&f.what)]);
        if let Some(o) = &f.oom {
            let b = |v: Option<u64>| v.map(format_bytes).unwrap_or_else(|| "-".into());
            t.notes.push(format!(
                "OOM post-mortem: requested {}, allocated {}, reserved {}, device free {} of {}",
                b(o.requested_bytes),
                b(o.allocated_bytes),
                b(o.reserved_bytes),
                b(o.device_free_bytes),
                b(o.device_total_bytes)
            ));
            if let Some(s) = &o.snapshot {
                t.notes.push(format!("its allocator snapshot: {s} (`torchmem snapshot {s} --top 20`)"));
            }
        }
        out.push(t);
    }
    for w in &r.warnings {
        let w = warning_text(w);
        let mut t = table("Warning", &w, &[], &[]);
        t.empty = w.clone();
        out.push(t);
    }
    out
}

/// Steps × ranks: up to 12 step numbers, evenly spread, first and last included.
fn step_table(r: &RankReport, gpu: bool) -> Table {
    let mut headers = vec!["step".to_string()];
    headers.extend(r.ranks.iter().map(|x| rank_label(r, x.rank, x.restart_count)));
    let mut t = Table {
        title: "Steps, aligned by step number".into(),
        numeric: vec![true; headers.len()],
        headers,
        rows: Vec::new(),
        notes: Vec::new(),
        empty: "no steps marked (torchmem.Monitor's step())".into(),
    };
    let mut numbers: Vec<i64> = r.steps.iter().flatten().map(|s| s.step).collect();
    numbers.sort_unstable();
    numbers.dedup();
    let shown: Vec<i64> = if numbers.len() <= 12 {
        numbers
    } else {
        let n = numbers.len();
        let mut v: Vec<i64> = (0..12).map(|i| numbers[i * (n - 1) / 11]).collect();
        v.dedup();
        v
    };
    let value = |s: &StepPeak| if gpu { s.peak_allocated_bytes } else { s.peak_rss_bytes };
    for step in shown {
        let mut row = vec![step.to_string()];
        for steps in &r.steps {
            row.push(format_opt_bytes(steps.iter().filter(|s| s.step == step).filter_map(value).max()));
        }
        t.rows.push(row);
    }
    t
}

/// The sentence of a foreign context's likely cause, with the fix.
pub fn foreign_cause_text(c: &ForeignCause) -> String {
    let during = |after: &Option<crate::analysis::ranks::MarkerAt>| {
        after
            .as_ref()
            .map(|m| format!(" (it appeared after its {} `{}` {})", m.kind.as_str(), m.name, m.edge.as_str()))
            .unwrap_or_default()
    };
    match c {
        ForeignCause::Later { after_s, after } => format!(
            "it appeared {after_s:.1} s after the rank's own context{}: something put memory on that GPU later — most often `torch.load` without `map_location` (use `map_location=f\"cuda:{{local_rank}}\"` or \"cpu\"), or `.cuda()`/`.to(\"cuda\")` meaning cuda:0",
            during(after)
        ),
        ForeignCause::Early { after } => format!(
            "it appeared with or before the rank's own context{}: CUDA was first used before `torch.cuda.set_device(local_rank)` (a `torch.cuda.*` call, a tensor on \"cuda\", or a NCCL `barrier()`/`init_process_group` before `set_device`): call `torch.cuda.set_device(local_rank)` first, or pass `device_id=` to `init_process_group`",
            during(after)
        ),
    }
}

/// What the first rank to fail did: "CUDA out of memory", or "stopped inside step 7, phase backward; the other
/// ranks ran 3.0 s longer".
pub fn failure_text(f: &Failure) -> String {
    match f {
        Failure::Oom => "CUDA out of memory".into(),
        Failure::StoppedInside { spans, others_longer_s } => {
            let longer = others_longer_s.map(|s| format!("; the other ranks ran {s:.1} s longer")).unwrap_or_default();
            format!("stopped inside {}{longer}", spans.join(", "))
        }
    }
}

/// A merge warning's sentence, with what to do.
pub fn warning_text(w: &RankWarning) -> String {
    let list = |v: &[u32]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(", ");
    match w {
        RankWarning::SameRankTwice { rank, first: (p1, pid1, h1), second: (p2, pid2, h2) } => format!(
            "rank {rank} is in {p1} (pid {pid1}, host {h1}) and in {p2} (pid {pid2}, host {h2}): profiles of different jobs, or a restarted rank? Both are shown"
        ),
        RankWarning::WorldSizesDisagree { sizes } => format!(
            "the ranks disagree on WORLD_SIZE ({}): these profiles are of different jobs; report each job's profiles together",
            list(sizes)
        ),
        RankWarning::MissingRanks { world_size, ranks } => format!(
            "WORLD_SIZE is {world_size} but no profile holds rank(s) {}: give every node's profile (`torchmem report a.sqlite b.sqlite` or the directory), or those ranks never reached torchmem",
            list(ranks)
        ),
    }
}

/// The JSON sections: `ranks` (one entry per rank) and `distributed` (the job-wide facts). The typed findings
/// get their sentences here (`cause`, `what`, `warnings`).
pub fn json_sections(r: &RankReport) -> (Value, Value) {
    let foreign_contexts: Vec<Value> = r
        .foreign_contexts
        .iter()
        .map(|f| {
            let mut v = serde_json::to_value(f).unwrap_or(Value::Null);
            v["cause"] = foreign_cause_text(&f.cause).into();
            v
        })
        .collect();
    let first_failure = r.first_failure.as_ref().map(|f| {
        let mut v = serde_json::to_value(f).unwrap_or(Value::Null);
        v["what"] = failure_text(&f.what).into();
        v
    });
    let ranks = serde_json::to_value(&r.ranks).unwrap_or(Value::Null);
    let steps: Vec<Value> = r
        .ranks
        .iter()
        .zip(&r.steps)
        .map(|(x, s)| json!({"rank": x.rank, "restart_count": x.restart_count, "pid": x.pid, "host": x.host, "steps": s}))
        .collect();
    let dist = json!({
        "world_size": r.world_size,
        "hosts": r.hosts,
        "profiles": r.profiles,
        "attempts": r.attempts,
        "missing_ranks": r.missing_ranks,
        "imbalance": r.imbalance,
        "matrix": r.matrix,
        "foreign_contexts": foreign_contexts,
        "steps": steps,
        "first_failure": first_failure,
        "warnings": r.warnings.iter().map(warning_text).collect::<Vec<_>>(),
    });
    (ranks, dist)
}

/// A chart line: label, colour, the value of one step.
type Series = (&'static str, &'static str, fn(&StepPeak) -> Option<u64>);

/// One small chart per rank, every one on the same axes (step number × bytes), so they line up.
pub fn html_charts(r: &RankReport) -> String {
    let gpu = r.ranks.iter().any(|x| x.peak_allocated_bytes.is_some());
    let series: Vec<Series> = if gpu {
        vec![("allocated", "#d62728", |s| s.peak_allocated_bytes), ("reserved", "#ff7f0e", |s| s.peak_reserved_bytes)]
    } else {
        vec![("CPU RSS", "#1f77b4", |s| s.peak_rss_bytes)]
    };
    let all: Vec<&StepPeak> = r.steps.iter().flatten().collect();
    if all.is_empty() {
        return String::new();
    }
    let x_min = all.iter().map(|s| s.step).min().unwrap_or(0);
    let x_max = all.iter().map(|s| s.step).max().unwrap_or(0).max(x_min + 1);
    let y_max = all.iter().flat_map(|s| series.iter().filter_map(move |f| (f.2)(s))).max().unwrap_or(1).max(1);
    let (w, h, left, top) = (560.0f64, 120.0f64, 70.0f64, 10.0f64);
    let mut out = String::from("<h3>Per rank, aligned by step</h3>\n<div class=\"rank-charts\">\n");
    for (x, steps) in r.ranks.iter().zip(&r.steps) {
        out.push_str(&format!(
            "<figure class=\"rank-chart\" data-rank=\"{}\"><figcaption>{} (pid {}, {})</figcaption>\n<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" role=\"img\">\n",
            x.rank,
            rank_label(r, x.rank, x.restart_count),
            x.pid,
            escape_html(&x.host),
            w + left + 10.0,
            h + top + 24.0
        ));
        out.push_str(&format!(
            "<line x1=\"{left}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"#999\"/><text x=\"{}\" y=\"{}\" font-size=\"10\" text-anchor=\"end\">{}</text><text x=\"{}\" y=\"{}\" font-size=\"10\" text-anchor=\"end\">0</text><text x=\"{left}\" y=\"{}\" font-size=\"10\">step {x_min}</text><text x=\"{}\" y=\"{}\" font-size=\"10\" text-anchor=\"end\">step {x_max}</text>\n",
            top + h,
            left + w,
            top + h,
            left - 4.0,
            top + 8.0,
            escape_html(&format_bytes(y_max)),
            left - 4.0,
            top + h,
            top + h + 14.0,
            left + w,
            top + h + 14.0
        ));
        for (label, color, f) in &series {
            let pts: Vec<String> = steps
                .iter()
                .filter_map(|s| {
                    let v = f(s)?;
                    let px = left + (s.step - x_min) as f64 / (x_max - x_min) as f64 * w;
                    let py = top + h - v as f64 / y_max as f64 * h;
                    Some(format!("{px:.1},{py:.1}"))
                })
                .collect();
            if !pts.is_empty() {
                out.push_str(&format!(
                    "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"1.5\" points=\"{}\"><title>{label}</title></polyline>\n",
                    pts.join(" ")
                ));
            }
        }
        out.push_str("</svg></figure>\n");
    }
    out.push_str("</div>\n<p class=\"note\">");
    out.push_str(&escape_html(&format!(
        "Every chart has the same axes (steps {x_min}–{x_max}, 0–{}): {}.",
        format_bytes(y_max),
        series.iter().map(|s| format!("{} ({})", s.0, s.1)).collect::<Vec<_>>().join(", ")
    )));
    out.push_str("</p>\n");
    out
}
