"""GPU check of torchmem's integrations on a real NVIDIA GPU (written for an H200; Lightning, transformers and
pytest installed): the Lightning and Hugging Face callbacks, the pytest plugin's CUDA markers and the Jupyter
`%tmemit` measurement, each against torch's own counters.

How the callbacks are checked: the same tiny, seeded training runs twice in fresh processes — once with only
a probe callback that calls `torch.cuda.reset_peak_memory_stats()` at each boundary (step start, end of
forward, end of backward, optimizer start) and reads `torch.cuda.max_memory_allocated()` /
`max_memory_reserved()` at the next one, once with only torchmem's callback. The allocator's sequence is the
same in both (torchmem allocates no GPU memory), so every step's and phase's peak must be equal to the byte.
Plus: a real CUDA out-of-memory error writes the post-mortem with the allocator's report; nothing here creates
a CUDA context before the program does.

    python scripts/gpu_check_integrations.py             # every check
    python scripts/gpu_check_integrations.py lightning   # the checks whose name contains "lightning"

Prints one PASS/FAIL line per check and exits non-zero when any check fails.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import tempfile
import textwrap
import traceback
from pathlib import Path

MIB = 1 << 20
FAILURES: list[str] = []
ROOT = Path(__file__).resolve().parent.parent


def report(ok: bool, name: str, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        FAILURES.append(name)


def check(func):
    """Runs one check; an exception is a FAIL line, never the end of the script."""

    @functools.wraps(func)
    def run() -> None:
        try:
            func()
        except Exception as e:  # noqa: BLE001 - one failing check must not stop the others
            report(False, func.__name__, f"raised {type(e).__name__}: {e}")
            traceback.print_exc()

    return run


def child(code: str, *args: str, env: dict | None = None, timeout: float = 600) -> dict:
    """Runs `code` in a fresh Python; its last stdout line is JSON."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=str(ROOT),
    )
    if proc.returncode != 0:
        raise RuntimeError(f"child failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- Lightning ----------------------------------------------------------------------------------------------

LIGHTNING = r"""
import json, sys
import torch
import lightning.pytorch as pl

MODE, OUT = sys.argv[1], sys.argv[2]
torch.manual_seed(0)

class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024))
    def training_step(self, batch, batch_idx):
        if MODE == "oom" and batch_idx == 2:
            free, total = torch.cuda.mem_get_info()
            torch.empty(2 * total, dtype=torch.uint8, device="cuda")  # a real CUDA out-of-memory error
        (x,) = batch
        return self.net(x).square().mean()
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters())

class Probe(pl.Callback):
    # torch's own peaks over the same windows as torchmem's callback
    def __init__(self):
        self.steps, self.phase, self.open = [], {}, None
    def _cut(self, next_name):
        if self.open is not None:
            self.phase.setdefault(self.open, []).append(torch.cuda.max_memory_allocated())
        self.open = next_name
        torch.cuda.reset_peak_memory_stats()
    def on_train_batch_start(self, trainer, m, batch, i):
        self.step_peak = 0
        self._cut("forward")
    def on_before_backward(self, trainer, m, loss):
        self.step_peak = max(self.step_peak, torch.cuda.max_memory_allocated()); self._cut("backward")
    def on_after_backward(self, trainer, m):
        self.step_peak = max(self.step_peak, torch.cuda.max_memory_allocated()); self._cut(None)
    def on_before_optimizer_step(self, trainer, m, opt):
        self.step_peak = max(self.step_peak, torch.cuda.max_memory_allocated()); self._cut("optimizer_step")
    def on_train_batch_end(self, trainer, m, out, batch, i):
        self.step_peak = max(self.step_peak, torch.cuda.max_memory_allocated())
        self._cut(None)
        self.steps.append(self.step_peak)

x = torch.randn(64, 1024)
dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=16)
if MODE == "probe":
    cb = Probe()
else:
    from torchmem.integrations.lightning import TorchmemCallback
    cb = TorchmemCallback(every_n_steps=1)
assert not torch.cuda.is_initialized(), "something created a CUDA context before the Trainer"
from lightning.pytorch.loggers import CSVLogger
trainer = pl.Trainer(accelerator="gpu", devices=1, max_epochs=1, logger=CSVLogger(OUT), callbacks=[cb],
                     default_root_dir=OUT, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False)
error = None
try:
    trainer.fit(Tiny(), dl)
except torch.OutOfMemoryError as e:
    error = str(e).splitlines()[0]
if MODE == "probe":
    print(json.dumps({"steps": cb.steps, "phases": cb.phase}))
else:
    print(json.dumps({"logged": cb.logged, "post_mortem": cb.post_mortem, "error": error,
                      "summary": cb.monitor.to_dict()["phases"]}))
"""


@check
def lightning_peaks_equal_torch():
    with tempfile.TemporaryDirectory() as tmp:
        ref = child(LIGHTNING, "probe", tmp)
        got = child(LIGHTNING, "torchmem", tmp)
    mine = [m for _, m in got["logged"]]
    steps = [m.get("torchmem/step_peak_allocated_bytes") for m in mine]
    report(steps == ref["steps"], "lightning: step peak allocated = torch's", f"torchmem {steps} torch {ref['steps']}")
    for phase in ("forward", "backward", "optimizer_step"):
        ours = [m.get(f"torchmem/{phase}_peak_allocated_bytes") for m in mine]
        report(
            ours == ref["phases"][phase],
            f"lightning: {phase} peak allocated = torch's",
            f"torchmem {ours} torch {ref['phases'][phase]}",
        )
    keys = sorted(mine[0]) if mine else []
    report(
        all(isinstance(v, int) for m in mine for v in m.values()) and "torchmem/reserved_bytes" in keys,
        "lightning: logged bytes (ints) with GPU keys",
        f"{keys}",
    )


@check
def lightning_oom_post_mortem():
    with tempfile.TemporaryDirectory() as tmp:
        got = child(LIGHTNING, "oom", tmp)
        text = Path(got["post_mortem"]).read_text() if got["post_mortem"] else ""
        allocator_report = "Allocator report written at the failing allocation" in text
    report(
        got["error"] is not None and "out of memory" in got["error"] and "phase forward" in text and allocator_report,
        "lightning: CUDA OOM writes the post-mortem with the allocator's report",
        f"error {got['error']!r}; post-mortem {got['post_mortem']}; allocator report {allocator_report}",
    )


# --- Hugging Face -------------------------------------------------------------------------------------------

HF = r"""
import json, sys
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

MODE, OUT = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=4, n_embd=256, vocab_size=1024, n_positions=128,
                                   bos_token_id=0, eos_token_id=0))
data = [{"input_ids": torch.randint(0, 1024, (128,)), "labels": torch.randint(0, 1024, (128,))} for _ in range(32)]

class Probe(TrainerCallback):
    def __init__(self):
        self.steps = []
    def on_step_begin(self, args, state, control, **kw):
        torch.cuda.reset_peak_memory_stats()
    def on_step_end(self, args, state, control, **kw):
        self.steps.append(torch.cuda.max_memory_allocated())

args = TrainingArguments(output_dir=OUT, max_steps=4, per_device_train_batch_size=8, logging_steps=1,
                         gradient_accumulation_steps=2, report_to="none", save_strategy="no", disable_tqdm=True,
                         dataloader_pin_memory=False)
trainer = Trainer(model=model, args=args, train_dataset=data)
if MODE == "probe":
    cb = Probe()
    trainer.add_callback(cb)
else:
    from torchmem.integrations.transformers import attach
    cb = attach(trainer)
trainer.train()
if MODE == "probe":
    print(json.dumps({"steps": cb.steps}))
else:
    print(json.dumps({"steps": [m.get("torchmem/step_peak_allocated_bytes") for _, m in cb.logged],
                      "phases": cb.monitor.to_dict()["phases"]}))
"""


@check
def hf_step_peaks_equal_torch():
    with tempfile.TemporaryDirectory() as tmp:
        ref = child(HF, "probe", tmp)
        got = child(HF, "torchmem", tmp)
    report(
        got["steps"] == ref["steps"] and len(got["steps"]) == 4,
        "transformers: update-step peak allocated = torch's",
        f"torchmem {got['steps']} torch {ref['steps']}",
    )
    counts = {p["name"]: p["count"] for p in got["phases"]}
    report(
        counts.get("forward") == 8 and counts.get("backward") == 8 and counts.get("optimizer step") == 4,
        "transformers: forward/backward per micro-batch, optimizer per update",
        f"{counts}",
    )


# --- pytest plugin on CUDA -----------------------------------------------------------------------------------

PYTEST_FILE = """
import pytest, torch

KEEP = []

def big(n_mib):
    return torch.ones(n_mib * (1 << 20) // 4, device="cuda")

@pytest.mark.limit_memory("100 MiB")
def test_over():
    x = big(256)
    del x

@pytest.mark.limit_memory("100 MiB", kind="reserved")
def test_under():
    x = big(64)
    del x

@pytest.mark.limit_leaks("16 MiB")
def test_leaks():
    KEEP.append(big(64))
"""


@check
def pytest_plugin_cuda():
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "test_gpu_limits.py").write_text(PYTEST_FILE)
        # Where torchmem is not pip-installed (PYTHONPATH=python), its pytest11 entry point is not there either.
        from importlib.metadata import entry_points

        installed = any(ep.value == "torchmem.pytest_plugin" for ep in entry_points(group="pytest11"))
        load = [] if installed else ["-p", "torchmem.pytest_plugin"]
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *load, tmp],
            capture_output=True,
            text=True,
            timeout=600,
        )
    out = proc.stdout
    report(
        "2 failed, 1 passed" in out and "MEMORY LIMIT" in out,
        "pytest: CUDA limits fail/pass as measured",
        out.strip().splitlines()[-1] if out.strip() else proc.stderr[-500:],
    )
    over_ok = "peak allocated 256.00 MiB" in out or "256.00 MiB above" in out
    report(over_ok, "pytest: the 256 MiB peak is reported exactly", "found" if over_ok else out[-2000:])
    sites = "Top allocation sites, cuda" in out and "big" in out
    report(sites, "pytest: CUDA allocation sites from the allocator history", "found" if sites else out[-2000:])
    leak = "64.00 MiB still held" in out
    report(leak, "pytest: the 64 MiB CUDA leak is measured exactly", "found" if leak else out[-2000:])


