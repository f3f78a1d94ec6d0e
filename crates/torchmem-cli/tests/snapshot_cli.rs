//! End-to-end tests of `torchmem snapshot` and `torchmem explain-oom` with the built binary on the real
//! H200 fixtures, plus malicious and truncated inputs (clear errors, exit code 1).

use std::path::PathBuf;
use std::process::Command;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/snapshots").join(name)
}

fn torchmem(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_torchmem")).args(args).output().expect("run torchmem");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn every_fixture_parses_and_summarizes() {
    for name in [
        "snapshot_gpt2_bs8_amp_cppstacks.pickle",
        "snapshot_mlp_adam_cppstacks.pickle",
        "snapshot_mlp_adam_pystacks.pickle",
        "snapshot_resnet50_bs64_amp_cppstacks.pickle",
        "snapshot_resnet50_bs64_fp32_cppstacks.pickle",
    ] {
        let f = fixture(name);
        let (code, out, err) = torchmem(&["snapshot", f.to_str().unwrap()]);
        assert_eq!(code, 0, "{name}: {err}");
        assert!(out.contains("Device 0") && out.contains("reserved") && out.contains("Trace actions"), "{name}: {out}");
        let (code, out, _) = torchmem(&["snapshot", f.to_str().unwrap(), "--json"]);
        assert_eq!(code, 0);
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert!(v["summary"]["devices"][0]["reserved_bytes"].as_u64().unwrap() > 0);
    }
}

