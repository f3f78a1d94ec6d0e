"""Tests of torchmem.integrations.lightning.TorchmemCallback with real Lightning training a tiny model on the CPU,
once per namespace (`lightning.pytorch`, `pytorch_lightning`), each in its own process: the phases and steps
the Monitor saw, the bytes logged through a real CSVLogger, a real allocator failure's post-mortem, and that
a callback for one namespace never imports (or mixes with) the other."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

MIB = 1 << 20

SCRIPT = """
import importlib, json, sys, types
import torch

NS = sys.argv[1]
OUT = sys.argv[2]
if NS == "pytorch_lightning":
    # A library imported the other namespace behind the user's back: the callback must still pick the user's.
    importlib.import_module("lightning.pytorch")
    import pytorch_lightning as pl
    from pytorch_lightning.loggers import CSVLogger
else:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger
from torchmem.integrations.lightning import TorchmemCallback

FAIL_AT = int(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3] != "sinks" else -1
SINKS = sys.argv[3:] == ["sinks"]
if SINKS:  # the user's own W&B (offline) and MLflow (file store) runs, no Lightning logger for them
    import mlflow, wandb
    wandb.init(project="torchmem-test")
    mlflow.start_run()


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))

    def training_step(self, batch, batch_idx):
        if batch_idx == FAIL_AT:
            torch.empty(1 << 50, dtype=torch.uint8)  # 1 PiB: the real CPU allocator refuses
        scratch = torch.ones(32 << 20)  # 128 MiB only while the forward runs
        del scratch
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


ds = torch.utils.data.TensorDataset(torch.randn(32, 64), torch.randn(32, 1))
dl = torch.utils.data.DataLoader(ds, batch_size=8)
cb = TorchmemCallback(sinks="auto" if SINKS else None)
trainer = pl.Trainer(
    accelerator="cpu", max_epochs=2, limit_train_batches=4, limit_val_batches=2, log_every_n_steps=2,
    logger=CSVLogger(OUT, name="run"), callbacks=[cb], default_root_dir=OUT,
    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
)
error = None
try:
    trainer.fit(Tiny(), dl, dl)
except RuntimeError as e:
    error = str(e).splitlines()[0]
other_imported = sorted(m for m in ("lightning", "pytorch_lightning") if m in sys.modules)
tracked = {}
if SINKS:
    run_id = mlflow.active_run().info.run_id
    client = mlflow.tracking.MlflowClient()
    tracked = {
        "mlflow": [(m.step, m.value) for m in client.get_metric_history(run_id, "torchmem/forward_peak_rss_bytes")],
        "mlflow_artifacts": sorted(a.path for a in client.list_artifacts(run_id, "torchmem")),
        "sinks": [s.name for s in cb._sinks],
    }
    mlflow.end_run()
    wandb.finish()

# Both names imported, the caller refers to both: it must say which, not guess.
both = types.ModuleType("both")
both.__dict__.update(lightning=importlib.import_module("lightning.pytorch"),
                     pytorch_lightning=importlib.import_module("pytorch_lightning"))
try:
    exec("from torchmem.integrations.lightning import TorchmemCallback; TorchmemCallback()", both.__dict__)
    ambiguous = None
except ValueError as e:
    ambiguous = str(e)

