"""Line profiler correctness: real torch on the CPU, real scripts in child processes, numbers read back from
`torchmem.line_profiler.profile_data()`. Every case runs twice: with the calibrated gate (memory read only
after events slow enough to contain a page fault) and with gate 0 (memory read at every event)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

MIB = 1 << 20
GATES = ["calibrated", "0"]

# Torch's first large tensor op pages in several MiB of its own code; on a cold page cache (a fresh venv, as
# in CI) RSS counts those file-backed pages too. Warm up first so each case measures its own allocations.
WARM_UP = "_warm = torch.ones(64 << 20, dtype=torch.uint8)\n_warm.add_(1)\n_warm = (_warm + 1).clone()\ndel _warm\n"

HEADER = """
import json, os, sys, threading
import torch
import torchmem
from torchmem.line_profiler import profile_data
MIB = 1 << 20
""" + WARM_UP + """
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
"""

FOOTER = """
with open(sys.argv[1], "w") as f:
    json.dump({"data": profile_data(), "extra": globals().get("EXTRA", {})}, f)
"""


def run_script(tmp_path: Path, body: str, gate: str, env_extra: dict | None = None) -> dict:
    script = tmp_path / "prog.py"
    script.write_text(HEADER + textwrap.dedent(body) + FOOTER)
    out = tmp_path / "out.json"
    env = dict(os.environ)
    env.pop("TORCHMEM_EVENT_FD", None)
    if gate != "calibrated":
        env["TORCHMEM_LINE_GATE_NS"] = gate
    env.update(env_extra or {})
    p = subprocess.run(
        [sys.executable, str(script), str(out)], capture_output=True, text=True, env=env, timeout=300
    )
    assert p.returncode == 0, p.stderr
    result = json.loads(out.read_text())
    result["stdout"] = p.stdout
    result["stderr"] = p.stderr
    return result


def func(data: dict, name: str) -> dict:
    for f in data["data"]["functions"]:
        if f["name"] == name:
            return f
    raise AssertionError(f"{name} not profiled: {[f['name'] for f in data['data']['functions']]}")


def line(f: dict, needle: str) -> dict:
    rows = [r for r in f["lines"] if needle in r["source"]]
    assert len(rows) == 1, (needle, [r["source"] for r in f["lines"]])
    return rows[0]


def near(value: int, expected: int, rel: float = 0.05) -> bool:
    return abs(value - expected) <= rel * abs(expected)


@pytest.mark.parametrize("gate", GATES)
def test_64_mib_line_shows_64_mib(tmp_path: Path, gate: str) -> None:
    d = run_script(
        tmp_path,
        """
        @torchmem.profile
        def work():
            small = [1, 2, 3]
            big = torch.ones(64 * MIB, dtype=torch.uint8)
            total = len(small) + 1
            return big, total
        keep = work()
        """,
        gate,
    )
    f = func(d, "work")
    big = line(f, "big = torch.ones")
    assert big["hits"] == 1
    assert near(big["cpu_delta_bytes"], 64 * MIB), big
    assert near(big["cpu_delta_max_bytes"], 64 * MIB), big
    assert abs(line(f, "small = [1, 2, 3]")["cpu_delta_bytes"]) < MIB
    assert abs(line(f, "total = len")["cpu_delta_bytes"]) < MIB
    assert big["cpu_rss_bytes"] > 64 * MIB
    assert d["data"]["gpu_device"] is None, "no CUDA here: no GPU columns"
    assert big["gpu_peak_bytes"] is None


@pytest.mark.parametrize("gate", GATES)
def test_alloc_free_loop_per_hit_numbers(tmp_path: Path, gate: str) -> None:
    # memory_profiler's loop bug (#195, #211, #219, #253): increments against the previous line's max.
    d = run_script(
        tmp_path,
        """
        @torchmem.profile
        def loop():
            for i in range(5):
                x = torch.ones(64 * MIB, dtype=torch.uint8)
                x.add_(1)
                del x
        loop()
        """,
        gate,
    )
    f = func(d, "loop")
    alloc, touch, free = line(f, "x = torch.ones"), line(f, "x.add_(1)"), line(f, "del x")
    assert alloc["hits"] == touch["hits"] == free["hits"] == 5
    assert near(alloc["cpu_delta_bytes"], 5 * 64 * MIB), alloc
    assert near(alloc["cpu_delta_max_bytes"], 64 * MIB), alloc
    assert near(free["cpu_delta_bytes"], -5 * 64 * MIB), free
    assert abs(touch["cpu_delta_bytes"]) < 2 * MIB
    assert abs(line(f, "for i in range")["cpu_delta_bytes"]) < 2 * MIB


@pytest.mark.parametrize("gate", GATES)
def test_sum_rule(tmp_path: Path, gate: str) -> None:
    d = run_script(
        tmp_path,
        """
        def helper():
            return torch.ones(32 * MIB, dtype=torch.uint8)
        @torchmem.profile
        def work():
            a = torch.ones(64 * MIB, dtype=torch.uint8)
            b = helper()
            c = [b]
            del a
            return c
        before = rss()
        kept = work()
        EXTRA = {"change": rss() - before}
        """,
        gate,
    )
    f = func(d, "work")
    total = sum(r.get("cpu_delta_bytes") or 0 for r in f["lines"])
    assert near(line(f, "b = helper()")["cpu_delta_bytes"], 32 * MIB), "callees count in the caller's line"
    assert near(line(f, "del a")["cpu_delta_bytes"], -64 * MIB)
    assert abs(total - d["extra"]["change"]) < MIB, (total, d["extra"]["change"])
    assert near(total, 32 * MIB)


@pytest.mark.parametrize("gate", GATES)
def test_threads_attributed_per_thread(tmp_path: Path, gate: str) -> None:
    d = run_script(
        tmp_path,
        """
        @torchmem.profile
        def worker(n):
            x = torch.ones(n * MIB, dtype=torch.uint8)
            y = x.sum()
            del x
            return y
        outs = []
        ts = [threading.Thread(target=lambda: outs.append(worker(64))) for _ in range(2)]
        for t in ts:
            t.start()
            t.join()
        worker(64)
        """,
        gate,
    )
    f = func(d, "worker")
    assert f["threads"] == 3 and f["calls"] == 3
    alloc = line(f, "x = torch.ones")
    assert alloc["hits"] == 3
    assert near(alloc["cpu_delta_bytes"], 3 * 64 * MIB), alloc
    assert near(line(f, "del x")["cpu_delta_bytes"], -3 * 64 * MIB)


@pytest.mark.parametrize("gate", GATES)
def test_thread_started_before_profiling(tmp_path: Path, gate: str) -> None:
    """A worker thread that was already running when profiling began (a pool started at import time) calls
    the profiled function later: its lines are measured too (3.12: sys.monitoring covers every thread;
    <= 3.11: the trace function is installed on the existing threads)."""
    d = run_script(
        tmp_path,
        """
        go, done = threading.Event(), threading.Event()
        box = {}
        def pool_worker():
            go.wait()
            box["r"] = box["fn"](64)
            done.set()
        t = threading.Thread(target=pool_worker)
        t.start()  # running before anything is profiled

        def late(n):
            x = torch.ones(n * MIB, dtype=torch.uint8)
            y = int(x.sum())
            del x
            return y
        box["fn"] = torchmem.profile(late)
        go.set()
        done.wait(60)
        t.join()
        """,
        gate,
    )
    f = func(d, "late")
    assert f["calls"] == 1 and f["threads"] == 1, f
    alloc = line(f, "x = torch.ones")
    assert alloc["hits"] == 1 and near(alloc["cpu_delta_bytes"], 64 * MIB), alloc
    assert near(line(f, "del x")["cpu_delta_bytes"], -64 * MIB)


@pytest.mark.parametrize("gate", GATES)
def test_recursion(tmp_path: Path, gate: str) -> None:
    d = run_script(
        tmp_path,
        """
        @torchmem.profile
        def rec(n):
            x = torch.ones(64 * MIB, dtype=torch.uint8)
            if n > 0:
                rec(n - 1)
            del x
        rec(2)
        """,
        gate,
    )
    f = func(d, "rec")
    assert f["calls"] == 3
    alloc, call, free = line(f, "x = torch.ones"), line(f, "rec(n - 1)"), line(f, "del x")
    assert alloc["hits"] == 3 and free["hits"] == 3 and call["hits"] == 2
    assert near(alloc["cpu_delta_bytes"], 3 * 64 * MIB), alloc
    assert near(free["cpu_delta_bytes"], -3 * 64 * MIB), free
    assert abs(call["cpu_delta_bytes"]) < 2 * MIB, "a recursive call allocates and frees: net 0"


@pytest.mark.parametrize("gate", GATES)
def test_generator_suspension_is_not_attributed(tmp_path: Path, gate: str) -> None:
    d = run_script(
        tmp_path,
        """
        @torchmem.profile
        def batches():
            for i in range(3):
                b = torch.ones(64 * MIB, dtype=torch.uint8)
                yield b
                del b
        held = []
        for b in batches():
            held.append(torch.ones(64 * MIB, dtype=torch.uint8))  # the consumer's memory, not the generator's
            del b
        """,
        gate,
    )
    f = func(d, "batches")
    make, give = line(f, "b = torch.ones"), line(f, "yield b")
    assert make["hits"] == 3 and give["hits"] == 3
    assert near(make["cpu_delta_bytes"], 3 * 64 * MIB), make
    assert abs(give["cpu_delta_bytes"]) < 2 * MIB, give
    # The consumer deleted its reference, so the generator's `del b` frees the tensor.
    assert near(line(f, "del b")["cpu_delta_bytes"], -3 * 64 * MIB)


@pytest.mark.parametrize("gate", GATES)
def test_exceptions_through_profiled_lines(tmp_path: Path, gate: str) -> None:
    d = run_script(
        tmp_path,
        """
        def fail():
            raise ValueError("boom")
        @torchmem.profile
        def thrower():
            x = torch.ones(64 * MIB, dtype=torch.uint8)
            fail()
            never = 1
        @torchmem.profile
        def catcher():
            try:
                thrower()
            except ValueError:
                y = torch.ones(64 * MIB, dtype=torch.uint8)
            return y
        for _ in range(2):
            kept = catcher()
        """,
        gate,
    )
    t, c = func(d, "thrower"), func(d, "catcher")
    assert t["calls"] == 2 and c["calls"] == 2
    assert line(t, "fail()")["hits"] == 2
    assert line(t, "never = 1")["hits"] == 0
    assert near(line(t, "x = torch.ones")["cpu_delta_bytes"], 2 * 64 * MIB)
    # x lives on in the traceback until the except block ends, then dies inside `catcher`: each call of
    # catcher nets +64 MiB (y), which its lines must add up to.
    assert near(sum(r.get("cpu_delta_bytes") or 0 for r in c["lines"]), 2 * 64 * MIB)
    assert line(c, "y = torch.ones")["hits"] == 2
    assert line(c, "return y")["hits"] == 2


def test_tables_printed_at_exit_and_on_demand(tmp_path: Path) -> None:
    d = run_script(
        tmp_path,
        """
        @torchmem.profile
        def work():
            a = torch.ones(64 * MIB, dtype=torch.uint8)
            return a
        keep = work()
        torchmem.print_profile()
        keep2 = work()
        """,
        "calibrated",
    )
    out = d["stdout"]
    assert out.count("Function: work") == 2, out  # once on demand, once at exit (new data since)
    assert "Line #" in out and "CPU Δ max" in out and "Line Contents" in out
    assert re.search(r"\+6[45]\.\d MiB", out), out
    assert "GPU peak" not in out


def test_decorator_returns_function_and_accepts_memory_profiler_kwargs(tmp_path: Path) -> None:
    d = run_script(
        tmp_path,
        """
        def f(x):
            return x + 1
        assert torchmem.profile(f) is f
        assert torchmem.profile(precision=3)(f) is f
        assert f(1) == 2
        """,
        "calibrated",
    )
    assert line(func(d, "f"), "return x + 1")["hits"] == 1


def test_recorder_receives_line_profile_event(tmp_path: Path) -> None:
    script = tmp_path / "prog.py"
    script.write_text(
        HEADER
        + textwrap.dedent(
            """
            @torchmem.profile
            def work():
                return torch.ones(64 * MIB, dtype=torch.uint8)
            keep = work()
            """
        )
    )
    r, w = os.pipe()
    env = dict(os.environ, TORCHMEM_EVENT_FD=str(w))
    p = subprocess.Popen([sys.executable, str(script)], env=env, pass_fds=(w,), stdout=subprocess.PIPE)
    os.close(w)
    with os.fdopen(r) as f:
        messages = [json.loads(x) for x in f.read().splitlines() if x.strip()]
    assert p.wait(timeout=300) == 0
    lp = [m for m in messages if m["type"] == "line_profile"]
    assert len(lp) == 1
    data = lp[0]["data"]
    assert lp[0]["t_ns"] > 0
    row = line(func({"data": data}, "work"), "return torch.ones")
    assert near(row["cpu_delta_bytes"], 64 * MIB)


def test_rust_renderers_agree_with_payload(tmp_path: Path) -> None:
    from torchmem import _native

    d = run_script(
        tmp_path,
        """
        @torchmem.profile
        def work():
            a = torch.ones(64 * MIB, dtype=torch.uint8)
            return a
        keep = work()
        """,
        "calibrated",
    )
    payload = [d["data"]]
    section = _native.line_report(payload)
    row = line(section["functions"][0], "a = torch.ones")
    assert row["cpu_delta_bytes"] == line(func(d, "work"), "a = torch.ones")["cpu_delta_bytes"]
    html = _native.line_render_html(payload)
    assert "<script" not in html and 'data-heavy="1"' in html
    assert "a = torch.ones" in _native.line_render_text(payload)
