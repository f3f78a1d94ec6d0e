"""Leaks named by the line that holds them (`python/torchmem/_leaks.py`, `analysis/leaks.rs`): real training
scripts on the CPU (`tests/leak_cases.py`) run as child processes, each leaking one way (`total_loss += loss`
keeping every step's graph, a list of output tensors, a growing dict of Python objects, a cache of CPU
tensors) must be named by its exact line, kind and size; healthy runs whose memory rises and plateaus (Adam's
state at step 1, a warm-up cache) must give no finding, no warning, and not even start a probe. Under
`torchmem run` the findings land in the profile and `torchmem report` prints them (text, JSON, Markdown, and
the HTML page in a real chromium)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torchmem
from browser import NEEDS_CHROMIUM, chromium
from cli import ENV
from leak_cases import HEALTHY, KIND, LEAKY, leak_line, parse, reads_of, source

MIB = 1 << 20


def run_case(tmp_path: Path, case: str, *prefix: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / f"{case}.py"
    script.write_text(source(case))
    cmd = [*prefix, str(script), "cpu", "40"] if prefix else [sys.executable, str(script), "cpu", "40"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, f"{case}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.mark.parametrize("case", LEAKY)
def test_each_leak_is_named_by_its_line(tmp_path: Path, case: str) -> None:
    proc = run_case(tmp_path, case)
    leaks, probes = parse(proc.stdout)
    line = leak_line(case)
    assert leaks, f"{case}: no finding\n{proc.stdout}\n{proc.stderr}"
    top = leaks[0]
    assert (Path(top["file"]).name, top["line"]) == (f"{case}.py", line), leaks
    assert top["kind"] == KIND[case][0], top
    assert top["source"].endswith("# LEAK"), top
    # Each case keeps about 1 MiB per step (the graph of total_loss: every saved activation, ~4 MiB).
    assert top["per_step_bytes"] >= MIB // 2, top
    assert top["live_count"] >= 1, top
    assert top["message"].startswith(f"{case}.py:{line} `"), top["message"]
    assert probes == 1, "one probe, then off"
    # The warning points at the line itself (warn_explicit), so Python prints that file:line and its source.
    assert f"{case}.py:{line}: MemoryGrowthWarning" in proc.stderr, proc.stderr
    if case == "total_loss":
        assert top["holds_graph"] and top["graph_nodes"] > 10, top
        assert top["graph_saved_bytes"] >= 5 * top["graph_per_step_bytes"] > 0, top
        assert "autograd graph" in top["message"], top["message"]
        # The forward's own line is alive only inside that graph: named through it, not as a second leak.
        assert [f["line"] for f in leaks] == [line], leaks
        assert any(h.endswith(f"{case}.py:{line - 1}") for h in top["holds_tensors_of"]), top
    else:
        assert not top["holds_graph"] and top["steps_alive"] >= 3, top


@pytest.mark.parametrize("case", HEALTHY)
def test_healthy_runs_that_plateau_start_no_probe_and_warn_nothing(tmp_path: Path, case: str) -> None:
    proc = run_case(tmp_path, case)
    leaks, probes = parse(proc.stdout)
    assert leaks == [] and probes == 0, (leaks, probes, proc.stderr, proc.stdout)
    assert "MemoryGrowthWarning" not in proc.stderr, proc.stderr
    # What the detector judges, RSS less what glibc keeps freed, stays flat after warm-up (raw RSS may creep
    # by megabytes a step: once +2.6 MiB per step over 16 steps on a CI machine, a probe for nothing).
    reads = reads_of(proc.stdout)[8:]
    held = [rss - free for rss, free in reads]
    per_step = (held[-1] - held[0]) / (len(held) - 1)
    raw = (reads[-1][0] - reads[0][0]) / (len(reads) - 1)
    assert per_step < 256 << 10, f"held RSS +{per_step / MIB:.2f} MiB/step (raw RSS +{raw / MIB:.2f} MiB/step)"


@pytest.mark.parametrize("opt_kw", [{}, {"foreach": True}, {"fused": True}], ids=["for-loop", "foreach", "fused"])
def test_a_forced_probe_of_a_healthy_loop_finds_nothing(opt_kw: dict) -> None:
    """The probe itself, run on a healthy loop: outputs of every step die, nothing is named. The optimizer's
    state (its `step` tensors, updated in place by foreach ops that take lists, as on CUDA) is not a leak."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.Adam(model.parameters(), **opt_kw)
    mon = torchmem.Monitor(model, opt, verbose=False)
    mon._leaks.probe_now(5)
    kept = []
    for _ in range(8):
        with mon.step():
            loss = model(torch.randn(32, 64)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            kept.append(loss.item())  # floats: not tensors
    assert mon._leaks.reports and mon._leaks.reports[0]["findings"] == [], mon._leaks.reports
    assert mon.leaks() == [] and mon.to_dict()["leaks"] == []
    mon.close()


def test_a_forced_probe_names_a_list_of_tensors_in_process() -> None:
    import torch

    model = torch.nn.Linear(64, 512)
    mon = torchmem.Monitor(model, verbose=False, warn=False)
    mon._leaks.probe_now(5)
    outputs = []
    for _ in range(6):
        with mon.step():
            out = model(torch.randn(256, 64))
            out.sum().backward()
            outputs.append(out.detach())  # kept: 512 KiB per step
    found = mon.leaks()
    assert found and found[0]["source"] == "outputs.append(out.detach())  # kept: 512 KiB per step", found
    assert found[0]["file"] == __file__ and found[0]["per_step_bytes"] == 256 * 512 * 4, found[0]
    assert mon.to_dict()["leaks"] == found
    text = mon.summary()
    assert text.startswith("LEAK: test_leaks.py:") and "Leaks\n" in text, text
    mon.close()


def test_empty_side_tensors_off_the_graph_do_not_hide_the_line_that_holds_it() -> None:
    """Non-reentrant checkpoint (torch 2.11) makes an empty tensor with a grad_fn (`_NoopSaveInputs`) per
    checkpointed call, kept alive outside the autograd graph, and attributed to the line that called the
    model: that line then has live tensors whose grad_fns the leaking graph does not reach. It must still be
    named through the line that keeps the graph (`total = total + out.sum()`), not as a leak of its own (on
    the H200 it came first). Here the side tensor is made on the model's line, as checkpoint's is."""
    import torch

    model = torch.nn.Linear(64, 512)
    mon = torchmem.Monitor(model, verbose=False, warn=False)
    mon._leaks.probe_now(5)
    total, frames = 0.0, []
    for _ in range(6):
        with mon.step():
            out, side = model(torch.randn(1024, 64)), torch.zeros(0, requires_grad=True) * 1.0
            frames.append(side)  # kept outside the graph, as checkpoint's frame keeps its saver
            total = total + out.sum()  # kept: each step's graph
    found = mon.leaks()
    assert [f["source"] for f in found] == ["total = total + out.sum()  # kept: each step's graph"], found
    assert found[0]["holds_graph"] and any("test_leaks.py:" in h for h in found[0]["holds_tensors_of"]), found[0]
    mon.close()


def test_bad_settings_say_what_to_use() -> None:
    # Imported by name: in a worker that ran no Monitor yet, `torchmem._leaks` and `_native` are not attributes.
    from torchmem import _leaks, _native

    with pytest.raises(ValueError, match="probe_steps=2"):
        _leaks.LeakDetector(probe_steps=2)
    with pytest.raises(ValueError, match="window_steps=1"):
        _native.StepGrowthDetector(5, 1)
    with pytest.raises(ValueError, match="leaks::ProbeData"):
        _native.leak_findings({"not": "a probe"})


def torchmem_cli(*args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "torchmem", *args], capture_output=True, text=True, env=ENV, timeout=600
    )
    assert proc.returncode == 0, f"torchmem {' '.join(args)} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def leaky_profile(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    tmp = tmp_path_factory.mktemp("leakprof")
    prof = tmp / "leak.sqlite"
    run_case(tmp, "total_loss", sys.executable, "-m", "torchmem", "run", "-q", "-o", str(prof), "--", sys.executable)
    return prof, leak_line("total_loss")