#[test]
fn top_sites_and_at() {
    let f = fixture("snapshot_mlp_adam_pystacks.pickle");
    let (code, out, err) = torchmem(&["snapshot", f.to_str().unwrap(), "--top", "3"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("top allocation sites at the traced peak"), "{out}");
    assert!(out.contains("/home/user/train/probe.py:"), "{out}");
    assert!(out.contains("into the trace)") && !out.contains(" us)"), "times since the trace start: {out}");
    let (code, out, _) = torchmem(&["snapshot", f.to_str().unwrap(), "--top", "3", "--at", "0"]);
    assert_eq!(code, 0);
    assert!(out.contains("at +0.000 ms into the trace"), "{out}");
    let (code, out, _) = torchmem(&["snapshot", f.to_str().unwrap(), "--top", "3", "--at", "2.5ms"]);
    assert_eq!(code, 0);
    assert!(out.contains("at +2.500 ms into the trace"), "{out}");
    // Before the trace start, or past its end: an error naming the range.
    for at in ["-5", "1h", "99999s"] {
        let arg = format!("--at={at}");
        let (code, _, err) = torchmem(&["snapshot", f.to_str().unwrap(), "--top", "3", &arg]);
        assert_eq!(code, 1, "--at {at}: {err}");
        assert!(err.contains("--at"), "{err}");
    }
    let (_, _, err) = torchmem(&["snapshot", f.to_str().unwrap(), "--top", "3", "--at=-5"]);
    assert!(
        err.contains(
            "before the trace start: the trace spans 0 to 7238.106 ms (time_us 1796056079995649 to 1796056087233755)"
        ),
        "{err}"
    );
    let (code, _, err) = torchmem(&["snapshot", f.to_str().unwrap(), "--at", "5"]);
    assert_ne!(code, 0);
    assert!(err.contains("--at needs --top"), "{err}");
}

#[test]
fn empty_and_null_json_are_not_snapshots() {
    let dir = tempfile::tempdir().unwrap();
    for (name, text) in [("e.json", "{}"), ("n.json", "null")] {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        let (code, _, err) = torchmem(&["snapshot", p.to_str().unwrap()]);
        assert_eq!(code, 1, "{name}");
        assert!(err.contains("not an allocator snapshot"), "{name}: {err}");
    }
}

#[test]
fn diff_reports_growth_by_site() {
    let a = fixture("snapshot_mlp_adam_pystacks.pickle");
    let b = fixture("snapshot_mlp_adam_cppstacks.pickle");
    let (code, out, err) = torchmem(&["snapshot", "diff", a.to_str().unwrap(), b.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("Snapshot diff") && out.contains("reserved") && out.contains("site"), "{out}");
}

#[test]
fn malicious_and_truncated_pickles_fail_clearly() {
    let dir = tempfile::tempdir().unwrap();
    // GLOBAL 'os\nsystem', then REDUCE: what pickle.dumps(os.system) + call looks like.
    let evil = dir.path().join("evil.pickle");
    std::fs::write(&evil, b"\x80\x02cos\nsystem\nq\x00X\x04\x00\x00\x00trueq\x01\x85q\x02Rq\x03.").unwrap();
    let (code, _, err) = torchmem(&["snapshot", evil.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("refusing opcode GLOBAL (0x63) at byte offset 2"), "{err}");
    let data = std::fs::read(fixture("snapshot_mlp_adam_pystacks.pickle")).unwrap();
    let cut = dir.path().join("cut.pickle");
    std::fs::write(&cut, &data[..1000]).unwrap();
    let (code, _, err) = torchmem(&["snapshot", cut.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("truncated"), "{err}");
    let proto6 = dir.path().join("p6.pickle");
    std::fs::write(&proto6, b"\x80\x06N.").unwrap();
    let (code, _, err) = torchmem(&["snapshot", proto6.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("protocol 6"), "{err}");
}

#[test]
fn explain_oom_message() {
    let msg = std::fs::read_to_string(fixture("oom_message_2.11.txt")).unwrap();
    let (code, out, err) = torchmem(&["explain-oom", msg.trim()]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("tried to allocate") && out.contains("60.00 GiB") && out.contains("Diagnosis: capacity"),
        "{out}"
    );
    let (code, _, err) = torchmem(&["explain-oom", "not an oom"]);
    assert_eq!(code, 1);
    assert!(err.contains("out-of-memory message"), "{err}");
}

/// gzips `src` into `dst` with the system's gzip (a real gzip file, as `gzip snapshot.pickle` makes).
fn gzip_to(src: &std::path::Path, dst: &std::path::Path) {
    let out = Command::new("gzip").args(["-c", "-6"]).arg(src).output().expect("run gzip");
    assert!(out.status.success());
    std::fs::write(dst, out.stdout).unwrap();
}

#[test]
fn gzipped_snapshots_read_by_magic_bytes_in_every_subcommand() {
    let dir = tempfile::tempdir().unwrap();
    let a = fixture("snapshot_mlp_adam_pystacks.pickle");
    let b = fixture("snapshot_mlp_adam_cppstacks.pickle");
    let (az, bz) = (dir.path().join("a.pickle.gz"), dir.path().join("b-no-suffix"));
    gzip_to(&a, &az);
    gzip_to(&b, &bz);
    let (a, b, az, bz) = (a.to_str().unwrap(), b.to_str().unwrap(), az.to_str().unwrap(), bz.to_str().unwrap());
    // Each subcommand gives the same answer on the gzipped file as on the plain one (names aside).
    for args in [vec![], vec!["--top", "3"], vec!["--top", "3", "--at", "2.5ms"], vec!["--json"]] {
        let (code, plain, err) = torchmem(&[&["snapshot", a], args.as_slice()].concat());
        assert_eq!(code, 0, "{args:?}: {err}");
        let (code, gz, err) = torchmem(&[&["snapshot", az], args.as_slice()].concat());
        assert_eq!(code, 0, "{args:?}: {err}");
        assert_eq!(gz.replace(az, a), plain, "{args:?}");
    }
    let (code, plain, _) = torchmem(&["snapshot", "diff", a, b]);
    assert_eq!(code, 0);
    let (code, gz, err) = torchmem(&["snapshot", "diff", az, bz]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(gz.replace(az, a).replace(bz, b), plain);
    let page = dir.path().join("page.html");
    let (code, _, err) = torchmem(&["snapshot", bz, "--html", page.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(std::fs::read_to_string(&page).unwrap().contains("<title>torchmem"));
    // A gzip file cut short is one clear error.
    let whole = std::fs::read(az).unwrap();
    let cut = dir.path().join("cut.pickle.gz");
    std::fs::write(&cut, &whole[..whole.len() / 2]).unwrap();
    let (code, _, err) = torchmem(&["snapshot", cut.to_str().unwrap()]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("gzip data is damaged") && err.lines().count() == 1, "{err}");
}

#[test]
fn simulate_sizes_need_a_unit_and_its_times_count_from_the_trace_start() {
    let f = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/sim-h200/mlp_sgd_fp32__recorded.pickle.gz");
    let f = f.to_str().unwrap();
    let (code, out, err) = torchmem(&["simulate", f, "--memory-limit", "12"]);
    assert_eq!(code, 1, "{out}");
    assert!(err.contains("--memory-limit") && err.contains("12GiB") && err.lines().count() == 1, "{err}");
    // A limit far below the trace's need: the OOM's time is counted from the trace start, as `snapshot` does.
    let (code, out, err) = torchmem(&["simulate", f, "--memory-limit", "4MiB"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("OUT OF MEMORY at entry"), "{out}");
    assert!(out.contains(" ms into the trace)") && !out.contains(" us)"), "{out}");
}
