"""The what-if panel (issue #10) on the real H200 recordings of tests/fixtures/sim-h200: the snapshot page
(`torchmem snapshot X --html`, drawn in a real headless chromium) and `torchmem.on_oom`'s report carry the trace
replayed under the common settings. Its numbers are `torchmem simulate --compare`'s, and equal the measured
truth where truth.json has the real run (the same training under expandable segments / max_split_size_mb:64;
the real allocator's replay of the trace under expandable segments at the cap where the default settings ran
out of memory). Where the trace cannot be simulated the panel says why in one line; explain-oom (a message, no
trace) says that an on_oom snapshot answers it."""

from __future__ import annotations

import gzip
import html
import json
import pickle
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from browser import CHROMIUM, chromium
from torchmem import _native
from torchmem.snapshot import OomHandler

TRUTH_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "sim-h200"
TRUTH = json.loads((TRUTH_DIR / "truth.json").read_text())
TOTAL = TRUTH["device_total_bytes"]
EXP = "expandable_segments:True"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "torchmem", *args], capture_output=True, text=True, timeout=300)


def gunzip(name: str, tmp: Path) -> Path:
    out = tmp / name.removesuffix(".gz")
    out.write_bytes(gzip.decompress((TRUTH_DIR / name).read_bytes()))
    return out


def limit_of(run: dict[str, Any]) -> int:
    # torch: size_t(fraction * total); the OOM observer then gets this allowed maximum.
    return int(run["memory_fraction"] * TOTAL)


def compare_rows(path: Path, *extra: str) -> dict[str, dict[str, Any]]:
    r = cli("simulate", str(path), "--compare", "--json", *extra)
    assert r.returncode == 0, r.stderr
    return {row["settings"]: row for row in json.loads(r.stdout)["compare"][0]["rows"]}


def dom_rows(dom: str) -> dict[str, dict[str, str]]:
    rows = {}
    for attrs in re.findall(r'<tr class="whatif-row"([^>]*)>', dom):
        d = {k: html.unescape(v) for k, v in re.findall(r'data-([a-z-]+)="([^"]*)"', attrs)}
        rows[d["settings"]] = d
    return rows


def page(snapshot: Path, tmp: Path, *extra: str) -> str:
    out = tmp / (snapshot.name + ".html")
    r = cli("snapshot", str(snapshot), "--html", str(out), *extra)
    assert r.returncode == 0, r.stderr
    if CHROMIUM is None:
        pytest.skip("no chromium (apt-get install chromium)")
    d = chromium("--dump-dom", out.as_uri())
    assert d.returncode == 0, d.stderr[-2000:]
    assert 'data-rendered="1"' in d.stdout, "the page's script did not finish"
    return d.stdout


def test_page_panel_equals_compare_and_the_real_runs(tmp_path: Path) -> None:
    w = "resnet50_adamw_foreach_fp32"
    snap = gunzip(f"{w}__recorded.pickle.gz", tmp_path)
    dom = page(snap, tmp_path)
    rows = dom_rows(dom)
    cmp = compare_rows(snap)
    assert set(rows) == set(cmp) and len(rows) == 7
    for name, c in cmp.items():
        res = c["result"]
        got = rows[name]
        assert int(got["peak-reserved"]) == res["peak_reserved_bytes"], name
        assert int(got["peak-allocated"]) == res["peak_allocated_bytes"], name
        assert int(got["retries"]) == res["num_alloc_retries"], name
        assert int(got["min-memory"]) == c["min_memory_bytes"], name
        assert got["oom"] == "false"
    # The measured truth: the recording itself and the same training run under each setting.
    w_truth = TRUTH["workloads"][w]
    assert int(rows["default"]["peak-reserved"]) == w_truth["recorded"]["stats"]["reserved_bytes.all.peak"]
    for setting, key in [(EXP, "expandable"), ("max_split_size_mb:64", "max_split_64")]:
        stats = w_truth["real"][key]["stats"]
        assert int(rows[setting]["peak-reserved"]) == stats["reserved_bytes.all.peak"], setting
        assert int(rows[setting]["peak-allocated"]) == stats["allocated_bytes.all.peak"], setting
    change = int(rows[EXP]["change"])
    assert (
        change
        == w_truth["real"]["expandable"]["stats"]["reserved_bytes.all.peak"]
        - (w_truth["recorded"]["stats"]["reserved_bytes.all.peak"])
    )
    assert change < 0
    headline = re.search(r'<p class="whatif-headline">([^<]*)</p>', dom).group(1)
    assert headline.startswith("with expandable segments this run would have peaked at 5.63 GiB reserved (-970.00 MiB")
    assert "default (recorded)" in dom