print(json.dumps({
    "bases": [f"{c.__module__}.{c.__qualname__}" for c in type(cb).__mro__],
    "other_imported": other_imported,
    "summary": cb.monitor.to_dict(),
    "summary_text": cb.monitor.summary(),
    "logged": cb.logged,
    "post_mortem": cb.post_mortem,
    "error": error,
    "ambiguous": ambiguous,
    "tracked": tracked,
    "report_files": cb.report_files,
}))
"""


def run_lightning(tmp_path: Path, namespace: str, *extra: str, env: dict | None = None) -> dict:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    proc = subprocess.run(
        [sys.executable, str(script), namespace, str(tmp_path / "out"), *extra],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    data["stderr"] = proc.stderr
    return data


def metrics_rows(tmp_path: Path) -> list[dict]:
    (path,) = (tmp_path / "out").glob("run/version_*/metrics.csv")
    with open(path) as f:
        return [r for r in csv.DictReader(f) if r.get("torchmem/rss_bytes")]


@pytest.mark.parametrize("namespace", ["lightning.pytorch", "pytorch_lightning"])
def test_callback_in_each_namespace(tmp_path, namespace):
    data = run_lightning(tmp_path, namespace)
    assert data["error"] is None
    # Built on the namespace in use, never the other Callback.
    other = "pytorch_lightning" if namespace == "lightning.pytorch" else "lightning.pytorch"
    assert any(b.startswith(namespace + ".") and b.endswith(".Callback") for b in data["bases"]), data["bases"]
    assert not any(b.startswith(other + ".") for b in data["bases"]), data["bases"]
    if namespace == "lightning.pytorch":
        assert data["other_imported"] == ["lightning"]  # the callback did not import pytorch_lightning
    assert "both lightning.pytorch and pytorch_lightning are imported" in data["ambiguous"]

    # 2 epochs x 4 batches: a step per batch and each phase once per step; validation outside sanity checks.
    summary = data["summary"]
    phases = {p["name"]: p for p in summary["phases"]}
    assert summary["steps"] == 8
    assert [phases[n]["count"] for n in ("forward", "backward", "optimizer step")] == [8, 8, 8]
    assert phases["validation"]["count"] == 4
    assert len(summary["epochs"]) == 2

    # Logged every 2 batches through the real CSVLogger, in bytes, at Lightning's own steps (those of "loss").
    logged = data["logged"]
    assert [step for step, _ in logged] == [1, 3, 5, 7]
    rows = metrics_rows(tmp_path)
    assert [int(r["step"]) for r in rows] == [1, 3, 5, 7]
    for (_, m), row in zip(logged, rows, strict=False):
        assert {k: int(v) for k, v in row.items() if k.startswith("torchmem/") and v} == m
        # The 128 MiB scratch tensor lives only inside the forward phase: its peak, not the backward's. (The
        # margin is what the rest of a step may add to RSS by its end: 9.2 MiB once, with a 64 MiB scratch.)
        assert m["torchmem/forward_peak_rss_bytes"] - m["torchmem/rss_bytes"] >= 112 * MIB, m
        assert m["torchmem/forward_peak_rss_bytes"] - m["torchmem/backward_peak_rss_bytes"] >= 112 * MIB, m
        assert m["torchmem/step_peak_rss_bytes"] >= m["torchmem/forward_peak_rss_bytes"]
        assert not any("allocated" in k for k in m)  # no CUDA: no GPU numbers, never a fake 0

    # The breakdown of the LightningModule and the Trainer's optimizer, at the callback's phases (the summary
    # used to tell a Lightning user to wrap the loop in a Monitor).
    assert "wrap the training loop" not in data["summary_text"]
    assert "end of optimizer step" in data["summary_text"]
    rows = {r["boundary"]: r["categories"] for r in summary["breakdown"]["boundaries"]}
    assert list(rows) == ["step start", "end of forward", "end of backward", "end of optimizer step"]
    params = (64 * 256 + 256 + 256 + 1) * 4
    assert all(c["parameters"]["max_bytes"] == params for c in rows.values())
    assert rows["end of backward"]["gradients"]["max_bytes"] == params
    assert rows["end of optimizer step"]["optimizer_state"]["max_bytes"] == params  # SGD's momentum buffers
    # What autograd saved: the ReLU's output (Linear 2 saves the same storage) and the net's output (mse_loss).
    assert rows["end of forward"]["activations"]["max_bytes"] == 8 * 256 * 4 + 8 * 1 * 4
    assert rows["end of forward"]["inputs"]["max_bytes"] == 8 * 64 * 4 + 8 * 4  # the batch (x, y)


def test_out_of_memory_writes_a_post_mortem(tmp_path):
    data = run_lightning(tmp_path, "lightning.pytorch", "2")
    assert "DefaultCPUAllocator: can't allocate memory" in data["error"]
    path = Path(data["post_mortem"])
    assert path.parent == tmp_path / "out" / "torchmem"
    text = path.read_text()
    assert "torchmem out-of-memory post-mortem (lightning" in text
    assert "at step 2, batch 2, phase forward (after 2 finished steps)" in text
    assert "DefaultCPUAllocator: can't allocate memory" in text
    assert "forward" in text and "Phases" in text  # the Monitor's tables of the steps before it
    report = json.loads(path.with_suffix(".json").read_text())
    assert report["context"]["phase"] == "forward" and report["context"]["batch_idx"] == 2
    assert report["monitor"]["steps"] == 3  # two finished, the failing one still open
    assert f"post-mortem in {path}" in data["stderr"]


def test_sinks_log_to_the_users_wandb_and_mlflow_runs(tmp_path):
    """`sinks="auto"`: the scalars go straight to the active W&B run (along torchmem/step, never `step=`) and
    MLflow run, and the report files are uploaded to both at the end of training."""
    import os

    from wandb_records import read_run

    env = dict(
        os.environ,
        WANDB_MODE="offline",
        WANDB_DIR=str(tmp_path),
        WANDB_SILENT="true",
        MLFLOW_TRACKING_URI=f"file://{tmp_path}/mlruns",
        MLFLOW_ALLOW_FILE_STORE="true",
    )
    data = run_lightning(tmp_path, "lightning.pytorch", "sinks", env=env)
    tracked = data["tracked"]
    assert tracked["sinks"] == ["wandb", "mlflow"]
    logged = {step: m["torchmem/forward_peak_rss_bytes"] for step, m in data["logged"]}
    assert sorted(logged) == [1, 3, 5, 7]
    assert tracked["mlflow"] == [[s, float(v)] for s, v in sorted(logged.items())]
    assert tracked["mlflow_artifacts"] == ["torchmem/torchmem-monitor.html", "torchmem/torchmem-monitor.json"]
    wb = read_run(str(tmp_path / "wandb"))
    assert ("torchmem/step", "", "") in wb["metrics"] and ("", "torchmem/*", "torchmem/step") in wb["metrics"]
    rows = [r for r in wb["history"] if "torchmem/step" in r]
    assert {r["torchmem/step"]: r["torchmem/forward_peak_rss_bytes"] for r in rows} == logged
    assert ("torchmem", "torchmem-report", ["torchmem-monitor.html", "torchmem-monitor.json"]) in wb["artifacts"]