# --- Jupyter %tmemit on CUDA ----------------------------------------------------------------------------------

MEMIT = r"""
import json, torch
from torchmem._jupyter import memit
torch.cuda.init()
keep = torch.ones(1 << 20, device="cuda")
torch.cuda.reset_peak_memory_stats()
def cell():
    x = torch.ones(64 << 18, device="cuda")  # 64 MiB
    y = x * 2
    del x, y
r = memit(cell, "cuda")
print(json.dumps({"r": r.to_dict(), "torch_peak": torch.cuda.max_memory_allocated(),
                  "torch_reserved_peak": torch.cuda.max_memory_reserved()}))
"""


@check
def jupyter_memit_cuda():
    got = child(MEMIT)
    r = got["r"]
    report(
        r["peak_allocated_bytes"] == got["torch_peak"] and r["peak_reserved_bytes"] == got["torch_reserved_peak"],
        "jupyter: %tmemit peak allocated/reserved = torch's",
        f"torchmem {r['peak_allocated_bytes']}/{r['peak_reserved_bytes']} torch {got['torch_peak']}/"
        f"{got['torch_reserved_peak']}",
    )
    report(
        r["allocated_increment_bytes"] == 128 * MIB,
        "jupyter: %tmemit increment = the cell's 2 x 64 MiB",
        f"{r['allocated_increment_bytes']} B",
    )


