"""`torchmem run --line` without the CLI in between: a child does what the run bootstrap does
(`_bootstrap_line(specs, script)` then `runpy.run_path`), on an unmodified memory_profiler script and on a
`FILE:FUNCTION` spec; plus the end-to-end `torchmem run --line` once the CLI offers it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

MIB = 1 << 20

MEMORY_PROFILER_SCRIPT = """
import torch

@profile
def make():
    a = torch.ones(64 * 1024 * 1024, dtype=torch.uint8)
    b = a + 1
    del a
    return b

def not_decorated():
    return torch.ones(64 * 1024 * 1024, dtype=torch.uint8)

if __name__ == "__main__":
    keep = make()
    keep2 = not_decorated()
"""

# Torch's first large tensor op pages in several MiB of its own code, which RSS counts on a cold page cache
# (a fresh venv, as in CI): warm up before the script so each case measures its own allocations.
RUNNER = """
import json, runpy, sys
import torch
_warm = torch.ones(64 << 20, dtype=torch.uint8)
_warm.add_(1)
_warm = (_warm + 1).clone()
del _warm
from torchmem.line_profiler import _bootstrap_line, profile_data
specs, script, out = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
_bootstrap_line(specs, script)
runpy.run_path(script, run_name="__main__")
with open(out, "w") as f:
    json.dump(profile_data(), f)
"""


def bootstrap(tmp_path: Path, specs: list[str], script_text: str) -> tuple[dict, str]:
    script = tmp_path / "mp_script.py"
    script.write_text(textwrap.dedent(script_text))
    runner = tmp_path / "runner.py"
    runner.write_text(RUNNER)
    out = tmp_path / "out.json"
    p = subprocess.run(
        [sys.executable, str(runner), json.dumps(specs), str(script), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr
    return json.loads(out.read_text()), p.stdout


def rows(data: dict, name: str) -> dict[str, dict]:
    (f,) = [f for f in data["functions"] if f["name"] == name]
    return {r["source"].strip(): r for r in f["lines"]}


def test_unmodified_memory_profiler_script_runs_with_injected_profile(tmp_path: Path) -> None:
    data, stdout = bootstrap(tmp_path, [""], MEMORY_PROFILER_SCRIPT)
    assert [f["name"] for f in data["functions"]] == ["make"]
    r = rows(data, "make")
    assert abs(r["a = torch.ones(64 * 1024 * 1024, dtype=torch.uint8)"]["cpu_delta_bytes"] - 64 * MIB) < 4 * MIB
    assert abs(r["del a"]["cpu_delta_bytes"] + 64 * MIB) < 4 * MIB
    assert "Function: make" in stdout


@pytest.mark.parametrize("target", ["mp_script.py", "__main__", "ABS"])
def test_spec_profiles_undecorated_function(tmp_path: Path, target: str) -> None:
    if target == "ABS":
        target = str(tmp_path / "mp_script.py")
    script = MEMORY_PROFILER_SCRIPT.replace("@profile\n", "")
    data, _ = bootstrap(tmp_path, [f"{target}:not_decorated"], script)
    assert [f["name"] for f in data["functions"]] == ["not_decorated"]
    (row,) = [
        v for k, v in rows(data, "not_decorated").items() if k.startswith("return")
    ]
    assert abs(row["cpu_delta_bytes"] - 64 * MIB) < 4 * MIB


def test_spec_by_module_name_resolves_lazily(tmp_path: Path) -> None:
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "data.py").write_text(
        "import torch\n\ndef collate(n):\n    t = torch.ones(n, dtype=torch.uint8)\n    return t\n"
    )
    script = "import mypkg.data\nkeep = mypkg.data.collate(64 * 1024 * 1024)\n"
    data, _ = bootstrap(tmp_path, ["mypkg.data:collate"], script)
    r = rows(data, "collate")
    assert abs(r["t = torch.ones(n, dtype=torch.uint8)"]["cpu_delta_bytes"] - 64 * MIB) < 4 * MIB


def test_bad_spec_is_reported_and_script_still_runs(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("print('ran')\n")
    runner = tmp_path / "runner.py"
    runner.write_text(RUNNER)
    p = subprocess.run(
        [sys.executable, str(runner), json.dumps(["no_colon_here"]), str(script), str(tmp_path / "o.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0
    assert "ran" in p.stdout
    assert "FILE_OR_MODULE:FUNCTION" in p.stderr


def _cli_has_line() -> bool:
    exe = shutil.which("torchmem") or str(Path(sys.executable).parent / "torchmem")
    try:
        h = subprocess.run([exe, "run", "--help"], capture_output=True, text=True, timeout=60)
    except OSError:
        return False
    return "--line" in h.stdout


@pytest.mark.skipif(not _cli_has_line(), reason="`torchmem run --line` not wired in the CLI yet (lead's cmd_run.rs)")
def test_cli_run_line_end_to_end(tmp_path: Path) -> None:
    exe = shutil.which("torchmem") or str(Path(sys.executable).parent / "torchmem")
    script = tmp_path / "mp_script.py"
    script.write_text(MEMORY_PROFILER_SCRIPT)
    profile_path = tmp_path / "run.torchmem"
    p = subprocess.run(
        [exe, "run", "--line", "-o", str(profile_path), str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr
    assert "Function: make" in p.stdout
    rep = subprocess.run(
        [exe, "report", str(profile_path), "--format", "json"], capture_output=True, text=True, timeout=120
    )
    assert rep.returncode == 0, rep.stderr
    lines = json.loads(rep.stdout)["lines"]
    (f,) = [f for f in lines["functions"] if f["name"] == "make"]
    r = {x["source"].strip(): x for x in f["lines"]}
    assert abs(r["del a"]["cpu_delta_bytes"] + 64 * MIB) < 4 * MIB


# --- `torchmem run --line` and the allocator sampler -----------------------------------------------------

# FakeTorch: a named fake of torch's CUDA allocator bindings (no GPU here), put in sys.modules fully built so
# that the sampler thread and the line profiler find it exactly as they find torch on a GPU machine.
FAKE_TORCH_SCRIPT = """
import builtins, json, sys, time, types

