"""The line profiler on a GPU and on the device's Python 3.12 (was scripts/gpu_check_line.py).

Each scenario runs in a fresh child process (once, in a module-scoped fixture); each check is a test:
  - a line creating a 256 MiB CUDA tensor shows GPU alloc Δ of exactly 256 MiB (= torch.cuda's own delta);
  - a line with a temporary shows the GPU peak torch.cuda reports for the same line;
  - CUDA initialised inside a profiled function;
  - HF GPT-2 (built from GPT2Config, no network) with gradient checkpointing trains under the profiler;
  - `torchmem run --line` of a GPU script records an allocator timeline whose peak equals torch's (and plain
    `torchmem run` of the same script, side by side), also when the GPU work is short and ends with
    `empty_cache()` (the case that recorded no timeline at all);
  - the CPU tests themselves (`test_line_profiler.py`: 64 MiB line, alloc/free loop, sum rule, threads,
    recursion, generators, exceptions, both gates; `test_line_bootstrap.py`: FILE:FUNCTION specs, an
    unmodified memory_profiler script, `torchmem run --line`), by pytest on this interpreter: on Python >= 3.12
    that is the sys.monitoring path (needs the `torchmem` command on PATH); every one of their tests must pass;
  - bench/line_overhead (with the GPU resnet18 step): `-k "not bench"` skips it (the script's --no-bench).
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

MIB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]

HEADER = """
import json, os, sys, threading
import torch
import torchmem
from torchmem.line_profiler import profile_data
MIB = 1 << 20
RESULT = {}
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
def fn(name):
    for f in profile_data()["functions"]:
        if f["name"] == name:
            return f
    raise SystemExit(f"{name} not profiled")
def row(f, needle):
    (r,) = [r for r in f["lines"] if needle in r["source"]]
    return r
"""
FOOTER = """
RESULT["_data"] = profile_data()
with open(sys.argv[1], "w") as f:
    json.dump(RESULT, f)
