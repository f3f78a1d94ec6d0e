"""GPU (and Python 3.12) checks of the line profiler, run standalone on the H200: `python scripts/gpu_check_line.py`.

Each check runs in a fresh child process, prints PASS/FAIL with measured vs expected numbers, and one failing
check never stops the others; the exit code is non-zero when any check failed. Checks:
  - a line creating a 256 MiB CUDA tensor shows GPU alloc Δ of exactly 256 MiB (= torch.cuda's own delta);
  - a line with a temporary shows the GPU peak torch.cuda reports for the same line;
  - CUDA initialised inside a profiled function;
  - HF GPT-2 (built from GPT2Config, no network) with gradient checkpointing trains under the profiler;
  - the CPU tests themselves (`tests/test_line_profiler.py`: 64 MiB line, alloc/free loop, sum rule, threads,
    recursion, generators, exceptions, both gates; `tests/test_line_bootstrap.py`: FILE:FUNCTION specs, an
    unmodified memory_profiler script, `torchmem run --line`), by pytest on this interpreter: on Python >= 3.12
    that is the sys.monitoring path (needs pytest, and the `torchmem` command on PATH);
  - `torchmem run --line` of a GPU script records an allocator timeline whose peak equals torch's (and plain
    `torchmem run` of the same script, side by side), also when the GPU work is short and ends with
    `empty_cache()` (the case that recorded no timeline at all);
  - bench/line_overhead (with the GPU resnet18 step).
Flags: --no-bench skips the benchmark.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap

MIB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAILURES: list[str] = []

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


def check(name: str, ok: bool, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        FAILURES.append(name)


def guarded(name: str, fn) -> None:
    try:
        fn()
    except Exception as exc:  # one broken check must not hide the others
        check(name, False, f"raised {type(exc).__name__}: {str(exc)[-1500:]}")


def near(v: float, e: float, rel: float = 0.05) -> bool:
    return abs(v - e) <= rel * abs(e)


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


def run_line_timeline() -> None:
    """`torchmem run --line` of a GPU script records the allocator timeline as plain `torchmem run` does, and
    its peak equals torch's `max_memory_allocated()` (the line profiler's resets included)."""
    import shutil
    import sqlite3

    exe = shutil.which("torchmem") or os.path.join(os.path.dirname(sys.executable), "torchmem")
    with tempfile.TemporaryDirectory() as d:
        script = os.path.join(d, "gpu_line.py")
        with open(script, "w") as f:
            f.write(RUN_LINE_SCRIPT)
        for args, variant in (([], []), (["--line"], []), ([], ["short"]), (["--line"], ["short"])):
            mode = " ".join(["run", *args, *(["(short GPU life, cache emptied)"] if variant else [])])
            prof = os.path.join(d, f"p{len(args)}{len(variant)}.sqlite")
            p = subprocess.run([exe, "run", "-q", "-o", prof, *args, "--", sys.executable, script, *variant],
                               capture_output=True, text=True, timeout=600, cwd=d)
            truth_lines = [ln for ln in p.stdout.splitlines() if ln.startswith("TRUTH ")]
            if p.returncode != 0 or not truth_lines:
                check(f"{mode}: GPU script", False, f"rc {p.returncode}: {p.stderr[-1500:]}")
                continue
            truth = json.loads(truth_lines[-1][6:])
            con = sqlite3.connect(prof)
            n, peak_a, peak_r = con.execute(
                "select count(*), max(max(peak_allocated_bytes, allocated_bytes)), "
                "max(max(peak_reserved_bytes, reserved_bytes)) from torch_samples").fetchone()
            check(f"{mode}: allocator timeline recorded", n >= (1 if variant else 2),
                  f"{n} torch samples; in the child: sampler running {truth['sampler_running']}, "
                  f"{truth['sampler_lines_now']} device line(s) readable at exit; stderr {p.stderr[-400:]!r}")
            check(f"{mode}: timeline peak == torch.cuda.max_memory_allocated()", peak_a == truth["max_allocated"],
                  f"{peak_a} vs {truth['max_allocated']} B (incl. a 2 GiB temporary)")
            check(f"{mode}: timeline peak reserved == max_memory_reserved()", peak_r == truth["max_reserved"],
                  f"{peak_r} vs {truth['max_reserved']} B")
            rep = subprocess.run([exe, "report", "--format", "json", prof], capture_output=True, text=True)
            gpus = json.loads(rep.stdout)["peak"]["gpus"] if rep.returncode == 0 else []
            alloc = gpus[0]["allocated_bytes"] if gpus else None
            check(f"{mode}: report's GPU allocated peak", alloc == truth["max_allocated"],
                  f"{alloc} vs {truth['max_allocated']} B")
            if args:
                name = "short" if variant else "work"
                check(f"{mode}: line table printed", f"Function: {name}" in p.stdout, p.stdout[-600:])


# ---------------------------------------------------------------- GPU
def gpu_256() -> None:
    r = child(
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
    got = r["row"]["gpu_alloc_delta_bytes"]
    check("gpu 256 MiB line: GPU alloc Δ", got == 256 * MIB == r["torch_delta"],
          f"measured {got} B, expected {256 * MIB} B, torch.cuda delta {r['torch_delta']} B")
    check("gpu 256 MiB line: GPU peak", r["row"]["gpu_peak_bytes"] == 256 * MIB,
          f"measured {r['row']['gpu_peak_bytes']} B, expected {256 * MIB} B")


def gpu_temporary_peak() -> None:
    r = child(
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
    row = r["row"]
    check("gpu temporary: GPU peak = torch.cuda peak", row["gpu_peak_bytes"] == r["torch_peak"],
          f"measured {row['gpu_peak_bytes']} B, expected {r['torch_peak']} B (64 MiB temporary + result)")
    check("gpu temporary: GPU alloc Δ = torch.cuda delta (per hit x3)",
          row["gpu_alloc_delta_bytes"] == 3 * r["torch_delta"],
          f"measured {row['gpu_alloc_delta_bytes']} B, expected {3 * r['torch_delta']} B")
    check("gpu temporary: the next line's peak is its own", row_small(r["row_t"]),
          f"measured {r['row_t']['gpu_peak_bytes']} B, expected < 1 MiB")


def row_small(r: dict) -> bool:
    return r["gpu_peak_bytes"] is not None and r["gpu_peak_bytes"] < MIB


def gpu_init_inside() -> None:
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
    check("gpu CUDA initialised inside the profiled function",
          r["x"]["gpu_alloc_delta_bytes"] == 64 * MIB and r["y"]["gpu_alloc_delta_bytes"] == 32 * MIB
          and r["device"] is not None,
          f"measured {r['x']['gpu_alloc_delta_bytes']} / {r['y']['gpu_alloc_delta_bytes']} B, "
          f"expected {64 * MIB} / {32 * MIB} B, device {r['device']}")


def gpu_gpt2_checkpointing() -> None:
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
    check("gpu GPT-2 + gradient checkpointing trains under the profiler",
          len(r["losses"]) == 3 and b["hits"] == 3 and b["gpu_peak_bytes"] and b["gpu_peak_bytes"] > 0,
          f"losses {r['losses']}, backward line peak {b['gpu_peak_bytes']} B, warnings {r['warnings']}")


# ---------------------------------------------------------------- CPU cases (3.12: sys.monitoring)
# The line profiler's CPU tests themselves, not copies of them: on the H200's Python 3.12 they run the
# sys.monitoring path that CI's 3.11 (the settrace path) cannot.
CPU_TESTS = ("tests/test_line_profiler.py", "tests/test_line_bootstrap.py")


def cpu_cases() -> None:
    tag = f"[{sys.version.split()[0]}]"
    try:
        import pytest  # noqa: F401
    except ImportError:
        check(f"cpu {' '.join(CPU_TESTS)} {tag}", False, "pytest is not installed here: pip install pytest")
        return
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *CPU_TESTS],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=ROOT,
    )
    # `-rA`'s summary: "PASSED tests/x.py::test[id with spaces]", "FAILED tests/x.py::test - message".
    summary = [ln.split(" ", 1) for ln in p.stdout.splitlines() if ln.startswith(("PASSED ", "FAILED ", "ERROR "))]
    outcomes = [(outcome, rest.split(" - ", 1)[0]) for outcome, rest in summary]
    for outcome, nodeid in outcomes:
        check(f"cpu {nodeid} {tag}", outcome == "PASSED", outcome)
    for ln in p.stdout.splitlines():
        if ln.startswith("SKIPPED "):
            print(f"INFO cpu {ln} {tag}", flush=True)
    check(
        f"cpu pytest {' '.join(CPU_TESTS)} {tag}",
        p.returncode == 0 and bool(outcomes),
        f"rc {p.returncode}, {len(outcomes)} tests: {p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ''}"
        + ("" if p.returncode == 0 else f"\n{p.stdout[-3000:]}\n{p.stderr[-1500:]}"),
    )


def bench() -> None:
    p = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "line_overhead", "run.py"), "--rounds", "2", "--repeats", "2"],
        capture_output=True,
        text=True,
        timeout=420,
    )
    print(p.stdout + p.stderr[-2000:], flush=True)
    check("bench/line_overhead ran", p.returncode == 0, f"rc {p.returncode}")


def main() -> int:
    import torch

    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, cuda {torch.cuda.is_available()}")
    if torch.cuda.is_available():
        guarded("gpu 256 MiB line", gpu_256)
        guarded("gpu temporary", gpu_temporary_peak)
        guarded("gpu CUDA init inside", gpu_init_inside)
        guarded("gpu GPT-2 + gradient checkpointing", gpu_gpt2_checkpointing)
        guarded("torchmem run --line timeline", run_line_timeline)
    else:
        check("gpu available", False, "torch.cuda.is_available() is False: GPU checks not run")
    cpu_cases()
    if "--no-bench" not in sys.argv:
        guarded("bench", bench)
    print(f"{'FAIL' if FAILURES else 'PASS'} summary: {len(FAILURES)} failed {FAILURES}")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
