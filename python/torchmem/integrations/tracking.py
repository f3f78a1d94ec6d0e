"""torchmem's scalars and reports into the experiment trackers people already have open: Weights & Biases and
MLflow. Both sinks write to the user's active run (they never start one) and import their tool only when made.

* `WandbSink(run=None)`: the active `wandb.run`. Declares `define_metric("torchmem/step")` and
  `define_metric("torchmem/*", step_metric="torchmem/step")`, then logs `{..., "torchmem/step": step}` with
  **no** `step=` argument: W&B drops any row whose explicit step is lower than one it has seen, so a library
  logging its own step would lose data (or the user's). Artifacts go up as one `wandb.Artifact`.
* `MlflowSink()`: the active MLflow run; `mlflow.log_metrics(metrics, step=step)`, artifacts with
  `mlflow.log_artifact(path, artifact_path="torchmem")`.
* `active_sinks()`: a sink for each tool that is imported and has an active run now.
* `write_report(monitor, directory)`: the Monitor's data (`torchmem-monitor.json`) and its self-contained HTML
  report (`torchmem-monitor.html`), the files the callbacks upload at the end of training (with the profile
  of `torchmem run -o PROFILE` when given).

Their own system metrics (W&B every 15 s, MLflow every 10 s) are device-level NVML numbers; these are
PyTorch's allocator numbers and exact peaks, aligned to the training step.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any


class WandbSink:
    """Logs torchmem scalars to a W&B run (default: the active `wandb.run`) along `torchmem/step`."""

    name = "wandb"

    def __init__(self, run: Any = None, *, prefix: str = "torchmem/") -> None:
        import wandb

        self._wandb = wandb
        self.run = run if run is not None else wandb.run
        if self.run is None:
            raise RuntimeError("WandbSink: no active W&B run; call wandb.init(...) first or pass run=")
        self.prefix = prefix
        self.step_key = f"{prefix}step"
        self.run.define_metric(self.step_key)
        self.run.define_metric(f"{prefix}*", step_metric=self.step_key)

    def log(self, metrics: dict[str, int], step: int) -> None:
        self.run.log({**metrics, self.step_key: int(step)})  # never step=: see the module's docstring

    def log_artifacts(self, paths: Iterable[str | os.PathLike[str]], name: str = "torchmem") -> None:
        files = [Path(p) for p in paths if Path(p).is_file()]
        if not files:
            return
        artifact = self._wandb.Artifact(name, type="torchmem-report")
        for f in files:
            artifact.add_file(str(f))
        self.run.log_artifact(artifact)


class MlflowSink:
    """Logs torchmem scalars and artifacts to the active MLflow run."""

    name = "mlflow"

    def __init__(self) -> None:
        import mlflow

        self._mlflow = mlflow
        if mlflow.active_run() is None:
            raise RuntimeError("MlflowSink: no active MLflow run; call mlflow.start_run() first")

    def log(self, metrics: dict[str, int], step: int) -> None:
        self._mlflow.log_metrics({k: float(v) for k, v in metrics.items()}, step=int(step))

    def log_artifacts(self, paths: Iterable[str | os.PathLike[str]], name: str = "torchmem") -> None:
        for p in paths:
            if Path(p).is_file():
                self._mlflow.log_artifact(str(p), artifact_path=name)


def active_sinks(prefix: str = "torchmem/") -> list[Any]:
    """A sink for W&B and for MLflow when the program imported the tool and a run is active (none is started,
    nothing is imported)."""
    sinks: list[Any] = []
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        sinks.append(WandbSink(prefix=prefix))
    mlflow = sys.modules.get("mlflow")
    if mlflow is not None and hasattr(mlflow, "active_run") and mlflow.active_run() is not None:
        sinks.append(MlflowSink())
    return sinks


def resolve_sinks(sinks: Any, prefix: str = "torchmem/") -> list[Any]:
    """`None` → none; `"auto"` → `active_sinks()`; else the given sink objects (each with `log(metrics,
    step)` and `log_artifacts(paths)`)."""
    if sinks is None:
        return []
    if sinks == "auto":
        return active_sinks(prefix)
    if isinstance(sinks, (list, tuple)):
        for s in sinks:
            if not (callable(getattr(s, "log", None)) and callable(getattr(s, "log_artifacts", None))):
                raise TypeError(f"sinks: {s!r} has no log(metrics, step) / log_artifacts(paths)")
        return list(sinks)
    raise TypeError(f"sinks must be None, 'auto' or a list of sinks (WandbSink(), MlflowSink()), not {sinks!r}")


def write_report(monitor: Any, directory: str | os.PathLike[str]) -> list[Path]:
    """Writes the Monitor's data and its self-contained HTML report to `directory`; returns the two paths."""
    from .._jupyter import monitor_html

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    data_path = directory / "torchmem-monitor.json"
    html_path = directory / "torchmem-monitor.html"
    data = monitor.to_dict()
    data_path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    html_path.write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>torchmem</title></head><body>"
        f"{monitor_html(monitor)}<pre>{_escape(monitor.summary())}</pre></body></html>\n"
    )
    return [data_path, html_path]


def _escape(text: str) -> str:
    import html

    return html.escape(text)


def publish_end(sinks: list[Any], monitor: Any, directory: str | os.PathLike[str], profile: Any = None) -> list[Path]:
    """At the end of training: writes the report files and uploads them (and the profile, if given) to every
    sink. Errors are printed, never raised into the user's run."""
    if not sinks or monitor is None:
        return []
    try:
        paths = write_report(monitor, directory)
    except Exception as e:
        print(f"torchmem: could not write the report for the trackers: {e}", file=sys.stderr)
        return []
    if profile is not None:
        paths.append(Path(profile))
    for sink in sinks:
        try:
            sink.log_artifacts(paths)
        except Exception as e:
            print(f"torchmem: could not upload the report to {getattr(sink, 'name', sink)}: {e}", file=sys.stderr)
    return paths


def publish_metrics(sinks: list[Any], metrics: dict[str, int], step: int) -> None:
    for sink in sinks:
        try:
            sink.log(metrics, step)
        except Exception as e:
            print(f"torchmem: could not log to {getattr(sink, 'name', sink)}: {e}", file=sys.stderr)