"""


def child(body: str, env: dict | None = None, timeout: int = 600) -> dict:
    with tempfile.TemporaryDirectory() as d:
        script = os.path.join(d, "prog.py")
        out = os.path.join(d, "out.json")
        with open(script, "w") as f:
            f.write(HEADER + textwrap.dedent(body) + FOOTER)
        p = subprocess.run(
            [sys.executable, script, out],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=dict(os.environ, **(env or {})),
        )
        if p.returncode != 0:
            raise RuntimeError(f"child failed (rc {p.returncode}):\n{p.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f)


# ---------------------------------------------------------------- GPU lines
@pytest.fixture(scope="module")
def gpu_256() -> dict:
    return child(
        """
        torch.cuda.init(); torch.ones(1, device="cuda")
        @torchmem.profile
        def make():
            x = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
            return x
        torch.cuda.synchronize()
        a0 = torch.cuda.memory_allocated()
        keep = make()
        RESULT["torch_delta"] = torch.cuda.memory_allocated() - a0
        f = fn("make")
        RESULT["row"] = row(f, "x = torch.empty")
        """
    )


def test_gpu_256_mib_line_gpu_alloc_delta(gpu_256: dict) -> None:
    got = gpu_256["row"]["gpu_alloc_delta_bytes"]
    assert got == 256 * MIB == gpu_256["torch_delta"], (
        f"measured {got} B, expected {256 * MIB} B, torch.cuda delta {gpu_256['torch_delta']} B"
    )


def test_gpu_256_mib_line_gpu_peak(gpu_256: dict) -> None:
    got = gpu_256["row"]["gpu_peak_bytes"]
    assert got == 256 * MIB, f"measured {got} B, expected {256 * MIB} B"


@pytest.fixture(scope="module")
def gpu_temporary() -> dict:
    return child(
        """
        a = torch.randn(16 * MIB, device="cuda")          # 64 MiB of float32
        torch.cuda.synchronize()
        # torch.cuda's answer for the same line, unprofiled:
        base = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
        s = (a * 2).sum()
        RESULT["torch_peak"] = torch.cuda.max_memory_allocated() - base
        RESULT["torch_delta"] = torch.cuda.memory_allocated() - base
        del s
        @torchmem.profile
        def temp(a):
            s = (a * 2).sum()
            t = s + 1
            return t
        for _ in range(3):
            out = temp(a)
        del out
        f = fn("temp")
        RESULT["row"] = row(f, "s = (a * 2).sum()")
        RESULT["row_t"] = row(f, "t = s + 1")
        """
    )


def test_gpu_temporary_gpu_peak_equals_torch_cuda_peak(gpu_temporary: dict) -> None:
    r = gpu_temporary
    assert r["row"]["gpu_peak_bytes"] == r["torch_peak"], (
        f"measured {r['row']['gpu_peak_bytes']} B, expected {r['torch_peak']} B (64 MiB temporary + result)"
    )


def test_gpu_temporary_gpu_alloc_delta_equals_torch_cuda_delta_per_hit_x3(gpu_temporary: dict) -> None:
    r = gpu_temporary
    assert r["row"]["gpu_alloc_delta_bytes"] == 3 * r["torch_delta"], (
        f"measured {r['row']['gpu_alloc_delta_bytes']} B, expected {3 * r['torch_delta']} B"
    )


def row_small(r: dict) -> bool:
    return r["gpu_peak_bytes"] is not None and r["gpu_peak_bytes"] < MIB


def test_gpu_temporary_the_next_lines_peak_is_its_own(gpu_temporary: dict) -> None:
    r = gpu_temporary
    assert row_small(r["row_t"]), f"measured {r['row_t']['gpu_peak_bytes']} B, expected < 1 MiB"


def test_gpu_cuda_initialised_inside_the_profiled_function() -> None:
    r = child(
        """
        @torchmem.profile
        def first_cuda():
            x = torch.ones(64 * MIB, dtype=torch.uint8, device="cuda")
            y = torch.ones(32 * MIB, dtype=torch.uint8, device="cuda")
            return x, y
        keep = first_cuda()
        f = fn("first_cuda")
        RESULT["x"] = row(f, "x = torch.ones")
        RESULT["y"] = row(f, "y = torch.ones")
        RESULT["device"] = profile_data()["gpu_device"]
        """
    )
    assert (
        r["x"]["gpu_alloc_delta_bytes"] == 64 * MIB
        and r["y"]["gpu_alloc_delta_bytes"] == 32 * MIB
        and r["device"] is not None
    ), (
        f"measured {r['x']['gpu_alloc_delta_bytes']} / {r['y']['gpu_alloc_delta_bytes']} B, "
        f"expected {64 * MIB} / {32 * MIB} B, device {r['device']}"
    )


def test_gpu_gpt2_gradient_checkpointing_trains_under_the_profiler() -> None:
    r = child(
        """
        from transformers import GPT2Config, GPT2LMHeadModel
        model = GPT2LMHeadModel(GPT2Config()).cuda()
        model.gradient_checkpointing_enable()
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(0, 50257, (2, 256), device="cuda")
        @torchmem.profile
        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return out.loss.item()
        losses = [step() for _ in range(3)]
        RESULT["losses"] = losses
        f = fn("step")
        RESULT["backward"] = row(f, "out.loss.backward()")
        RESULT["warnings"] = profile_data()["warnings"]
        """
    )
    b = r["backward"]
    assert len(r["losses"]) == 3 and b["hits"] == 3 and b["gpu_peak_bytes"] and b["gpu_peak_bytes"] > 0, (
        f"losses {r['losses']}, backward line peak {b['gpu_peak_bytes']} B, warnings {r['warnings']}"
    )


# ---------------------------------------------------------------- torchmem run --line on a GPU script
RUN_LINE_SCRIPT = """
import json, sys, time
import torch
from torchmem import _native

def work():
    keep = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    time.sleep(0.3)
    t = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")  # a 2 GiB temporary, freed on the next line
    del t
    torch.cuda.synchronize()
    time.sleep(0.3)
    return keep

def short():
    # CUDA starts here; the GPU work is over, and the cache emptied, well within the sampler's idle cadence.
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    t = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    del t, x
    torch.cuda.empty_cache()

