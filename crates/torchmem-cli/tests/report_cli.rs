//! `torchmem report` and `torchmem plot` run as the real binary on profiles written with the real store
//! (`ProfileWriter`): every format's content, the HTML page's self-containment, a killed run's profile, and
//! the errors for missing, foreign, truncated and corrupt files.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use torchmem_core::model::*;
use torchmem_core::store::{ProfileWriter, Record};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn torchmem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_torchmem")).args(args).output().expect("run torchmem")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn marker(
    t_ns: u64,
    kind: MarkerKind,
    edge: Edge,
    name: &str,
    index: Option<i64>,
    alloc: Option<u64>,
    rss: u64,
) -> Record {
    Record::Marker(Marker {
        index,
        memory: MarkerMemory {
            allocated_bytes: alloc,
            reserved_bytes: alloc.map(|a| a + 64 * MIB),
            rss_bytes: Some(rss),
            ..Default::default()
        },
        ..Marker::new(t_ns, kind, edge, name)
    })
}

/// A 3-epoch training run sampled at 100 Hz for `seconds`: CPU RSS ramps to 1.5 GiB; with `gpu`, PyTorch
/// allocated peaks at 2 GiB and NVML sees the process; each epoch runs forward/backward phases.
fn write_profile(path: &Path, gpu: bool, finish: bool) {
    let seconds = 3u64;
    let meta = RunMeta {
        command: vec!["python".into(), "train.py".into()],
        interval_ms: 10.0,
        hostname: "testhost".into(),
        torchmem_version: "test".into(),
        gpu_names: if gpu { vec!["Test GPU".into()] } else { vec![] },
        gpu_total_bytes: if gpu { vec![80 * GIB] } else { vec![] },
        host_total_bytes: Some(64 * GIB),
        ..Default::default()
    };
    let mut w = ProfileWriter::create(path, &meta).unwrap();
    let n = seconds * 100;
    for i in 0..n {
        let t = i * 10_000_000;
        let rss = 512 * MIB + (GIB * i) / n;
        w.push(Record::Cpu(CpuSample {
            t_ns: t,
            rss_bytes: rss,
            pss_bytes: (i % 10 == 0).then_some(rss - MIB),
            uss_bytes: (i % 10 == 0).then_some(rss - 2 * MIB),
            process_count: 1,
        }));
        if gpu {
            let alloc = if i == 150 { 2 * GIB } else { GIB + (i % 20) * MIB };
            w.push(Record::Torch(TorchSample {
                t_ns: t + 1,
                device: 0,
                allocated_bytes: alloc,
                reserved_bytes: 3 * GIB,
                peak_allocated_bytes: alloc,
                peak_reserved_bytes: 3 * GIB,
                active_bytes: alloc,
                inactive_split_bytes: 0,
                origin: Default::default(),
            }));
            if i % 10 == 0 {
                w.push(Record::Gpu(GpuSample {
                    t_ns: t + 2,
                    device: 0,
                    used_bytes: 4 * GIB,
                    total_bytes: 80 * GIB,
                    process_bytes: Some(3 * GIB + 500 * MIB),
                }));
            }
        }
    }
    w.push(Record::ProcessSeen(ProcessInfo {
        pid: 4242,
        ppid: 1,
        cmdline: "python train.py".into(),
        first_t_ns: 0,
        last_t_ns: (n - 1) * 10_000_000,
    }));
    w.push(Record::Process(ProcessSample {
        t_ns: 0,
        pid: 4242,
        rss_bytes: 1400 * MIB,
        pss_bytes: Some(1300 * MIB),
        uss_bytes: Some(1200 * MIB),
        gpu_bytes: gpu.then_some(3 * GIB),
    }));
    for e in 0..3u64 {
        let t0 = e * 1_000_000_000;
        let alloc = |x: u64| gpu.then_some(GIB + x * MIB);
        w.push(marker(t0, MarkerKind::Epoch, Edge::Start, "epoch", Some(e as i64), alloc(0), 600 * MIB));
        w.push(marker(t0 + 100_000_000, MarkerKind::Phase, Edge::Start, "forward", None, alloc(0), 600 * MIB));
        w.push(marker(t0 + 400_000_000, MarkerKind::Phase, Edge::End, "forward", None, alloc(300), 700 * MIB));
        w.push(marker(t0 + 400_000_000, MarkerKind::Phase, Edge::Start, "backward", None, alloc(300), 700 * MIB));
        w.push(marker(t0 + 800_000_000, MarkerKind::Phase, Edge::End, "backward", None, alloc(0), 650 * MIB));
        w.push(marker(t0 + 900_000_000, MarkerKind::Epoch, Edge::End, "epoch", Some(e as i64), alloc(0), 650 * MIB));
    }
    w.flush().unwrap();
    if finish {
        w.finish(Some(0), n * 10_000_000).unwrap();
    } else {
        w.abandon(); // as if the recorder was SIGKILLed: no finish, the WAL not checkpointed
    }
}