class FakeCudaCounters:
    '''The allocator's allocated/reserved counters with torch's peak semantics (reset -> peak = current).'''
    def __init__(self):
        self.cur = self.peak = self.reserved = self.reserved_peak = self.true_peak = 0
    def alloc(self, n):
        self.cur += n
        self.reserved = max(self.reserved, self.cur)
        self.peak, self.reserved_peak = max(self.peak, self.cur), max(self.reserved_peak, self.reserved)
        self.true_peak = max(self.true_peak, self.cur)
        return n
    def free(self, n):
        self.cur -= n
    def stats(self, dev):
        z = lambda c, p: {"all": {"current": c, "peak": p, "allocated": 0, "freed": 0}}
        return {"allocated_bytes": z(self.cur, self.peak), "reserved_bytes": z(self.reserved, self.reserved_peak),
                "active_bytes": z(self.cur, self.peak), "num_alloc_retries": 0, "num_ooms": 0}
    def reset(self, dev):
        self.peak, self.reserved_peak = self.cur, self.reserved

    def empty_cache(self):
        self.reserved = self.cur

FAKE = FakeCudaCounters()
torch = types.ModuleType("torch")
torch.cuda = types.SimpleNamespace(is_initialized=lambda: True, is_available=lambda: True, device_count=lambda: 1,
                                   current_device=lambda: 0)
torch._C = types.SimpleNamespace(_cuda_memoryStats=FAKE.stats, _cuda_resetPeakMemoryStats=FAKE.reset)
profile = getattr(builtins, "profile", lambda f: f)
if "--short" in sys.argv:
    time.sleep(0.3)  # the sampler has been idle for a while when "CUDA starts"