# (workload, snapshot): a run that ran out of memory under a memory cap with the default settings; truth.json
# has the real allocator's replay of the same trace under expandable segments at the same cap.
OOM_CASES = [
    ("gpt2_adamw_amp", "real", "cap_retry"),  # the real training run that ran out of memory
    ("gpt2_adamw_fused_bf16", "replay", "cap_retry"),
    ("gpt2_ckpt_adamw_amp", "replay", "cap_retry"),
    ("vit_b16_adamw_amp", "replay", "cap_retry"),
]


@pytest.mark.parametrize("workload,kind,setting", OOM_CASES)
def test_oom_page_says_which_settings_avoid_it_as_the_real_allocator_did(
    tmp_path: Path, workload: str, kind: str, setting: str
) -> None:
    run = TRUTH["workloads"][workload][kind][setting]
    assert run["oom"] is not None
    limit = limit_of(run)
    snap = gunzip(run["snapshot"], tmp_path)
    rows = dom_rows(page(snap, tmp_path, "--memory-limit", str(limit)))
    exp_truth = TRUTH["workloads"][workload]["replay"]["expandable_cap_retry"]
    assert exp_truth["memory_fraction"] == run["memory_fraction"]
    got_past = exp_truth["oom"] is None or exp_truth["oom"]["entry"] > run["oom"]["entry"]
    assert rows[EXP]["avoids"] == str(got_past).lower()
    assert rows["default"]["avoids"] == "false", "the recorded settings fail where the recording failed"
    # Each verdict and minimum memory is the simulator's own: replay under the cap, and search without it.
    cmp = compare_rows(snap, "--memory-limit", str(limit))
    for name, got in rows.items():
        res = cmp[name]["result"]
        avoided = res["recorded_ooms_avoided"] != []  # the recorded failing allocation succeeded
        assert got["avoids"] == str(avoided).lower(), name
        assert int(got["min-memory"]) == cmp[name]["min_memory_bytes"], name
        if got["avoids"] == "false":
            assert int(got["min-memory"]) > limit, name
    assert int(rows["default"]["min-memory"]) > limit


def test_on_oom_report_on_a_real_oom_snapshot(tmp_path: Path) -> None:
    """The report on_oom writes at a CUDA OOM, built from the snapshot it dumped: here the snapshot of a real
    training run that ran out of memory on the H200 under a memory cap (the observer's numbers come from it)."""
    run = TRUTH["workloads"]["gpt2_adamw_amp"]["real"]["cap_retry"]
    snap = gunzip(run["snapshot"], tmp_path)
    raw = pickle.loads(snap.read_bytes())  # our own fixture
    oom = next(e for e in raw["device_traces"][0] if e["action"] == "oom")
    limit = limit_of(run)
    h = OomHandler(tmp_path / "reports", True, None, None)
    out = (tmp_path / "r.txt", tmp_path / "r.json")
    h._write_report(
        snap,
        out,
        device=0,
        alloc=oom["size"],
        allocated=run["stats"]["allocated_bytes.all.current"],
        reserved=run["stats"]["reserved_bytes.all.current"],
        device_total=limit,  # the observer gets the allowed maximum under a memory fraction
        device_free=oom["device_free"],
        where=["train.py:12:step"],
        memory_limit_bytes=limit,
        physical_total_bytes=TOTAL,
    )
    text = out[0].read_text()
    report = json.loads(out[1].read_text())
    wi = report["what_if"]
    assert wi["recorded_oom"] is True and wi["unavailable"] is None
    rows = {r["settings"]: r for r in wi["rows"]}
    # The real allocator got past this allocation under expandable segments at the same cap.
    assert TRUTH["workloads"]["gpt2_adamw_amp"]["replay"]["expandable_cap_retry"]["oom"] is None
    assert rows[EXP]["avoids_recorded_oom"] is True
    assert rows["default"]["avoids_recorded_oom"] is False and rows["default"]["recorded"] is True
    # The same numbers as `torchmem simulate` under that cap, and a minimum memory that really runs it.
    r = cli("simulate", str(snap), "--alloc-conf", EXP, "--memory-limit", str(limit), "--json")
    sim = json.loads(r.stdout)
    assert rows[EXP]["peak_reserved_bytes"] == sim["peak_reserved_bytes"] and sim["oom"] is None
    m = rows["default"]["min_memory_bytes"]
    assert json.loads(cli("simulate", str(snap), "--memory-limit", str(m), "--json").stdout)["oom"] is None
    assert json.loads(cli("simulate", str(snap), "--memory-limit", str(m - (2 << 20)), "--json").stdout)["oom"]
    assert wi["headline"].startswith("with expandable segments this OOM would have been avoided")
    assert "What if (the trace replayed by torchmem's allocator simulator" in text
    assert wi["headline"] in text and "max_split_size_mb:512" in text
    assert f"--memory-limit {limit}" in text, "the page command carries the cap"
    assert report["memory_limit_bytes"] == limit