NO_CONTEXT = r"""
import json, torch
import torchmem.pytest_plugin as plugin
from torchmem.integrations.lightning import TorchmemCallback
from torchmem.integrations.transformers import TorchmemCallback as HFCallback, find_executable_batch_size
import lightning.pytorch
TorchmemCallback(); HFCallback()
reason = plugin._cuda_skip_reason("cuda")
print(json.dumps({"initialized": torch.cuda.is_initialized(), "skip_reason": reason}))
"""


@check
def no_cuda_context_created():
    got = child(NO_CONTEXT)
    report(
        got["initialized"] is False and got["skip_reason"] is None,
        "integrations create no CUDA context",
        f"torch.cuda.is_initialized() {got['initialized']}, skip reason {got['skip_reason']}",
    )


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("FAIL: no CUDA device: run this on a GPU machine")
        return 1
    # The checks run in children; this process only says where it runs (its own context is not measured).
    print(f"torchmem integrations GPU check (torch {torch.__version__}, {torch.cuda.get_device_name(0)})")
    only = sys.argv[1:]  # optional substrings of check names, e.g. `lightning`
    for c in (
        no_cuda_context_created,
        lightning_peaks_equal_torch,
        lightning_oom_post_mortem,
        hf_step_peaks_equal_torch,
        pytest_plugin_cuda,
        jupyter_memit_cuda,
    ):
        if not only or any(o in c.__name__ for o in only):
            c()
    print(f"\n{len(FAILURES)} failed: {FAILURES}" if FAILURES else "\nall integration GPU checks passed")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
