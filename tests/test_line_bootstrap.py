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