try:
    profile  # noqa: B018 - the builtin `torchmem run --line` injects
except NameError:
    profile = lambda f: f  # noqa: E731
if sys.argv[1:] == ["short"]:
    profile(short)()
    time.sleep(0.3)
else:
    keep = profile(work)()
print("TRUTH " + json.dumps({
    "max_allocated": torch.cuda.max_memory_allocated(), "max_reserved": torch.cuda.max_memory_reserved(),
    "allocated": torch.cuda.memory_allocated(), "sampler_running": _native.allocator_sampler_running(),
    "sampler_lines_now": len(_native.read_allocator_once())}))
"""


RUN_MODES = [([], []), (["--line"], []), ([], ["short"]), (["--line"], ["short"])]


def _mode(args: list[str], variant: list[str]) -> str:
    return " ".join(["run", *args, *(["(short GPU life, cache emptied)"] if variant else [])])


@pytest.fixture(scope="module")
def run_line_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("run-line")
    (d / "gpu_line.py").write_text(RUN_LINE_SCRIPT)
    return d


@pytest.fixture(scope="module", params=RUN_MODES, ids=[_mode(a, v) for a, v in RUN_MODES])
def run_line(request: pytest.FixtureRequest, run_line_dir: Path, torchmem_cli: str) -> dict:
    """`torchmem run [--line]` of the GPU script: the program's truth, the profile's torch samples, the report."""
    args, variant = request.param
    mode = _mode(args, variant)
    d = run_line_dir
    prof = d / f"p{len(args)}{len(variant)}.sqlite"
    p = subprocess.run(
        [torchmem_cli, "run", "-q", "-o", str(prof), *args, "--", sys.executable, str(d / "gpu_line.py"), *variant],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=d,
    )
    truth_lines = [ln for ln in p.stdout.splitlines() if ln.startswith("TRUTH ")]
    if p.returncode != 0 or not truth_lines:
        pytest.fail(f"{mode}: GPU script: rc {p.returncode}: {p.stderr[-1500:]}")
    truth = json.loads(truth_lines[-1][6:])
    con = sqlite3.connect(prof)
    n, peak_a, peak_r = con.execute(
        "select count(*), max(max(peak_allocated_bytes, allocated_bytes)), "
        "max(max(peak_reserved_bytes, reserved_bytes)) from torch_samples"
    ).fetchone()
    con.close()
    rep = subprocess.run([torchmem_cli, "report", "--format", "json", str(prof)], capture_output=True, text=True)
    gpus = json.loads(rep.stdout)["peak"]["gpus"] if rep.returncode == 0 else []
    return {
        "mode": mode,
        "args": args,
        "variant": variant,
        "proc": p,
        "truth": truth,
        "n": n,
        "peak_a": peak_a,
        "peak_r": peak_r,
        "report_alloc": gpus[0]["allocated_bytes"] if gpus else None,
    }


def test_run_allocator_timeline_recorded(run_line: dict) -> None:
    r, truth = run_line, run_line["truth"]
    assert r["n"] >= (1 if r["variant"] else 2), (
        f"{r['mode']}: {r['n']} torch samples; in the child: sampler running {truth['sampler_running']}, "
        f"{truth['sampler_lines_now']} device line(s) readable at exit; stderr {r['proc'].stderr[-400:]!r}"
    )


def test_run_timeline_peak_equals_max_memory_allocated(run_line: dict) -> None:
    r = run_line
    assert r["peak_a"] == r["truth"]["max_allocated"], (
        f"{r['mode']}: {r['peak_a']} vs {r['truth']['max_allocated']} B (incl. a 2 GiB temporary)"
    )


def test_run_timeline_peak_reserved_equals_max_memory_reserved(run_line: dict) -> None:
    r = run_line
    assert r["peak_r"] == r["truth"]["max_reserved"], f"{r['mode']}: {r['peak_r']} vs {r['truth']['max_reserved']} B"


def test_run_reports_gpu_allocated_peak(run_line: dict) -> None:
    r = run_line
    assert r["report_alloc"] == r["truth"]["max_allocated"], (
        f"{r['mode']}: {r['report_alloc']} vs {r['truth']['max_allocated']} B"
    )


def test_run_line_table_printed(run_line: dict) -> None:
    r = run_line
    if not r["args"]:
        pytest.skip("plain `torchmem run` prints no line table")
    name = "short" if r["variant"] else "work"
    assert f"Function: {name}" in r["proc"].stdout, f"{r['mode']}: {r['proc'].stdout[-600:]}"


# ---------------------------------------------------------------- CPU cases (3.12: sys.monitoring)
# The line profiler's CPU tests themselves, not copies of them: on the device's Python 3.12 they run the
# sys.monitoring path that CI's 3.11 (the settrace path) cannot.
CPU_TESTS = ("test_line_profiler.py", "test_line_bootstrap.py")


def _cpu_test_path(name: str) -> Path:
    found = sorted(p for p in (ROOT / "tests").rglob(name) if "gpu" not in p.relative_to(ROOT / "tests").parts)
    if len(found) != 1:
        pytest.fail(f"{name}: expected one file under tests/ (outside tests/gpu), found {found}")
    return found[0]


@pytest.fixture(scope="module")
def cpu_cases() -> dict:
    """One pytest run of both CPU test files on this interpreter: its process and the -rA outcomes."""
    paths = [str(_cpu_test_path(n).relative_to(ROOT)) for n in CPU_TESTS]
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *paths],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=ROOT,
    )
    # `-rA`'s summary: "PASSED tests/x.py::test[id with spaces]", "FAILED tests/x.py::test - message".
    summary = [ln.split(" ", 1) for ln in p.stdout.splitlines() if ln.startswith(("PASSED ", "FAILED ", "ERROR "))]
    outcomes = [(outcome, rest.split(" - ", 1)[0]) for outcome, rest in summary]
    tag = f"[{sys.version.split()[0]}]"
    for ln in p.stdout.splitlines():
        if ln.startswith("SKIPPED "):
            print(f"INFO cpu {ln} {tag}", flush=True)
    return {"proc": p, "outcomes": outcomes, "tag": tag, "paths": paths}


@pytest.mark.parametrize("name", CPU_TESTS)
def test_cpu_tests_pass_on_this_python(name: str, cpu_cases: dict, record_property) -> None:  # noqa: ANN001
    """Every test of the file passed (each was a PASS line of its own in the script: all are listed here)."""
    mine = [(o, nodeid) for o, nodeid in cpu_cases["outcomes"] if nodeid.split("::", 1)[0].endswith(name)]
    for o, nodeid in mine:
        print(f"{'PASS' if o == 'PASSED' else 'FAIL'} cpu {nodeid} {cpu_cases['tag']}: {o}")
        record_property(nodeid, o)
    bad = [f"{o} {nodeid}" for o, nodeid in mine if o != "PASSED"]
    assert mine and not bad, (
        f"cpu {name} {cpu_cases['tag']}: {len(bad)} of {len(mine)} not passed: {bad}\n"
        f"{cpu_cases['proc'].stdout[-3000:]}"
    )


def test_cpu_pytest_run(cpu_cases: dict) -> None:
    p, outcomes = cpu_cases["proc"], cpu_cases["outcomes"]
    last = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    assert p.returncode == 0 and bool(outcomes), (
        f"cpu pytest {' '.join(cpu_cases['paths'])} {cpu_cases['tag']}: rc {p.returncode}, {len(outcomes)} tests: "
        f"{last}\n{p.stdout[-3000:]}\n{p.stderr[-1500:]}"
    )


# ---------------------------------------------------------------- bench
def test_bench_line_overhead_ran() -> None:
    p = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "line_overhead" / "run.py"), "--rounds", "2", "--repeats", "2"],
        capture_output=True,
        text=True,
        timeout=420,
    )
    print(p.stdout + p.stderr[-2000:], flush=True)
    assert p.returncode == 0, f"bench/line_overhead: rc {p.returncode}\n{p.stderr[-2000:]}"
