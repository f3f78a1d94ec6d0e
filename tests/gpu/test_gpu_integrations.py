"""torchmem's integrations on a real NVIDIA GPU (was scripts/gpu_check_integrations.py; written for an H200 with
Lightning, transformers and pytest installed): the Lightning and Hugging Face callbacks, the pytest plugin's CUDA
markers and the Jupyter `%tmemit` measurement, each against torch's own counters.

How the callbacks are checked: the same tiny, seeded training runs twice in fresh processes -- once with only
a probe callback that calls `torch.cuda.reset_peak_memory_stats()` at each boundary (step start, end of
forward, end of backward, optimizer start) and reads `torch.cuda.max_memory_allocated()` /
`max_memory_reserved()` at the next one, once with only torchmem's callback. The allocator's sequence is the
same in both (torchmem allocates no GPU memory), so every step's and phase's peak must be equal to the byte.
Plus: a real CUDA out-of-memory error writes the post-mortem with the allocator's report; nothing here creates
a CUDA context before the program does. Every scenario runs in children (this process's own context is not
measured), once per module-scoped fixture; each check is a test (`-k lightning` picks the Lightning ones).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

import pytest

MIB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]


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


# --- nothing creates a CUDA context before the program does ---------------------------------------------------

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


def test_integrations_create_no_cuda_context():
    got = child(NO_CONTEXT)
    assert got["initialized"] is False and got["skip_reason"] is None, (
        f"torch.cuda.is_initialized() {got['initialized']}, skip reason {got['skip_reason']}"
    )


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


@pytest.fixture(scope="module")
def lightning(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("lightning")
    ref = child(LIGHTNING, "probe", str(tmp / "probe"))
    got = child(LIGHTNING, "torchmem", str(tmp / "torchmem"))
    return {"ref": ref, "mine": [m for _, m in got["logged"]]}


def test_lightning_step_peak_allocated_equals_torch(lightning: dict) -> None:
    steps = [m.get("torchmem/step_peak_allocated_bytes") for m in lightning["mine"]]
    ref = lightning["ref"]["steps"]
    assert steps == ref, f"lightning: step peak allocated = torch's: torchmem {steps} torch {ref}"


@pytest.mark.parametrize("phase", ["forward", "backward", "optimizer_step"])
def test_lightning_phase_peak_allocated_equals_torch(phase: str, lightning: dict) -> None:
    ours = [m.get(f"torchmem/{phase}_peak_allocated_bytes") for m in lightning["mine"]]
    ref = lightning["ref"]["phases"][phase]
    assert ours == ref, f"lightning: {phase} peak allocated = torch's: torchmem {ours} torch {ref}"


def test_lightning_logged_bytes_ints_with_gpu_keys(lightning: dict) -> None:
    mine = lightning["mine"]
    keys = sorted(mine[0]) if mine else []
    assert all(isinstance(v, int) for m in mine for v in m.values()) and "torchmem/reserved_bytes" in keys, (
        f"lightning: logged bytes (ints) with GPU keys: {keys} {mine}"
    )


def test_lightning_oom_post_mortem(tmp_path: Path) -> None:
    got = child(LIGHTNING, "oom", str(tmp_path))
    text = Path(got["post_mortem"]).read_text() if got["post_mortem"] else ""
    allocator_report = "Allocator report written at the failing allocation" in text
    assert (
        got["error"] is not None and "out of memory" in got["error"] and "phase forward" in text and allocator_report
    ), (
        "lightning: CUDA OOM writes the post-mortem with the allocator's report: "
        f"error {got['error']!r}; post-mortem {got['post_mortem']}; allocator report {allocator_report}\n{text[-2000:]}"
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


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("hf")
    return {"ref": child(HF, "probe", str(tmp / "probe")), "got": child(HF, "torchmem", str(tmp / "torchmem"))}


def test_transformers_update_step_peak_allocated_equals_torch(hf: dict) -> None:
    got, ref = hf["got"], hf["ref"]
    assert got["steps"] == ref["steps"] and len(got["steps"]) == 4, (
        f"transformers: update-step peak allocated = torch's: torchmem {got['steps']} torch {ref['steps']}"
    )


def test_transformers_forward_backward_per_micro_batch_optimizer_per_update(hf: dict) -> None:
    counts = {p["name"]: p["count"] for p in hf["got"]["phases"]}
    assert counts.get("forward") == 8 and counts.get("backward") == 8 and counts.get("optimizer step") == 4, (
        f"transformers: forward/backward per micro-batch, optimizer per update: {counts}"
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


@pytest.fixture(scope="module")
def plugin_run(tmp_path_factory: pytest.TempPathFactory) -> subprocess.CompletedProcess[str]:
    tmp = tmp_path_factory.mktemp("plugin")
    (tmp / "test_gpu_limits.py").write_text(PYTEST_FILE)
    # Where torchmem is not pip-installed (PYTHONPATH=python), its pytest11 entry point is not there either.
    installed = any(ep.value == "torchmem.pytest_plugin" for ep in entry_points(group="pytest11"))
    load = [] if installed else ["-p", "torchmem.pytest_plugin"]
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *load, str(tmp)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(tmp),
    )


def test_pytest_cuda_limits_fail_pass_as_measured(plugin_run: subprocess.CompletedProcess[str]) -> None:
    out = plugin_run.stdout
    assert "2 failed, 1 passed" in out and "MEMORY LIMIT" in out, (
        out.strip().splitlines()[-1] if out.strip() else plugin_run.stderr[-500:]
    )


def test_pytest_the_256_mib_peak_is_reported_exactly(plugin_run: subprocess.CompletedProcess[str]) -> None:
    out = plugin_run.stdout
    assert "peak allocated 256.00 MiB" in out or "256.00 MiB above" in out, out[-2000:]


def test_pytest_cuda_allocation_sites_from_the_allocator_history(plugin_run: subprocess.CompletedProcess[str]) -> None:
    out = plugin_run.stdout
    assert "Top allocation sites, cuda" in out and "big" in out, out[-2000:]


def test_pytest_the_64_mib_cuda_leak_is_measured_exactly(plugin_run: subprocess.CompletedProcess[str]) -> None:
    out = plugin_run.stdout
    assert "64.00 MiB still held" in out, out[-2000:]


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


@pytest.fixture(scope="module")
def memit() -> dict:
    return child(MEMIT)


def test_jupyter_tmemit_peak_allocated_reserved_equal_torch(memit: dict) -> None:
    r = memit["r"]
    assert (
        r["peak_allocated_bytes"] == memit["torch_peak"] and r["peak_reserved_bytes"] == memit["torch_reserved_peak"]
    ), (
        f"jupyter: %tmemit peak allocated/reserved = torch's: torchmem {r['peak_allocated_bytes']}/"
        f"{r['peak_reserved_bytes']} torch {memit['torch_peak']}/{memit['torch_reserved_peak']}"
    )


def test_jupyter_tmemit_increment_is_the_cells_2_x_64_mib(memit: dict) -> None:
    r = memit["r"]
    assert r["allocated_increment_bytes"] == 128 * MIB, (
        f"jupyter: %tmemit increment = the cell's 2 x 64 MiB: {r['allocated_increment_bytes']} B"
    )