def test_on_oom_report_of_a_request_larger_than_any_segment(tmp_path: Path) -> None:
    """A request no setting can place (`torch.empty(1 << 50)`, the 1 PiB OOM of the distributed GPU check):
    the report is written, every setting fails, expandable segments "never" fit it (the request is larger than
    a segment's whole address space, 1 1/8 of the device: the simulator panicked there before), and the
    default settings need at least the request. Here: the real OOM snapshot above with its failed request
    made 1 PiB."""
    run = TRUTH["workloads"]["gpt2_adamw_amp"]["real"]["cap_retry"]
    raw = pickle.loads(gunzip(run["snapshot"], tmp_path).read_bytes())  # our own fixture
    oom = next(e for e in raw["device_traces"][0] if e["action"] == "oom")
    oom["size"] = 1 << 50
    snap = tmp_path / "oom_1pib.pickle"
    snap.write_bytes(pickle.dumps(raw))
    h = OomHandler(tmp_path / "reports", True, None, None)
    out = (tmp_path / "r.txt", tmp_path / "r.json")
    h._write_report(
        snap,
        out,
        device=0,
        alloc=1 << 50,
        allocated=run["stats"]["allocated_bytes.all.current"],
        reserved=run["stats"]["reserved_bytes.all.current"],
        device_total=TOTAL,
        device_free=oom["device_free"],
        where=["train.py:12:step"],
        physical_total_bytes=TOTAL,
    )
    wi = json.loads(out[1].read_text())["what_if"]
    assert wi["unavailable"] is None and wi["recorded_oom"] is True, wi
    rows = {r["settings"]: r for r in wi["rows"]}
    assert all(r["avoids_recorded_oom"] is False for r in rows.values()), rows
    assert rows[EXP]["min_memory_bytes"] is None and rows[EXP]["min_memory_searched"] is True
    assert rows["default"]["min_memory_bytes"] >= 1 << 50
    assert "none of these settings avoids it" in wi["headline"], wi["headline"]
    assert "no memory limit runs it" in wi["headline"], wi["headline"]
    text = out[0].read_text()
    assert re.search(r"expandable_segments:True .* no +never", text), text


def test_panel_says_why_when_the_trace_cannot_be_simulated(tmp_path: Path) -> None:
    raw = pickle.loads(gzip.decompress((TRUTH_DIR / "mlp_sgd_fp32__recorded.pickle.gz").read_bytes()))
    no_trace = {**raw, "device_traces": [[] for _ in raw["device_traces"]]}
    p = tmp_path / "history_off.pickle"
    p.write_bytes(pickle.dumps(no_trace, protocol=4))
    dom = page(p, tmp_path)
    line = re.search(r'<p class="whatif-none">([^<]*)</p>', dom).group(1)
    assert line.startswith("no what-if: device 0 has segments but no allocator history") and "on_oom" in line
    assert 'class="whatif-row"' not in dom
    # A CUDA-graph private pool.
    graph = pickle.loads(pickle.dumps(raw))
    graph["segments"][0]["segment_pool_id"] = (1, 3)
    p2 = tmp_path / "graph.pickle"
    p2.write_bytes(pickle.dumps(graph, protocol=4))
    dom2 = page(p2, tmp_path)
    line2 = html.unescape(re.search(r'<p class="whatif-none">([^<]*)</p>', dom2).group(1))
    assert "belongs to private pool (1, 3)" in line2 and "\n" not in line2
    # The same line in on_oom's text (the binding).
    w = _native.whatif(str(p))
    assert w["devices"][0]["unavailable"] in w["text"] and "no what-if:" in w["text"]