sys.modules["torch"] = torch

@profile
def short():
    a = FAKE.alloc(64 << 20); FAKE.free(FAKE.alloc(2 << 30)); FAKE.free(a); FAKE.empty_cache()  # one line
    return 1

@profile
def work():
    keep = FAKE.alloc(64 << 20)
    time.sleep(0.3)
    FAKE.free(FAKE.alloc(2 << 30))  # a 2 GiB spike freed within its line
    time.sleep(0.3)
    return keep

if "--short" in sys.argv:
    short()
    time.sleep(0 if "--at-exit" in sys.argv else 0.3)
else:
    work()
print("TRUTH " + json.dumps({"true_peak": FAKE.true_peak}))
"""


@pytest.mark.skipif(not _cli_has_line(), reason="`torchmem run --line` not wired in the CLI")
@pytest.mark.parametrize(
    "variant",
    [[], ["--short"], ["--short", "--at-exit"]],
    ids=["long", "short GPU life, cache emptied", "GPU work just before exit"],
)
@pytest.mark.parametrize("line", [False, True], ids=["run", "run --line"])
def test_allocator_timeline_under_line_as_without(tmp_path: Path, line: bool, variant: list[str]) -> None:
    """`torchmem run --line` records the allocator timeline as plain `run` does, and its peak is the
    allocator's true peak, though the line profiler resets the counters after a line with a spike.

    The "short" case is why `run --line` of a GPU script recorded no timeline at all (report: GPU allocated
    None): until CUDA is in use the sampler reads every 10th tick; a program whose GPU work is over (and its
    cache emptied) before that read leaves plain `run` the cumulative peaks, but the line profiler had reset
    them to the current values, all 0, so the device read as never used. The peak ledger now folds what
    each reset takes into the sampler's next read. "GPU work just before exit": the program ends before the
    sampler's next idle read; the sampler reads once more when it is stopped at exit."""
    import sqlite3

    exe = shutil.which("torchmem") or str(Path(sys.executable).parent / "torchmem")
    script = tmp_path / "fake_gpu.py"
    script.write_text(FAKE_TORCH_SCRIPT)
    prof = tmp_path / "p.sqlite"
    args = [exe, "run", "-q", "-o", str(prof)] + (["--line"] if line else []) + [str(script)]
    args += variant
    short = bool(variant)
    p = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    truth = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("TRUTH ")][-1][6:])
    assert truth["true_peak"] == (2 << 30) + (64 << 20)
    con = sqlite3.connect(prof)
    n, peak = con.execute(
        "select count(*), max(max(peak_allocated_bytes, allocated_bytes)) from torch_samples"
    ).fetchone()
    assert n >= (1 if short else 2), f"{n} allocator samples: no timeline"
    assert peak == truth["true_peak"], f"timeline peak {peak} vs the allocator's {truth['true_peak']}"
    if line:
        assert f"Function: {'short' if short else 'work'}" in p.stdout


# --- memory_profiler users and specs that match nothing ----------------------------------------------------

MP_IMPORT_SCRIPT = """
from memory_profiler import profile
import memory_profiler

@profile
def make():
    a = bytearray(b"\\x01" * (64 * 1024 * 1024))
    return a

keep = make()
print("profile is torchmem's:", memory_profiler.profile.__module__)
"""

# A meta-path finder that says memory_profiler is not installed (as on a machine without it), placed before
# the bootstrap runs (the bootstrap's own finder goes in front of it).
NOT_INSTALLED = """
import sys
class _NoMemoryProfiler:
    def find_spec(self, name, path=None, target=None):
        if name == "memory_profiler":
            raise ModuleNotFoundError("No module named 'memory_profiler'", name="memory_profiler")
        return None
sys.meta_path.insert(0, _NoMemoryProfiler())
"""


