"""Tests of torchmem.integrations.transformers with a real Hugging Face Trainer training a tiny GPT-2 (built from
a config: nothing downloaded) on the CPU: steps, phases and bytes in the logs, `attach` putting the callback
before the reporters' slot, the post-mortem of a real allocator failure, and `find_executable_batch_size` under
a real address-space limit (a child process with RLIMIT_AS)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torchmem.integrations.transformers import TorchmemCallback, attach
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

MIB = 1 << 20


class Probe(TrainerCallback):
    """Stands where the `report_to` reporters stand (between DefaultFlowCallback and user callbacks) and keeps
    what they would receive."""

    def __init__(self) -> None:
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def tiny_trainer(tmp_path: Path, probe: Probe, fail_at_forward: int = -1) -> Trainer:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=128, n_positions=32, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    calls = {"n": 0}

    def scratch(module, args, output):
        # 64 MiB that lives only inside each forward: the step's peak must see it.
        calls["n"] += 1
        if calls["n"] == fail_at_forward:
            torch.empty(1 << 50, dtype=torch.uint8)  # 1 PiB: the real CPU allocator refuses
        x = torch.ones(16 << 20)
        del x

    model.register_forward_hook(scratch)
    data = [{"input_ids": torch.randint(0, 128, (16,)), "labels": torch.randint(0, 128, (16,))} for _ in range(32)]
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=6,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        logging_steps=2,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
    )
    return Trainer(model=model, args=args, train_dataset=data, callbacks=[probe])


def test_callback_steps_phases_and_logged_bytes(tmp_path):
    probe = Probe()
    trainer = tiny_trainer(tmp_path, probe)
    cb = TorchmemCallback()
    trainer.add_callback(cb)  # as a user would: after the reporters' slot...
    names = [type(c).__name__ for c in trainer.callback_handler.callbacks]
    assert names.index("Probe") < names.index("TorchmemCallback")
    assert attach(trainer, cb) is cb  # ...attach moves it in front of them
    names = [type(c).__name__ for c in trainer.callback_handler.callbacks]
    assert names[:3] == ["DefaultFlowCallback", "TorchmemCallback", "Probe"]
    trainer.train()

    summary = cb.monitor.to_dict()
    phases = {p["name"]: p for p in summary["phases"]}
    # 6 update steps of 2 micro-batches: a step per update, forward/backward per micro-batch.
    assert summary["steps"] == 6
    assert phases["forward"]["count"] == 12 and phases["backward"]["count"] == 12
    assert phases["optimizer step"]["count"] == 6
    assert len(summary["epochs"]) == 2

    train_logs = [log for log in probe.logs if "loss" in log]
    assert len(train_logs) == 3  # logging_steps=2 over 6 steps
    assert [step for step, _ in cb.logged] == [2, 4, 6]
    for log, (_, mine) in zip(train_logs, cb.logged, strict=False):
        assert {k: v for k, v in log.items() if k.startswith("torchmem/")} == mine  # the reporters' slot saw them
        assert all(isinstance(v, int) for v in mine.values())
        assert mine["torchmem/step_peak_rss_bytes"] - mine["torchmem/rss_bytes"] >= 56 * MIB, mine
        assert not any("allocated" in k for k in mine)  # CPU: no GPU numbers, never a fake 0
    history = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["torchmem/step_peak_rss_bytes"] for h in history] == [
        m["torchmem/step_peak_rss_bytes"] for _, m in cb.logged
    ]


def state_storage_bytes(optimizer) -> int:
    """The bytes of an optimizer's state, each storage once (as the breakdown counts)."""
    seen = {}
    for st in optimizer.state.values():
        for v in st.values():
            if torch.is_tensor(v):
                s = v.untyped_storage()
                seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def test_breakdown_measures_the_trainers_optimizer(tmp_path):
    """The Trainer creates its AdamW inside `train()`, after `attach`: the breakdown finds it and measures its
    state (the probe saw "optimizer state 0 B" while AdamW held 4.3 MB), and the optimizer step's end is a
    boundary of its own."""
    trainer = tiny_trainer(tmp_path, Probe())
    cb = attach(trainer)
    trainer.train()
    want = state_storage_bytes(trainer.optimizer)
    assert want > 2 * sum(p.numel() * p.element_size() for p in trainer.model.parameters())  # exp_avg + exp_avg_sq

    rows = {r["boundary"]: r for r in cb.monitor.to_dict()["breakdown"]["boundaries"]}
    assert list(rows) == ["step start", "end of forward", "end of backward", "end of optimizer step"]
    assert rows["end of optimizer step"]["categories"]["optimizer_state"]["max_bytes"] == want
    assert rows["end of backward"]["categories"]["optimizer_state"]["max_bytes"] == want  # read after each step
    # Before the first step AdamW holds nothing yet: a measured 0 there, the full state after.
    assert rows["step start"]["categories"]["optimizer_state"]["mean_bytes"] < want
    last = cb.monitor.breakdown()
    (opt_end,) = [b for b in last["boundaries"] if b["boundary"] == "end of optimizer step"]
    assert opt_end["breakdown"][-1]["optimizer_state_bytes"] == want
    text = cb.monitor.summary()
    assert "end of optimizer step" in text and "wrap the training loop" not in text


