"""The leak finder (`python/torchmem/_leaks.py`) on CUDA (was scripts/gpu_check_leaks.py; under 2 minutes on an H200).

Each case runs in a fresh child process:
  - the leak scripts of `leak_cases` (tests/support) on CUDA: `total_loss += loss` (each step's graph on the GPU),
    a list of CUDA output tensors, a growing Python dict, a cache of CPU copies of CUDA outputs: each named by
    its exact line and kind (CUDA tensor / Python object / CPU tensor), ~1 MiB or more per step, found by the
    exact allocated-bytes series (GPU) or RSS (the CPU cache, the dict);
  - the healthy scripts (Adam's state at step 1, a warm-up cache) on CUDA: no finding, no warning, no probe;
  - HF GPT-2 (GPT2Config, small, no network) with `gradient_checkpointing_enable()` that trains and, each
    step, sums an evaluation loss computed with autograd on (`total_val = total_val + val.loss`: every
    evaluation graph stays alive on the GPU): growth seen, the probe runs during the training backward passes
    (checkpoint's recompute in backward, through the TorchFunctionMode) and backward still works (finite
    loss, gradients on every parameter), and the leak is named by its line;
  - the same GPT-2 leak under `torchmem run`: the profile's report lists it (JSON `leaks`);
  - `bench/leaks.py --device cuda` printed (INFO: the numbers for docs/benchmarks.md; `-k "not bench"` skips it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from leak_cases import HEALTHY, KIND, LEAKY, leak_line, parse, source

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20


def run(cmd: list[str], cwd: str | Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, TORCHMEM_PYTHON=sys.executable)
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


GPT2 = """
import json, sys
import torch
import torchmem
from transformers import GPT2Config, GPT2LMHeadModel

torch.manual_seed(0)
cfg = GPT2Config(n_layer=4, n_head=4, n_embd=256, vocab_size=2048, n_positions=256)
model = GPT2LMHeadModel(cfg).cuda()
model.gradient_checkpointing_enable()
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
mon = torchmem.Monitor(model, opt, verbose=False)
total_val = 0.0
grads_ok = True
for step in range(30):
    with mon.step():
        ids = torch.randint(0, 2048, (8, 256), device="cuda")
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        grads_ok = grads_ok and all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
        opt.step()
        opt.zero_grad()
        val = model(input_ids=ids[:2], labels=ids[:2])
        total_val = total_val + val.loss  # LEAK
print("LEAKS " + json.dumps(mon.leaks()))
print("PROBES " + str(len(mon._leaks.reports) + mon._leaks.probing))
print("GRADS " + json.dumps({"ok": bool(grads_ok), "loss": float(out.loss)}))
"""


def gpt2_line() -> int:
    return next(n for n, t in enumerate(GPT2.splitlines(), 1) if t.rstrip().endswith("# LEAK"))


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch

    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}", flush=True)
    return tmp_path_factory.mktemp("tm-gpu-leaks")


@pytest.mark.parametrize("case", LEAKY + HEALTHY)
def test_leak_case_on_cuda(case: str, work: Path) -> None:
    path = work / f"{case}.py"
    path.write_text(source(case))
    proc = run([sys.executable, str(path), "cuda", "32"], work)
    assert proc.returncode == 0, f"{case} (cuda): exit {proc.returncode}: {proc.stderr[-800:]}"
    leaks, probes = parse(proc.stdout)
    if case in HEALTHY:
        ok = not leaks and probes == 0 and "MemoryGrowthWarning" not in proc.stderr
        assert ok, f"{case} (cuda): findings {len(leaks)}, probes {probes}"
        return
    top = leaks[0] if leaks else {}
    want = (f"{case}.py", leak_line(case), KIND[case][1])
    got = (os.path.basename(top.get("file", "")), top.get("line"), top.get("kind"))
    ok = got == want and top.get("per_step_bytes", 0) >= MIB // 2 and probes == 1
    if case == "total_loss":
        ok = ok and top.get("holds_graph") is True and top.get("device", "").startswith("cuda")
    detail = f"want {want}, got {got}, {top.get('per_step_bytes')} B/step: {top.get('message')}"
    print(f"{case} (cuda): {detail}")
    assert ok, f"{case} (cuda): {detail} (probes {probes}, holds_graph {top.get('holds_graph')})"


@pytest.fixture(scope="module")
def gpt2_script(work: Path) -> Path:
    path = work / "gpt2_leak.py"
    path.write_text(textwrap.dedent(GPT2))
    return path


@pytest.fixture(scope="module")
def gpt2_run(gpt2_script: Path, work: Path) -> tuple[list, int, dict]:
    """The checkpointed GPT-2 with its evaluation-loss leak, run once: (leaks, probes, grads)."""
    proc = run([sys.executable, str(gpt2_script)], work)
    if proc.returncode != 0:
        pytest.fail(f"gpt2 checkpointed, probe in backward: exit {proc.returncode}: {proc.stderr[-1500:]}")
    leaks, probes = parse(proc.stdout)
    grads = json.loads(next(ln[6:] for ln in proc.stdout.splitlines() if ln.startswith("GRADS ")))
    return leaks, probes, grads


def test_gpt2_checkpointed_backward_works_while_probed(gpt2_run: tuple[list, int, dict]) -> None:
    _, probes, grads = gpt2_run
    assert grads["ok"] and probes >= 1, f"gpt2 checkpointed, backward works while probed: {grads}, probes {probes}"


def test_gpt2_checkpointed_leak_named(gpt2_run: tuple[list, int, dict]) -> None:
    leaks, _, _ = gpt2_run
    top = leaks[0] if leaks else {}
    named = (os.path.basename(top.get("file", "")), top.get("line")) == ("gpt2_leak.py", gpt2_line())
    print(top.get("message"))
    assert named and top.get("holds_graph") is True, (
        f"gpt2 checkpointed, leak named: want gpt2_leak.py:{gpt2_line()} holding a graph, got "
        f"{top.get('file')}:{top.get('line')} holds_graph {top.get('holds_graph')}: {top.get('message')}"
    )


def test_gpt2_under_torchmem_run_report_lists_the_leak(gpt2_script: Path, work: Path) -> None:
    prof = work / "gpt2.sqlite"
    proc = run(
        [sys.executable, "-m", "torchmem", "run", "-q", "-o", str(prof), "--", sys.executable, str(gpt2_script)], work
    )
    rep = run([sys.executable, "-m", "torchmem", "report", "--format", "json", str(prof)], work)
    try:
        data = json.loads(rep.stdout)
        lines = [(os.path.basename(f["file"]), f["line"]) for f in data.get("leaks", [])]
    except ValueError:
        lines = []
    assert proc.returncode == 0 and ("gpt2_leak.py", gpt2_line()) in lines, (
        f"gpt2 under torchmem run, report lists the leak: run exit {proc.returncode}, report leaks {lines} "
        f"{rep.stderr[-300:]} {proc.stderr[-1000:] if proc.returncode else ''}"
    )


def test_bench_leaks_info(work: Path, record_property) -> None:  # noqa: ANN001 - pytest's fixture
    """What the detector costs on the GPU (bench/leaks.py; numbers for docs/benchmarks.md, not a pass/fail)."""
    bench = run([sys.executable, str(ROOT / "bench" / "leaks.py"), "--device", "cuda", "--blocks", "4"], work)
    text = bench.stdout + bench.stderr[-500:]
    print("INFO bench/leaks.py --device cuda --blocks 4:\n" + text, flush=True)
    record_property("bench_leaks", text)
