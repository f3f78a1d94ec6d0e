"""`torchmem run` end to end from Python's side: the Python API's phases, steps and epochs land in the profile
on the recorder's clock, with no code change the in-process sampler starts, and the report reads them back.
Real child processes, real torch on CPU, real SQLite files."""

from __future__ import annotations

import functools
import json
import sqlite3
import sys
import textwrap
from pathlib import Path

import cli
import pytest

ROOT = Path(__file__).resolve().parents[2]


torchmem = functools.partial(cli.torchmem, check=True)


def report(profile: Path) -> dict:
    return json.loads(torchmem("report", "--format", "json", str(profile)).stdout)


def test_api_phases_land_in_the_profile_on_the_same_clock(tmp_path: Path) -> None:
    script = tmp_path / "phases.py"
    script.write_text(
        textwrap.dedent(
            """
            import time
            import torchmem
            with torchmem.track("load"):
                data = bytearray(b"\\x01" * (96 << 20))
                time.sleep(0.1)
            with torchmem.track("release"):
                del data
                time.sleep(0.1)
            """
        )
    )
    prof = tmp_path / "p.sqlite"
    torchmem("run", "-q", "-o", str(prof), str(script))
    con = sqlite3.connect(prof)
    rows = con.execute("select t_ns, kind, edge, name, rss_bytes from markers order by t_ns").fetchall()
    names = [(r[2], r[3]) for r in rows]
    assert ("start", "load") in names and ("end", "load") in names and ("end", "release") in names
    duration = con.execute("select max(t_ns) from cpu_samples").fetchone()[0]
    assert all(0 < r[0] <= duration + 200_000_000 for r in rows), (rows, duration)
    start_load = next(r for r in rows if r[2] == "start" and r[3] == "load")
    end_load = next(r for r in rows if r[2] == "end" and r[3] == "load")
    assert end_load[4] - start_load[4] >= 96 << 20
    # The recorder's own samples agree with the API's readings in the same window.
    sampled_peak = con.execute(
        "select max(rss_bytes) from cpu_samples where t_ns between ? and ?", (start_load[0], end_load[0])
    ).fetchone()[0]
    assert sampled_peak >= end_load[4] - (8 << 20)
    j = report(prof)
    phases = {p["name"]: p for p in j["phases"]}
    assert phases["load"]["count"] == 1
    assert phases["load"]["mean_delta_rss_bytes"] >= 96 << 20


def test_example_under_run_has_epochs_phases_and_journey(tmp_path: Path) -> None:
    prof = tmp_path / "ex.sqlite"
    out = torchmem("run", "-o", str(prof), "--", str(ROOT / "examples/train.py"), "--epochs", "3", "--steps", "5")
    assert "== torchmem summary ==" in out.stderr
    j = report(prof)
    assert len(j["epochs"]) == 3
    assert {p["name"] for p in j["phases"]} >= {"forward", "backward", "optimizer step"}
    assert j["peak"]["gpus"] == [] or "torch" in sys.modules  # CPU machine: no fake GPU rows
    names = [s["name"] for s in j["journey"]]
    assert names[0] == "Device checked" and "Peak" in names
    mermaid = torchmem("report", "--format", "mermaid", str(prof)).stdout
    assert mermaid.startswith("journey\n")


def test_leak_warning_reaches_the_report(tmp_path: Path) -> None:
    prof = tmp_path / "leak.sqlite"
    args = ["--epochs", "4", "--steps", "10", "--device", "cpu", "--leak", "--hidden", "1024", "--batch", "512"]
    torchmem("run", "-q", "-o", str(prof), "--", str(ROOT / "examples/train.py"), *args)
    j = report(prof)
    assert j["growth"], "a run that keeps every step's graph alive must be flagged"
    # The example empties the cache after each epoch: the RSS left after each is the series judged, and it
    # grows by what each step's kept graph holds (the input, 1 MiB, and two ReLU outputs, 2 MiB each: 5 MiB a
    # step, 50 MiB an epoch of 10 steps), not by what the epoch ends' RSS happens to show (29-67 MiB).
    g = j["growth"][0]
    assert g["what"] == "CPU RSS after empty_cache()", g
    assert 45 << 20 <= g["per_unit_bytes"] <= 60 << 20, g
    # The same loop with `loss.item()`: nothing is kept, nothing is flagged.
    healthy = tmp_path / "healthy.sqlite"
    healthy_args = [a for a in args if a != "--leak"]
    torchmem("run", "-q", "-o", str(healthy), "--", str(ROOT / "examples/train.py"), *healthy_args)
    assert report(healthy)["growth"] == []


@pytest.mark.parametrize("bad", ["missing.py", "--"])
def test_bad_commands_fail_clearly(tmp_path: Path, bad: str) -> None:
    args = ["run", "-o", str(tmp_path / "x.sqlite"), bad] if bad != "--" else ["run", "--"]
    proc = torchmem(*args, check=False)
    assert proc.returncode != 0
    assert proc.stderr.strip(), "an error must say what went wrong"


def test_a_program_that_starts_and_stops_tracemalloc_is_not_crashed(tmp_path: Path) -> None:
    """The in-process sampler thread keeps one Python thread state for its life. It used to attach afresh on
    each read, allocating a thread state through tracemalloc's hook, which on Python < 3.13 races
    `tracemalloc.stop()` in the main thread (CPython gh-128679): this program was killed by SIGSEGV on every
    run (6 of 6 at 1 ms), and the leak probe (which stops tracemalloc) about once in fifteen."""
    script = tmp_path / "churn.py"
    script.write_text(
        textwrap.dedent(
            """
            import time, tracemalloc
            end = time.monotonic() + 2.0
            cycles = 0
            while time.monotonic() < end:
                tracemalloc.start()
                keep = [bytearray(64) for _ in range(2000)]
                tracemalloc.stop()
                cycles += 1
            print("cycles", cycles)
            """
        )
    )
    prof = tmp_path / "churn.sqlite"
    for _ in range(2):
        proc = torchmem("run", "-q", "--force", "--interval", "1", "-o", str(prof), "--", sys.executable, str(script))
        assert proc.stdout.startswith("cycles "), proc.stdout
    assert report(prof)["meta"]["exit_code"] == 0