def test_the_report_has_a_leaks_section(leaky_profile: tuple[Path, int]) -> None:
    prof, line = leaky_profile
    text = torchmem_cli("report", str(prof)).stdout
    assert f"LEAK: total_loss.py:{line} `total_loss += loss  # LEAK` keeps each step's autograd graph alive" in text
    assert "\nLeaks\n" in text and f"total_loss.py:{line}" in text.split("\nLeaks\n", 1)[1], text
    data = json.loads(torchmem_cli("report", "--format", "json", str(prof)).stdout)
    assert [(Path(f["file"]).name, f["line"], f["kind"]) for f in data["leaks"]] == [
        ("total_loss.py", line, "CPU tensor")
    ]
    assert data["leaks"][0]["holds_graph"] is True and data["leaks"][0]["per_step_bytes"] >= MIB // 2
    md = torchmem_cli("report", "--format", "markdown", str(prof)).stdout
    assert f"> **Leak**: total_loss.py:{line}" in md and "### Leaks" in md, md


@NEEDS_CHROMIUM
def test_the_html_page_lists_the_leaks(leaky_profile: tuple[Path, int], tmp_path: Path) -> None:
    prof, line = leaky_profile
    page = tmp_path / "r.html"
    torchmem_cli("plot", str(prof), "-o", str(page))
    dom = chromium("--dump-dom", page.as_uri()).stdout
    assert f"total_loss.py:{line}" in dom and "Leak:" in dom, dom[:2000]
    assert ">Leaks<" in dom, "the Leaks table is drawn"


