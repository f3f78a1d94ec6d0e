"""GPU checks of the leak finder (`python/torchmem/_leaks.py`), run standalone on the H200 (torch 2.11, under
2 minutes): `python scripts/gpu_check_leaks.py`.

Each check runs in a fresh child process and prints PASS/FAIL with what it measured; one failing check never
stops the others; the exit code is non-zero when any failed. Checks:
  - the leak scripts of `tests/leak_cases.py` on CUDA: `total_loss += loss` (each step's graph on the GPU),
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
  - then prints `bench/leaks.py --device cuda` (INFO: the numbers for docs/benchmarks.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from leak_cases import HEALTHY, KIND, LEAKY, leak_line, parse, source  # noqa: E402

MIB = 1 << 20
FAILURES: list[str] = []


def check(name: str, ok: bool, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        FAILURES.append(name)


def run(cmd: list[str], cwd: str) -> subprocess.CompletedProcess[str]:
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


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        check("cuda", False, "no CUDA device: run this on the GPU machine")
        return 1
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}", flush=True)
    tmp = tempfile.mkdtemp(prefix="tm-gpu-leaks-")
    for case in LEAKY + HEALTHY:
        path = os.path.join(tmp, f"{case}.py")
        with open(path, "w") as f:
            f.write(source(case))
        proc = run([sys.executable, path, "cuda", "32"], tmp)
        if proc.returncode != 0:
            check(f"{case} (cuda)", False, f"exit {proc.returncode}: {proc.stderr[-800:]}")
            continue
        leaks, probes = parse(proc.stdout)
        if case in HEALTHY:
            ok = not leaks and probes == 0 and "MemoryGrowthWarning" not in proc.stderr
            check(f"{case} (cuda)", ok, f"findings {len(leaks)}, probes {probes}")
            continue
        top = leaks[0] if leaks else {}
        want = (f"{case}.py", leak_line(case), KIND[case][1])
        got = (os.path.basename(top.get("file", "")), top.get("line"), top.get("kind"))
        ok = got == want and top.get("per_step_bytes", 0) >= MIB // 2 and probes == 1
        if case == "total_loss":
            ok = ok and top.get("holds_graph") is True and top.get("device", "").startswith("cuda")
        check(f"{case} (cuda)", ok, f"want {want}, got {got}, {top.get('per_step_bytes')} B/step: {top.get('message')}")
    # Checkpointed GPT-2: the probe must not break backward.
    path = os.path.join(tmp, "gpt2_leak.py")
    with open(path, "w") as f:
        f.write(textwrap.dedent(GPT2))
    proc = run([sys.executable, path], tmp)
    if proc.returncode != 0:
        check("gpt2 checkpointed, probe in backward", False, f"exit {proc.returncode}: {proc.stderr[-1500:]}")
    else:
        leaks, probes = parse(proc.stdout)
        grads = json.loads(next(ln[6:] for ln in proc.stdout.splitlines() if ln.startswith("GRADS ")))
        top = leaks[0] if leaks else {}
        named = (os.path.basename(top.get("file", "")), top.get("line")) == ("gpt2_leak.py", gpt2_line())
        check(
            "gpt2 checkpointed, backward works while probed", grads["ok"] and probes >= 1, f"{grads}, probes {probes}"
        )
        check("gpt2 checkpointed, leak named", named and top.get("holds_graph") is True, str(top.get("message")))
    # The same under torchmem run: the report lists the leak.
    prof = os.path.join(tmp, "gpt2.sqlite")
    proc = run([sys.executable, "-m", "torchmem", "run", "-q", "-o", prof, "--", sys.executable, path], tmp)
    rep = run([sys.executable, "-m", "torchmem", "report", "--format", "json", prof], tmp)
    try:
        data = json.loads(rep.stdout)
        lines = [(os.path.basename(f["file"]), f["line"]) for f in data.get("leaks", [])]
    except ValueError:
        lines = []
    check(
        "gpt2 under torchmem run, report lists the leak",
        proc.returncode == 0 and ("gpt2_leak.py", gpt2_line()) in lines,
        f"run exit {proc.returncode}, report leaks {lines} {rep.stderr[-300:]}",
    )
    # What the detector costs on the GPU (bench/leaks.py; numbers for docs/benchmarks.md, not a pass/fail).
    bench = run([sys.executable, os.path.join(ROOT, "bench", "leaks.py"), "--device", "cuda", "--blocks", "4"], tmp)
    print("INFO bench/leaks.py --device cuda --blocks 4:\n" + bench.stdout + bench.stderr[-500:], flush=True)
    print(f"{'FAIL' if FAILURES else 'PASS'} summary: {len(FAILURES)} failed {FAILURES}", flush=True)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