fn profile(dir: &Path, name: &str, gpu: bool) -> PathBuf {
    let p = dir.join(name);
    write_profile(&p, gpu, true);
    p
}

#[test]
fn table_report_shows_peaks_phases_epochs_processes_in_readable_units() {
    let dir = tempfile::tempdir().unwrap();
    let p = profile(dir.path(), "gpu.sqlite", true);
    let o = torchmem(&["report", p.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let text = stdout(&o);
    for needle in
        ["Peaks", "Phases", "Epochs", "Processes", "Memory journey", "python train.py", "exit code 0", "Test GPU"]
    {
        assert!(text.contains(needle), "missing {needle:?} in:\n{text}");
    }
    // peaks: the one-sample 2 GiB spike of allocated, reserved 3 GiB, NVML 3.49 GiB, RSS ~1.5 GiB
    let peaks: Vec<&str> = text.lines().skip_while(|l| *l != "Peaks").take(12).collect();
    let row = |what: &str| {
        peaks.iter().find(|l| l.contains(what)).copied().unwrap_or_else(|| panic!("no {what} row in {peaks:#?}"))
    };
    assert!(row("allocated (PyTorch)").contains("2.00 GiB"), "{peaks:#?}");
    assert!(row("reserved (PyTorch)").contains("3.00 GiB"), "{peaks:#?}");
    assert!(row("NVML, profiled processes").contains("3.49 GiB"), "{peaks:#?}");
    assert!(row("CPU RSS").contains("1.50 GiB"), "{peaks:#?}");
    assert!(!text.contains("no CUDA device"), "{text}");
    // the phase table has one row per phase name with its count
    let forward = text.lines().find(|l| l.trim_start().starts_with("forward")).unwrap();
    assert!(forward.contains("     3 ") || forward.split_whitespace().nth(1) == Some("3"), "{forward}");
    assert!(forward.contains("+300.0 MiB"), "mean Δ allocated of forward: {forward}");
}

#[test]
fn cpu_only_profile_says_there_is_no_cuda_device() {
    let dir = tempfile::tempdir().unwrap();
    let p = profile(dir.path(), "cpu.sqlite", false);
    let text = stdout(&torchmem(&["report", p.to_str().unwrap()]));
    assert!(text.contains("no CUDA device"), "{text}");
    assert!(!text.contains("allocated"), "no GPU columns on a CPU-only run:\n{text}");
    let json: serde_json::Value =
        serde_json::from_slice(&torchmem(&["report", p.to_str().unwrap(), "--format", "json"]).stdout).unwrap();
    assert_eq!(json["cuda"], false);
    assert_eq!(json["peak"]["gpus"].as_array().unwrap().len(), 0);
    assert!(json["epochs"][0]["allocated_bytes"].is_null(), "null, not 0: {}", json["epochs"][0]);
}

#[test]
fn json_report_has_the_documented_keys_with_exact_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let p = profile(dir.path(), "gpu.sqlite", true);
    let o = torchmem(&["report", p.to_str().unwrap(), "--format", "json"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("valid JSON");
    assert_eq!(v["format"], "torchmem-report");
    assert_eq!(v["samples"], 300);
    assert_eq!(v["torch_samples"], 300);
    assert_eq!(v["gpu_samples"], 30);
    assert_eq!(v["peak"]["cpu_rss_bytes"], 512 * MIB + (GIB * 299) / 300);
    let g = &v["peak"]["gpus"][0];
    assert_eq!(g["allocated_bytes"], 2 * GIB);
    assert_eq!(g["reserved_bytes"], 3 * GIB);
    assert_eq!(g["nvml_process_bytes"], 3 * GIB + 500 * MIB);
    assert_eq!(g["nvml_used_bytes"], 4 * GIB);
    assert_eq!(g["total_bytes"], 80 * GIB);
    assert_eq!(v["epochs"].as_array().unwrap().len(), 3);
    assert_eq!(v["epochs"][2]["index"], 2);
    let phases: Vec<&str> = v["phases"].as_array().unwrap().iter().map(|p| p["name"].as_str().unwrap()).collect();
    assert_eq!(phases, ["forward", "backward"]);
    assert_eq!(v["phases"][0]["count"], 3);
    assert_eq!(v["processes"][0]["pid"], 4242);
    assert_eq!(v["meta"]["command"], serde_json::json!(["python", "train.py"]));
    assert_eq!(v["meta"]["exit_code"], 0);
    assert_eq!(v["meta"]["duration_ns"], 3_000_000_000u64);
    assert_eq!(v["meta"]["interval_ms"], 10.0);
    assert!(v["journey"].as_array().unwrap().iter().any(|s| s["name"] == "Peak"));
    assert!(v.get("growth").is_some() && v.get("lines").is_some());
}

#[test]
fn csv_has_one_row_per_cpu_sample_with_gpu_values() {
    let dir = tempfile::tempdir().unwrap();
    let p = profile(dir.path(), "gpu.sqlite", true);
    let text = stdout(&torchmem(&["report", p.to_str().unwrap(), "--format", "csv"]));
    let rows: Vec<&str> = text.lines().collect();
    assert_eq!(rows[0], "t_s,cpu_rss_bytes,cpu_pss_bytes,cpu_uss_bytes,processes,gpu0_allocated_bytes,gpu0_reserved_bytes,gpu0_nvml_process_bytes,gpu0_nvml_used_bytes");
    assert_eq!(rows.len(), 301);
    // the allocator's sample at 1.500000001 s lands on the CPU row of 1.51 s (carried forward)
    let at_151: Vec<&str> = rows.iter().find(|r| r.starts_with("1.510000,")).unwrap().split(',').collect();
    assert_eq!(at_151[5], (2 * GIB).to_string());
    assert_eq!(at_151[6], (3 * GIB).to_string());
    assert_eq!(at_151[8], (4 * GIB).to_string());
    assert!(rows[1..].iter().all(|r| r.split(',').count() == 9));
}

#[test]
fn markdown_and_mermaid() {
    let dir = tempfile::tempdir().unwrap();
    let p = profile(dir.path(), "gpu.sqlite", true);
    let md = stdout(&torchmem(&["report", p.to_str().unwrap(), "--format", "markdown"]));
    assert!(md.starts_with("## torchmem report"), "{md}");
    assert!(md.contains("| phase | count |") && md.contains("| forward | 3 |"), "{md}");
    assert!(md.contains("```mermaid\njourney\n"), "{md}");
    let mm = stdout(&torchmem(&["report", p.to_str().unwrap(), "--format", "mermaid"]));
    assert!(mm.starts_with("journey\n    title Memory journey of train.py\n"), "{mm}");
    assert!(mm.lines().any(|l| l.trim_start().starts_with("Peak (")), "{mm}");
}

#[test]
fn killed_run_profile_still_reports() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("killed.sqlite");
    write_profile(&p, false, false);
    let o = torchmem(&["report", p.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.contains("unfinished"), "{text}");
    assert!(text.contains("300 CPU"), "{text}");
    let o = torchmem(&["plot", p.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
}

#[test]
fn plot_writes_one_offline_html_page_and_an_svg() {
    let dir = tempfile::tempdir().unwrap();
    let p = profile(dir.path(), "run.sqlite", true);
    let o = torchmem(&["plot", p.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let html_path = dir.path().join("run.html");
    assert!(stderr(&o).contains("run.html"), "{}", stderr(&o));
    let html = std::fs::read_to_string(&html_path).unwrap();
    for needle in ["http://", "https://", "src=", "<link", "@import", "url("] {
        assert!(!html.contains(needle), "{needle:?} in the page: it must work offline");
    }
    for needle in [
        "<svg",
        "tm-readout",
        "GPU allocated",
        "GPU reserved",
        "GPU NVML (profiled processes)",
        "CPU RSS",
        "epoch 1",
        "<h3>Phases</h3>",
        "<h3>Epochs</h3>",
    ] {
        assert!(html.contains(needle), "missing {needle:?}");
    }
    let svg_out = dir.path().join("chart.svg");
    let o = torchmem(&["plot", p.to_str().unwrap(), "--svg", "-o", svg_out.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let svg = std::fs::read_to_string(&svg_out).unwrap();
    assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""), "{}", &svg[..80]);
    assert!(!svg.contains("<script"));
    assert_eq!(svg.matches("<path d=").count(), 4, "CPU RSS, allocated, reserved, NVML");
}

#[test]
fn plot_never_replaces_a_file_it_did_not_write_without_force() {
    let dir = tempfile::tempdir().unwrap();
    let p = profile(dir.path(), "mine.sqlite", true);
    let ps = p.to_str().unwrap();
    // Notes, a script, a hand-written page at the default output, a foreign SVG: each refused, unchanged.
    let notes = dir.path().join("notes.txt");
    let script = dir.path().join("backup.py");
    let page = dir.path().join("mine.html");
    let svg = dir.path().join("keep.svg");
    std::fs::write(&notes, "my precious notes\n").unwrap();
    std::fs::write(&script, "print('hi')\n").unwrap();
    std::fs::write(&page, "<!DOCTYPE html>\n<html><head><title>my page</title></head></html>\n").unwrap();
    std::fs::write(&svg, "<svg xmlns=\"http://www.w3.org/2000/svg\"><circle r=\"1\"/></svg>\n").unwrap();
    for (args, file) in [
        (vec!["plot", ps, "-o", notes.to_str().unwrap()], &notes),
        (vec!["plot", ps, "-o", script.to_str().unwrap()], &script),
        (vec!["plot", ps], &page),
        (vec!["plot", ps, "--svg", "-o", svg.to_str().unwrap()], &svg),
    ] {
        let before = std::fs::read(file).unwrap();
        let o = torchmem(&args);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {}", stderr(&o));
        let err = stderr(&o);
        assert!(err.contains("written by torchmem") && err.contains("--force"), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert_eq!(std::fs::read(file).unwrap(), before, "{args:?} changed {}", file.display());
    }
    // The profile itself is never the output, even with --force.
    let o = torchmem(&["plot", ps, "-o", ps, "--force"]);
    assert!(stderr(&o).contains("would overwrite the file it reads"), "{}", stderr(&o));
    // With --force the page is replaced; a page or chart torchmem wrote is replaced without it.
    let o = torchmem(&["plot", ps, "--force"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(std::fs::read_to_string(&page).unwrap().contains("<title>torchmem"));
    let o = torchmem(&["plot", ps]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let chart = dir.path().join("mine.svg");
    for _ in 0..2 {
        let o = torchmem(&["plot", ps, "--svg"]);
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    }
    assert!(std::fs::read_to_string(&chart).unwrap().contains("tm-chart"));
    // An empty file (mktemp) holds nothing to lose.
    let empty = dir.path().join("empty.html");
    std::fs::write(&empty, "").unwrap();
    let o = torchmem(&["plot", ps, "-o", empty.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
}

#[test]
fn report_of_a_directory_of_separate_runs_lists_each_and_skips_stray_files() {
    let dir = tempfile::tempdir().unwrap();
    let prof = dir.path().join("prof");
    std::fs::create_dir(&prof).unwrap();
    profile(&prof, "a.sqlite", true);
    profile(&prof, "b.sqlite", false);
    std::fs::write(prof.join("notes.sqlite"), "not a database\n").unwrap();
    let d = prof.to_str().unwrap();
    let o = torchmem(&["report", d]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let (out, err) = (stdout(&o), stderr(&o));
    assert!(out.contains("2 profiles (no rank: separate runs)"), "{out}");
    assert!(out.contains("a.sqlite") && out.contains("b.sqlite") && !out.contains("notes.sqlite"), "{out}");
    assert!(out.contains("peak CPU RSS") && out.contains("peak GPU reserved"), "{out}");
    assert!(out.contains("no GPU"), "b.sqlite is a CPU-only run: {out}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("torchmem: warning: skipping ") && err.contains("notes.sqlite"), "{err}");
    // JSON: every profile's whole report, in order.
    let o = torchmem(&["report", d, "--format", "json"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let reports = v["reports"].as_array().unwrap();
    assert_eq!(reports.len(), 2);
    assert!(reports[0]["file"].as_str().unwrap().ends_with("a.sqlite") && reports[0]["peak"].is_object());
    // A directory with nothing but stray files is an error; a stray file named on its own too.
    let junk = dir.path().join("junk");
    std::fs::create_dir(&junk).unwrap();
    std::fs::write(junk.join("x.sqlite"), "nope").unwrap();
    assert_fails(&["report", junk.to_str().unwrap()], &["no torchmem profile", "x.sqlite"]);
    assert_fails(&["report", junk.join("x.sqlite").to_str().unwrap()], &["x.sqlite"]);
}

fn assert_fails(args: &[&str], needles: &[&str]) {
    let o = torchmem(args);
    assert_ne!(o.status.code(), Some(0), "{args:?} should fail");
    let err = stderr(&o);
    for n in needles {
        assert!(err.contains(n), "{args:?}: {n:?} not in stderr: {err}");
    }
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn bad_inputs_give_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let d = |n: &str| dir.path().join(n).to_str().unwrap().to_string();
    // missing file
    for cmd in ["report", "plot"] {
        assert_fails(&[cmd, &d("nope.sqlite")], &["no such profile", "torchmem run -o PROFILE"]);
    }
    // not SQLite at all
    std::fs::write(d("junk.sqlite"), "this is a CSV file, not a profile\n".repeat(200)).unwrap();
    assert_fails(&["report", &d("junk.sqlite")], &["is not a torchmem profile"]);
    // empty file
    std::fs::write(d("empty.sqlite"), "").unwrap();
    assert_fails(&["report", &d("empty.sqlite")], &["is not a torchmem profile"]);
    // a directory is read as its profiles: the files that are not one are skipped, each named, and with no
    // profile left it is an error
    assert_fails(
        &["report", dir.path().to_str().unwrap()],
        &["skipping", "empty.sqlite", "junk.sqlite", "not a torchmem profile (", "no torchmem profile (*.sqlite)"],
    );
    let no_profiles = tempfile::tempdir().unwrap();
    assert_fails(
        &["report", no_profiles.path().to_str().unwrap()],
        &["no torchmem profile (*.sqlite) in this directory"],
    );
    // a bad format name: clap lists the valid ones
    let p = profile(dir.path(), "good.sqlite", false);
    assert_fails(&["report", p.to_str().unwrap(), "--format", "xml"], &["table", "json", "csv", "markdown", "mermaid"]);
    // plot into a directory that does not exist
    assert_fails(&["plot", p.to_str().unwrap(), "-o", &d("no/such/dir/x.html")], &["cannot write", "-o"]);
    // plot over the profile itself
    assert_fails(&["plot", p.to_str().unwrap(), "-o", p.to_str().unwrap()], &["would overwrite the file it reads"]);
    assert!(torchmem(&["report", p.to_str().unwrap()]).status.success(), "the profile is intact");
}

#[test]
fn truncated_and_corrupted_profiles_give_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let good = profile(dir.path(), "good.sqlite", true);
    let bytes = std::fs::read(&good).unwrap();
    assert!(bytes.len() > 64 * 1024, "the profile spans many pages: {}", bytes.len());
    for (name, data) in [
        ("half.sqlite", bytes[..bytes.len() / 2].to_vec()),
        ("header_only.sqlite", bytes[..100].to_vec()),
        ("zeroed_middle.sqlite", {
            let mut b = bytes.clone();
            let mid = b.len() / 2;
            b[4096..mid].fill(0);
            b
        }),
    ] {
        let p = dir.path().join(name);
        std::fs::write(&p, &data).unwrap();
        for cmd in ["report", "plot"] {
            let o = torchmem(&[cmd, p.to_str().unwrap()]);
            let err = stderr(&o);
            assert_ne!(o.status.code(), Some(0), "{name}: {cmd} must fail, got: {}", stdout(&o));
            assert!(
                err.contains("is not a torchmem profile") && (err.contains("damaged") || err.contains("malformed")),
                "{name}: {err}"
            );
            assert!(!err.contains("panicked"), "{err}");
        }
    }
}

#[test]
fn line_profiles_in_the_profile_reach_every_report() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("lines.sqlite");
    let mut w =
        ProfileWriter::create(&p, &RunMeta { command: vec!["python".into(), "x.py".into()], ..Default::default() })
            .unwrap();
    w.push(Record::Cpu(CpuSample {
        t_ns: 0,
        rss_bytes: 100 * MIB,
        pss_bytes: None,
        uss_bytes: None,
        process_count: 1,
    }));
    let mib = MIB as i64;
    w.push(Record::LineProfile {
        t_ns: 1,
        origin: Default::default(),
        profile: serde_json::from_value(serde_json::json!({
            "schema": "torchmem.lines/1", "hook": "settrace", "gate_ns": 400.0, "gpu_device": null, "warnings": [],
            "functions": [{
                "name": "load_batch", "filename": "/tmp/x.py", "first_line": 3, "calls": 2, "threads": 1,
                "lines": [
                    {"line": 3, "source": "def load_batch():", "hits": 0},
                    {"line": 4, "source": "    a = bytearray(64 << 20)  # <b>", "hits": 2,
                     "cpu_rss_bytes": 200 * mib, "cpu_delta_bytes": 128 * mib, "cpu_delta_max_bytes": 64 * mib}
                ]
            }]
        }))
        .unwrap(),
    });
    w.flush().unwrap();
    w.finish(Some(0), 1_000_000).unwrap();
    let text = stdout(&torchmem(&["report", p.to_str().unwrap()]));
    assert!(text.contains("load_batch") && text.contains("+128.0 MiB"), "{text}");
    let v: serde_json::Value =
        serde_json::from_slice(&torchmem(&["report", p.to_str().unwrap(), "--format", "json"]).stdout).unwrap();
    assert_eq!(v["lines"]["functions"][0]["name"], "load_batch");
    assert_eq!(v["lines"]["functions"][0]["lines"][1]["cpu_delta_bytes"], 128 * MIB);
    let md = stdout(&torchmem(&["report", p.to_str().unwrap(), "--format", "markdown"]));
    assert!(md.contains("### Line profile") && md.contains("load_batch"), "{md}");
    let html_path = dir.path().join("lines.html");
    assert!(torchmem(&["plot", p.to_str().unwrap(), "-o", html_path.to_str().unwrap()]).status.success());
    let html = std::fs::read_to_string(&html_path).unwrap();
    assert!(html.contains("<h2>Line profile</h2>") && html.contains("load_batch"));
    assert!(html.contains("# &lt;b&gt;") && !html.contains("# <b>"), "source is escaped");
}

#[test]
fn a_profile_without_samples_reports_and_plots() {
    // e.g. the program could not start: the recorder wrote the metadata and nothing else
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("empty.sqlite");
    let w =
        ProfileWriter::create(&p, &RunMeta { command: vec!["missing-program".into()], ..Default::default() }).unwrap();
    w.finish(Some(127), 1_000).unwrap();
    let o = torchmem(&["report", p.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(
        text.contains("exit code 127") && text.contains("no CPU samples") && text.contains("none recorded"),
        "{text}"
    );
    assert_eq!(
        stdout(&torchmem(&["report", p.to_str().unwrap(), "--format", "csv"])),
        "t_s,cpu_rss_bytes,cpu_pss_bytes,cpu_uss_bytes,processes\n"
    );
    let v: serde_json::Value =
        serde_json::from_slice(&torchmem(&["report", p.to_str().unwrap(), "--format", "json"]).stdout).unwrap();
    assert_eq!(v["samples"], 0);
    assert!(v["peak"]["cpu_rss_bytes"].is_null());
    let html_path = dir.path().join("empty.html");
    assert!(torchmem(&["plot", p.to_str().unwrap(), "-o", html_path.to_str().unwrap()]).status.success());
    assert!(std::fs::read_to_string(&html_path).unwrap().contains("no memory samples in this profile"));
}
