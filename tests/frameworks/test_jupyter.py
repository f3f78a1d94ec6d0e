"""Tests of torchmem's Jupyter support in a real kernel: a notebook built with nbformat and executed by nbclient
(ipykernel on this venv's Python) loads `%load_ext torchmem`, measures cells with `%%tmemit`/`%tmemit`,
profiles a function defined in the notebook with `%tmprun`, and displays Stats, Monitor and results as
self-contained HTML. Plus the displays' HTML checked in process."""

from __future__ import annotations

import re
import sys

import nbformat
import pytest
import torch
import torchmem
from nbclient import NotebookClient

MIB = 1 << 20

CELLS = [
    "%load_ext torchmem\nimport sys, torch, torchmem\nprint(sys.executable)",
    "%%tmemit -d cpu\nx = torch.ones(16 << 20)\ndel x",
    "r = %tmemit -o -q -d cpu y = torch.ones(8 << 20)\n"
    "print(r.rss_increment_bytes, r.rss_end_bytes - r.rss_start_bytes)",
    "def build(n):\n    a = torch.ones(n, 1 << 20)\n    b = a * 2\n    del a\n    return b.sum()",
    "%tmprun -f build build(16)",
    "torchmem.stats()",
    "mon = torchmem.Monitor(verbose=False)\n"
    "with mon.epoch():\n    with mon.step():\n        z = torch.ones(1 << 20)\nmon",
    "r",
    "%tmprun build(1)",
]


@pytest.fixture(scope="module")
def notebook(tmp_path_factory):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in CELLS]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    client = NotebookClient(
        nb,
        timeout=180,
        kernel_name="python3",
        allow_errors=True,
        resources={"metadata": {"path": str(tmp_path_factory.mktemp("nb"))}},
    )
    client.execute()
    return nb


def text_of(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


def html_of(cell) -> str:
    for o in cell.outputs:
        if o.output_type in ("execute_result", "display_data") and "text/html" in o.get("data", {}):
            return o["data"]["text/html"]
    raise AssertionError(f"no HTML output: {cell.outputs}")


def mib(text: str) -> float:
    value, unit = text.split()
    return float(value) * {"KiB": 1 / 1024, "MiB": 1, "GiB": 1024, "B": 1 / MIB}[unit]


def test_kernel_is_this_python(notebook):
    assert text_of(notebook.cells[0]).strip() == sys.executable
    errors = [o for c in notebook.cells for o in c.outputs if o.output_type == "error"]
    assert not errors, errors


def test_cell_magic_measures_the_cell(notebook):
    out = text_of(notebook.cells[1])
    m = re.search(r"CPU RSS: peak ([\d.]+ \w+), increment \+([\d.]+ \w+) \(held after: ([+-][\d.]+ \w+|[+-]0 B)\)", out)
    assert m, out
    assert 56 <= mib(m.group(2)) <= 80, out  # the 64 MiB tensor, freed before the cell ended
    assert abs(mib(m.group(3).lstrip("+-"))) < 16, out


def test_line_magic_returns_its_result(notebook):
    increment, held = (int(v) for v in text_of(notebook.cells[2]).split())
    assert 28 * MIB <= increment <= 40 * MIB  # 32 MiB kept in `y`
    assert 28 * MIB <= held <= 40 * MIB


def test_tmprun_profiles_a_function_defined_in_the_notebook(notebook):
    out = text_of(notebook.cells[4])
    assert "Function: build" in out and "calls: 1" in out
    rows = {line.strip().split()[0]: line for line in out.splitlines() if re.match(r"\s+\d+\s", line)}
    # The source came from IPython's cell cache: the lines are there, with their numbers in the cell.
    first = next(line for line in out.splitlines() if "a = torch.ones(n, 1 << 20)" in line)
    assert re.search(r"\+(6[0-9]|5[6-9])\.\d MiB", first), first  # 16 x 4 MiB
    assert any("b = a * 2" in line for line in rows.values())
    assert any("del a" in line and "-64.0 MiB" in line for line in rows.values()), out


def test_rich_displays_are_self_contained_html(notebook):
    stats_html = html_of(notebook.cells[5])
    assert "torchmem.stats()" in stats_html and "CPU RSS" in stats_html
    monitor_html = html_of(notebook.cells[6])
    assert "Epochs" in monitor_html and "Memory journey" in monitor_html
    memit_html = html_of(notebook.cells[7])
    assert "%tmemit on cpu" in memit_html and "increment" in memit_html
    for h in (stats_html, monitor_html, memit_html):
        assert "<iframe" not in h and "<script" not in h and "src=" not in h


def test_usage_errors_say_the_fix(notebook):
    err = "".join(o.get("text", "") for o in notebook.cells[8].outputs if o.get("name") == "stderr")
    assert "UsageError: %tmprun: say which function to profile: %tmprun -f FUNC statement" in err


def test_repr_html_in_process():
    s = torchmem.stats("cpu")
    h = s._repr_html_()
    assert "CPU RSS" in h and torchmem._native.format_bytes(s.rss_bytes).split()[0] in h
    assert ("allocated (PyTorch)" in h) == (s.device is not None)
    fresh = torchmem.Monitor(verbose=False)._repr_html_()
    assert "Memory journey" in fresh and "Device checked" in fresh and "Epochs" not in fresh


def test_importing_the_jupyter_module_does_not_import_ipython():
    import subprocess

    code = "import sys, torchmem._jupyter; assert 'IPython' not in sys.modules and 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert torch is not None