@pytest.mark.parametrize("cut", ["after the first map", "a third in", "two thirds in"])
def test_a_trace_that_starts_with_expandable_pages_mapped_replays_exactly(tmp_path: Path, cut: str) -> None:
    """A recording under expandable segments with its first entries cut off (history switched on late: pages
    mapped before the trace). The start is rebuilt from the dump's mapped ranges and the maps after the cut;
    the replay under the recorded settings reproduces every later map and the recording's peak reserved, and
    the what-if panel has its rows (the expandable row's minimum memory holds the start's pages)."""
    name = "resnet50_adamw_foreach_fp32__real__expandable.pickle.gz"
    raw = pickle.loads(gzip.decompress((TRUTH_DIR / name).read_bytes()))
    trace = raw["device_traces"][0]
    k = {
        "after the first map": next(i for i, e in enumerate(trace) if e["action"] == "segment_map") + 2,
        "a third in": len(trace) // 3,
        "two thirds in": 2 * len(trace) // 3,
    }[cut]
    p = tmp_path / "late.pickle"
    p.write_bytes(pickle.dumps({**raw, "device_traces": [trace[k:]]}, protocol=4))
    sim = json.loads(cli("simulate", str(p), "--json").stdout)
    assert sim["matches_recording"] is True and sim["oom"] is None, sim
    full = json.loads(cli("simulate", str(gunzip(name, tmp_path)), "--json").stdout)
    assert sim["peak_reserved_bytes"] == full["peak_reserved_bytes"]
    w = _native.whatif(str(p))
    panel = w["devices"][0]
    assert panel["unavailable"] is None and panel["rows"], panel
    exp = next(r for r in panel["rows"] if r["settings"] == EXP)
    assert exp["min_memory_bytes"] >= sim["start_reserved_bytes"] > 0, (exp, sim.get("start_reserved_bytes"))
    assert "does not start from an empty allocator" in w["text"]


def test_explain_oom_points_to_on_oom_for_the_what_if() -> None:
    msg = (
        "CUDA out of memory. Tried to allocate 786.00 MiB. GPU 0 has a total capacity of 139.80 GiB of which "
        "124.15 GiB is free. Including non-PyTorch memory, this process has 5.75 GiB memory in use. Of the "
        "allocated memory 5.20 GiB is allocated by PyTorch, and 300.00 MiB is reserved by PyTorch but unallocated."
    )
    r = cli("explain-oom", msg)
    assert r.returncode == 0, r.stderr
    last = r.stdout.rstrip().splitlines()[-1]
    assert last.startswith("What if") and "torchmem.on_oom(dir)" in last
    assert r.stdout.count("torchmem.on_oom(dir)") == 1
    # Not for a host-memory (CPU) OOM: the simulator models the CUDA allocator.
    cpu = cli(
        "explain-oom",
        "RuntimeError: [enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: not enough memory: "
        "you tried to allocate 8589934592 bytes.",
    )
    assert cpu.returncode == 0, cpu.stderr
    assert "host memory" in cpu.stdout and "torchmem.on_oom(dir)" not in cpu.stdout


def test_memory_limit_needs_the_page_and_a_size(tmp_path: Path) -> None:
    snap = gunzip("mlp_sgd_fp32__recorded.pickle.gz", tmp_path)
    r = cli("snapshot", str(snap), "--memory-limit", "1GiB")
    assert r.returncode == 2 and "--memory-limit is for the --html page" in r.stderr
    r = cli("snapshot", str(snap), "--html", str(tmp_path / "p.html"), "--memory-limit", "lots")
    assert r.returncode != 0 and "--memory-limit" in r.stderr and not (tmp_path / "p.html").exists()


def test_on_oom_report_from_a_message_says_there_is_no_what_if(tmp_path: Path) -> None:
    h = OomHandler(tmp_path, True, None, None)
    h._report_from_message(
        "CUDA out of memory. Tried to allocate 786.00 MiB. GPU 0 has a total capacity of 139.80 GiB of which "
        "124.15 GiB is free. Including non-PyTorch memory, this process has 5.75 GiB memory in use. Of the "
        "allocated memory 5.20 GiB is allocated by PyTorch, and 300.00 MiB is reserved by PyTorch but unallocated."
    )
    text = h.reports[0].read_text()
    assert "Tried to allocate" in text or "tried to allocate" in text
    assert text.rstrip().splitlines()[-1].startswith("What if: no what-if: the allocator's out-of-memory observer")