# --- the epoch growth warning (issue 28 item 9) --------------------------------------------------------------

EPOCHS = r"""
import sys, warnings
import torch, torchmem

warnings.simplefilter("always")
leak = sys.argv[1] == "leak"
mon = torchmem.Monitor(torch.nn.Linear(4, 4), verbose=False)
kept = []
for e in range(4):
    with mon.epoch():
        # A buffer 25 MiB larger every epoch, touched and freed. glibc (its mmap and trim thresholds raised by
        # the environment) keeps the freed pages at the top of its heap: RSS rises 25 MiB at every epoch end
        # and malloc's free bytes with it, as a healthy CNN's did; nothing holds them.
        b = bytearray((e + 1) * (25 << 20))
        b[::4096] = b"\x01" * len(b[::4096])
        if leak:
            kept.append(bytearray(b"\x02" * (25 << 20)))  # a real leak: 25 MiB more held every epoch
        del b
print("GROWTH", mon.growth_messages)
"""


@pytest.mark.parametrize("case", ["healthy", "leak"])
def test_epoch_growth_judges_rss_less_mallocs_free_memory(case: str) -> None:
    """RSS that rises every epoch by memory glibc keeps freed (a healthy CNN warned 2 runs in 10, issue 28
    item 9) is not growth; memory the program holds is. Real glibc, real /proc, a real Monitor."""
    env = dict(ENV, MALLOC_MMAP_THRESHOLD_=str(1 << 30), MALLOC_TRIM_THRESHOLD_=str(4 << 30))
    proc = subprocess.run([sys.executable, "-c", EPOCHS, case], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if case == "healthy":
        assert "MemoryGrowthWarning" not in proc.stderr and "GROWTH []" in proc.stdout, (proc.stdout, proc.stderr)
    else:
        assert "MemoryGrowthWarning" in proc.stderr and "grew every epoch" in proc.stdout, (proc.stdout, proc.stderr)


# --- what keeps a line's tensors (issue 28 item 8) -----------------------------------------------------------

KEPT = """import torch
import torchmem

model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
mon = torchmem.Monitor(model, opt, verbose=False, breakdown_every=1)
kept = []
for step in range(40):
    with mon.step():
        x = torch.randn(2048, 256)
        out = model(x)  # MADE
        loss = out.pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        kept.append(out)  # KEPT
import json
print("LEAKS " + json.dumps(mon.leaks()))
"""


def test_a_list_of_outputs_is_named_by_the_list_and_the_line_that_appends(tmp_path: Path) -> None:
    """`kept.append(out)` after backward, under the Monitor's own saved-tensor hooks (every step measured): the
    finding names where the tensor was made, the list `kept` and the append line, with the bytes per step; it
    does not blame the hooks for a graph whose saves backward freed. The warning points at the append."""
    script = tmp_path / "kept.py"
    script.write_text(KEPT)
    lines = KEPT.splitlines()
    made = next(i for i, t in enumerate(lines, 1) if t.endswith("# MADE"))
    append = next(i for i, t in enumerate(lines, 1) if t.endswith("# KEPT"))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    leaks = json.loads(next(ln[6:] for ln in proc.stdout.splitlines() if ln.startswith("LEAKS ")))
    assert leaks, proc.stderr
    top = leaks[0]
    assert top["line"] == made and top["per_step_bytes"] >= 2048 * 256 * 4, top
    assert top["kept_in"]["container"] == "list" and top["kept_in"]["name"] == "kept", top
    assert top["kept_in"]["line"] == append, top
    msg = top["message"]
    assert f"kept.py:{made}" in msg and "list `kept`" in msg and f"kept.py:{append} `kept.append(out)" in msg, msg
    assert "+2.0 MiB per step" in msg and "could not be read" not in msg, msg
    assert f"kept.py:{append}: MemoryGrowthWarning" in proc.stderr, proc.stderr


def test_the_example_leak_reads_its_graph_through_the_monitors_own_hooks() -> None:
    """`examples/train.py --leak` (`total_loss += loss_fn(model(x), y)` under the Monitor's saved-tensor hook,
    after optimizer steps that bump the weights' versions): the probe reads the graph's saved bytes (it said
    "0 B … could not be read (saved-tensor hooks)") and names the variable that keeps it."""
    example = Path(__file__).resolve().parents[2] / "examples" / "train.py"
    proc = subprocess.run(
        [sys.executable, str(example), "--leak", "--epochs", "2", "--steps", "40"],
        capture_output=True, text=True, env=ENV, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    warning = next(ln for ln in proc.stderr.splitlines() if "MemoryGrowthWarning" in ln)
    assert "train.py:" in warning and "total_loss += loss_fn(model(x), y)" in warning, warning
    assert "could not be read" not in warning and " 0 B of saved tensors" not in warning, warning
    assert "MiB of saved tensors" in warning and "kept in the variable `total_loss`" in warning, warning