def test_out_of_memory_in_train_writes_a_post_mortem(tmp_path, capsys):
    probe = Probe()
    trainer = tiny_trainer(tmp_path, probe, fail_at_forward=5)  # the first micro-batch of update step 3
    cb = attach(trainer)
    with pytest.raises(RuntimeError, match="DefaultCPUAllocator: can't allocate memory"):
        trainer.train()
    path = Path(cb.post_mortem)
    assert path.parent == tmp_path / "out" / "torchmem"
    text = path.read_text()
    assert "torchmem out-of-memory post-mortem (transformers" in text
    assert "at step 2, phase - (after 2 finished steps)" in text
    assert "Phases" in text and "forward" in text
    report = json.loads(path.with_suffix(".json").read_text())
    assert report["context"]["global_step"] == 2 and report["exception"]["type"] == "RuntimeError"
    assert f"post-mortem in {path}" in capsys.readouterr().err


FIND_BS = """
import json, resource, torch
from torchmem.integrations.batch_size import find_executable_batch_size

torch.ones(1024).sum()  # start torch's threads before the cap
with open("/proc/self/status") as f:
    vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
cap = vm + 320 * (1 << 20)
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

@find_executable_batch_size(starting_batch_size=128)
def train(batch_size):
    x = torch.ones(batch_size, 1 << 20)  # 4 MiB per sample, touched
    return float(x[0, 0]) * batch_size

result = train()
import sys
print(json.dumps({"result": result, "attempts": [a.__dict__ for a in train.attempts],
                  "frameworks": sorted(m for m in ("transformers", "lightning", "accelerate") if m in sys.modules),
                  "text": [str(a) for a in train.attempts]}))
"""


def test_find_executable_batch_size_records_every_try(tmp_path):
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(FIND_BS)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    assert data["frameworks"] == []  # framework-free
    attempts = data["attempts"]
    sizes = [a["batch_size"] for a in attempts]
    assert sizes[0] == 128 and sizes == sorted(sizes, reverse=True)
    assert all(b == min(int(a * 0.9), a - 1) for a, b in zip(sizes, sizes[1:], strict=False))  # accelerate's ×0.9
    assert [a["ok"] for a in attempts] == [False] * (len(attempts) - 1) + [True]
    last = attempts[-1]
    assert data["result"] == float(last["batch_size"])
    assert 4 * MIB * last["batch_size"] <= 320 * MIB  # it fits under the cap...
    assert last["peak_rss_bytes"] is not None
    for failed in attempts[:-1]:
        assert "DefaultCPUAllocator: can't allocate memory" in failed["error"]
        assert 4 * MIB * failed["batch_size"] > 200 * MIB  # ...and the ones that failed were too big
    assert "out of memory" in data["text"][0] and "batch size 128" in data["text"][0]


TRACKED = """
import json, sys, torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from torchmem.integrations.transformers import attach

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=128, n_positions=32,
                                   bos_token_id=0, eos_token_id=0))
data = [{"input_ids": torch.randint(0, 128, (16,)), "labels": torch.randint(0, 128, (16,))} for _ in range(16)]
args = TrainingArguments(output_dir=sys.argv[1], max_steps=4, per_device_train_batch_size=4, logging_steps=2,
                         report_to=["wandb", "mlflow"], use_cpu=True, save_strategy="no", disable_tqdm=True)
trainer = Trainer(model=model, args=args, train_dataset=data)
cb = attach(trainer, sinks="auto")
trainer.train()
import mlflow, wandb
run = mlflow.last_active_run()
client = mlflow.tracking.MlflowClient()
history = client.get_metric_history(run.info.run_id, "torchmem/step_peak_rss_bytes")
artifacts = [a.path for a in client.list_artifacts(run.info.run_id, "torchmem")]
wandb.finish()
print(json.dumps({"logged": cb.logged, "report_files": cb.report_files,
                  "mlflow": [(m.step, m.value) for m in history], "mlflow_artifacts": artifacts,
                  "sinks": [s.name for s in cb._sinks], "metric_sinks": [s.name for s in cb._metric_sinks]}))
"""


def test_reporters_wandb_and_mlflow_get_the_scalars_and_the_report(tmp_path):
    """Real W&B (offline) and MLflow (a file store) reporters of the Trainer: after `attach`, the scalars reach
    both through `report_to` (once each), and the report files are uploaded as artifacts to both."""
    import os

    from wandb_records import read_run

    env = dict(
        os.environ,
        WANDB_MODE="offline",
        WANDB_DIR=str(tmp_path),
        WANDB_SILENT="true",
        WANDB_PROJECT="torchmem-test",
        MLFLOW_TRACKING_URI=f"file://{tmp_path}/mlruns",
        MLFLOW_ALLOW_FILE_STORE="true",
    )
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(TRACKED), str(tmp_path / "out")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    assert data["sinks"] == ["wandb", "mlflow"] and data["metric_sinks"] == []  # the reporters carry the scalars
    logged = {step: m["torchmem/step_peak_rss_bytes"] for step, m in data["logged"]}
    assert sorted(logged) == [2, 4]
    # MLflow: one value per logging step, the callback's own numbers.
    assert sorted(data["mlflow"]) == [[s, float(v)] for s, v in sorted(logged.items())]
    assert sorted(data["mlflow_artifacts"]) == ["torchmem/torchmem-monitor.html", "torchmem/torchmem-monitor.json"]
    # W&B: the Trainer's reporter rows carry them (it prefixes "train/"), at the Trainer's step.
    wb = read_run(str(tmp_path / "wandb"))
    rows = {r["train/global_step"]: r for r in wb["history"] if "train/torchmem/step_peak_rss_bytes" in r}
    assert {s: r["train/torchmem/step_peak_rss_bytes"] for s, r in rows.items()} == logged
    assert ("torchmem", "torchmem-report", ["torchmem-monitor.html", "torchmem-monitor.json"]) in wb["artifacts"]
    html = Path(next(p for p in data["report_files"] if p.endswith(".html"))).read_text()
    assert "Phases" in html and "<script" not in html