@pytest.mark.parametrize("installed", [True, False], ids=["memory_profiler installed", "not installed"])
def test_memory_profiler_import_gets_torchmems_profiler(tmp_path: Path, installed: bool) -> None:
    if installed:
        pytest.importorskip("memory_profiler")
    script = tmp_path / "mp_import.py"
    script.write_text(MP_IMPORT_SCRIPT)
    runner = tmp_path / "runner.py"
    runner.write_text(
        (NOT_INSTALLED if not installed else "")
        + "import json, runpy, sys\n"
        + "from torchmem.line_profiler import _bootstrap_line, profile_data\n"
        + "_bootstrap_line([''], sys.argv[1])\n"
        + "runpy.run_path(sys.argv[1], run_name='__main__')\n"
        + "print('FUNCS ' + json.dumps([f['name'] for f in profile_data()['functions']]))\n"
    )
    p = subprocess.run([sys.executable, str(runner), str(script)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "profile is torchmem's: torchmem.line_profiler" in p.stdout
    assert json.loads(p.stdout.split("FUNCS ")[1].splitlines()[0]) == ["make"]
    assert p.stderr.count("torchmem's line profiler") == 1, p.stderr
    assert "Mem usage" not in p.stdout  # memory_profiler's own table


def test_memory_profiler_unchanged_outside_line_mode() -> None:
    pytest.importorskip("memory_profiler")
    code = "import torchmem.line_profiler, memory_profiler; print(memory_profiler.profile.__module__)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "memory_profiler", p.stderr


LP2 = """
def work():
    return sum(range(10))

def main():
    return work()

main()
"""


@pytest.mark.parametrize(
    "specs, expected",
    [
        (["lp2.py:wrok"], "no function matched --line=lp2.py:wrok; functions seen in lp2.py: main, work"),
        (["lp3.py:work"], "no function matched --line=lp3.py:work; no code from"),
        ([""], "no function was decorated with @profile"),
    ],
    ids=["misspelt", "other file", "no decorator"],
)
def test_nothing_matched_is_said_at_the_end(tmp_path: Path, specs: list[str], expected: str) -> None:
    script = tmp_path / "lp2.py"
    script.write_text(LP2)
    code = (
        "import runpy, sys\n"
        "from torchmem.line_profiler import _bootstrap_line\n"
        f"_bootstrap_line({specs!r}, {str(script)!r})\n"
        f"runpy.run_path({str(script)!r}, run_name='__main__')\n"
        "print('ran')\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 0 and "ran" in p.stdout, p.stderr
    assert expected in p.stderr, p.stderr
    assert p.stderr.count("torchmem:") == 1, p.stderr


def test_a_matching_spec_says_nothing(tmp_path: Path) -> None:
    script = tmp_path / "lp2.py"
    script.write_text(LP2)
    code = (
        "import runpy\n"
        "from torchmem.line_profiler import _bootstrap_line\n"
        f"_bootstrap_line(['lp2.py:work'], {str(script)!r})\n"
        f"runpy.run_path({str(script)!r}, run_name='__main__')\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "no function matched" not in p.stderr and "Function: work" in p.stdout, (p.stdout, p.stderr)


@pytest.mark.skipif(not _cli_has_line(), reason="`torchmem run --line` not wired in the CLI")
@pytest.mark.parametrize("spec", ["justaname", "lp2.py:", ":work"])
def test_malformed_spec_is_a_usage_error_before_running(tmp_path: Path, spec: str) -> None:
    exe = shutil.which("torchmem") or str(Path(sys.executable).parent / "torchmem")
    script = tmp_path / "s.py"
    script.write_text("open('ran', 'w').write('x')\n")
    p = subprocess.run(
        [exe, "run", "-q", f"--line={spec}", str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "FILE_OR_MODULE:FUNCTION" in p.stderr and spec in p.stderr, p.stderr
    assert not (tmp_path / "ran").exists(), "the program ran"
