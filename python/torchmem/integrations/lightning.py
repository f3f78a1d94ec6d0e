"""`TorchmemCallback` for PyTorch Lightning, for both of its namespaces: `lightning.pytorch` (`pip install
lightning`) and `pytorch_lightning` (`pip install pytorch-lightning`).

A callback that subclasses one namespace's `Callback` and is given to the other's `Trainer` fails inside
Lightning with `ValueError("Expected a parent")` (the bug that broke nvitop's callback). So the class is built,
on first use, against the namespace the user works with, and never imports the other one:

* `TorchmemCallback(namespace="lightning" | "pytorch_lightning")` — said outright; else
* the one namespace already imported (`sys.modules`); else, when both are,
* the one the calling module refers to (its `pl`/`L`/`Trainer` names); else a clear error;
* `attach(trainer)` builds it for that Trainer's namespace and adds it to `trainer.callbacks`.

What it does: a `torchmem.Monitor` per rank fed from the hooks — a step per training batch
(`on_train_batch_start` → `on_train_batch_end`), the "forward" phase up to `on_before_backward`, "backward" up to
`on_after_backward`, "optimizer step" from `on_before_optimizer_step`, an epoch per training epoch, a
"validation" phase per validation batch; the breakdown of the LightningModule and the Trainer's optimizers
(parameters, gradients, optimizer state, activations, inputs) at the step start and the ends of forward,
backward and optimizer step, as `torchmem.Monitor(model, optimizer)` records it (`cb.monitor.summary()`);
on rank 0 (`trainer.is_global_zero`) every `every_n_steps` batches
(default: the Trainer's `log_every_n_steps`) it logs bytes through `logger.log_metrics` to every logger of the
Trainer (`torchmem/allocated_bytes`, `torchmem/step_peak_allocated_bytes`, `torchmem/forward_peak_rss_bytes`,
…). On an out-of-memory exception `on_exception` writes the post-mortem (`oom_dir`, default
`<trainer.default_root_dir>/torchmem`). No collective is called; nothing keeps a batch, an output or a loss.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from typing import Any

from . import tracking
from ._core import BACKWARD, FORWARD, OPTIMIZER, StepRecorder, arm_oom, finish_post_mortem, is_oom

_NAMESPACES = ("lightning.pytorch", "pytorch_lightning")
_ALIASES = {
    "lightning": "lightning.pytorch",
    "lightning.pytorch": "lightning.pytorch",
    "pytorch_lightning": "pytorch_lightning",
}
_classes: dict[str, type] = {}


def _namespace_of_module(name: str) -> str | None:
    for ns in _NAMESPACES:
        if name == ns or name.startswith(ns + "."):
            return ns
    if name == "lightning" or name.startswith("lightning."):
        return "lightning.pytorch"
    return None


def _namespace_from_globals(g: dict[str, Any]) -> set[str]:
    """The Lightning namespaces a module's globals refer to (`import pytorch_lightning as pl`,
    `from lightning.pytorch import Trainer`, …)."""
    found = set()
    for value in list(g.values()):
        name = getattr(value, "__name__", None) if isinstance(value, type(sys)) else getattr(value, "__module__", None)
        if isinstance(name, str):
            ns = _namespace_of_module(name)
            if ns is not None:
                found.add(ns)
    return found


def _resolve(namespace: Any, caller_globals: dict[str, Any] | None) -> str:
    if namespace is not None:
        if isinstance(namespace, type(sys)):
            namespace = namespace.__name__
        ns = _ALIASES.get(namespace) if isinstance(namespace, str) else None
        if ns is None:
            raise ValueError(
                f"TorchmemCallback: namespace={namespace!r}; expected 'lightning' (lightning.pytorch) or "
                "'pytorch_lightning'"
            )
        return ns
    loaded = [ns for ns in _NAMESPACES if ns in sys.modules]
    if len(loaded) == 1:
        return loaded[0]
    if len(loaded) == 2 and caller_globals is not None:
        used = _namespace_from_globals(caller_globals)
        if len(used) == 1:
            return used.pop()
    if not loaded:
        for ns in _NAMESPACES:
            try:
                importlib.import_module(ns)
                return ns
            except ImportError:
                continue
        raise ImportError(
            "TorchmemCallback needs PyTorch Lightning: pip install lightning (or pytorch-lightning), or "
            "pip install 'torchmem[lightning]'"
        )
    raise ValueError(
        "TorchmemCallback: both lightning.pytorch and pytorch_lightning are imported, and a callback of one "
        "fails in the other's Trainer; say which: TorchmemCallback(namespace='lightning') or "
        "namespace='pytorch_lightning', or torchmem.integrations.lightning.attach(trainer)"
    )


def callback_class(namespace: str = "lightning.pytorch") -> type:
    """The `TorchmemCallback` class subclassing `namespace`'s `Callback` ('lightning' or 'pytorch_lightning')."""
    ns = _resolve(namespace, None)
    cls = _classes.get(ns)
    if cls is None:
        base = importlib.import_module(ns).Callback
        cls = type("TorchmemCallback", (TorchmemCallback, base), {"_namespace": ns, "__module__": __name__})
        _classes[ns] = cls
    return cls


class TorchmemCallback:
    """Memory of a Lightning run per epoch, step and phase, logged through the Trainer's loggers on rank 0.

    `every_n_steps`: log every n training batches (default: `trainer.log_every_n_steps`; 0: never log).
    `prefix`: metric key prefix. `oom_dir`: where the out-of-memory post-mortem goes (default
    `<default_root_dir>/torchmem`). `oom_history`: record the allocator's history (with Python stacks, a
    per-allocation cost) so a CUDA post-mortem shows who holds the memory. `verbose`: the Monitor's line per
    epoch on stderr. `namespace`: 'lightning' or 'pytorch_lightning' (see the module's docstring).
    `sinks`: also log the scalars straight to these trackers (`"auto"`: the active W&B / MLflow runs, see
    `torchmem.integrations.tracking`), and at the end of training upload the Monitor's JSON and HTML report
    (and `profile`, the file of `torchmem run -o PROFILE`, when given) to them.

    After training, `cb.monitor` is the rank's `torchmem.Monitor` (`summary()`, `to_dict()`, `journey()`),
    `cb.logged` the scalars it logged (step, dict), `cb.post_mortem` the OOM report's path, if any."""

    _namespace: str | None = None

    def __new__(cls, *args: Any, namespace: Any = None, **kwargs: Any) -> Any:
        if cls._namespace is not None:
            return super().__new__(cls)
        caller = sys._getframe(1).f_globals
        return super().__new__(callback_class(_resolve(namespace, caller)))

    def __init__(
        self,
        every_n_steps: int | None = None,
        *,
        prefix: str = "torchmem/",
        oom_dir: str | None = None,
        oom_history: bool = False,
        verbose: bool = False,
        sinks: Any = None,
        profile: str | None = None,
        namespace: Any = None,
    ) -> None:
        super().__init__()
        if every_n_steps is not None and (not isinstance(every_n_steps, int) or every_n_steps < 0):
            raise ValueError(f"every_n_steps must be a non-negative int or None, not {every_n_steps!r}")
        self.every_n_steps = every_n_steps
        self.prefix = prefix
        self.oom_dir = oom_dir
        self.oom_history = oom_history
        self.verbose = verbose
        self.sinks = sinks
        self.profile = profile
        self._sinks: list[Any] | None = None
        self.report_files: list[str] = []
        self.recorder: StepRecorder | None = None
        self.logged: list[tuple[int, dict[str, int]]] = []
        self.post_mortem: str | None = None
        self._oom_handler: Any = None
        self._batches = 0
        self._batch_idx: int | None = None

    def _active_sinks(self) -> list[Any]:
        if self._sinks is None:
            self._sinks = tracking.resolve_sinks(self.sinks, self.prefix)
        return self._sinks

    @property
    def monitor(self) -> Any:
        return self.recorder.monitor if self.recorder is not None else None

    # --- lifecycle -------------------------------------------------------------------------------------------

    def _check_trainer(self, trainer: Any) -> None:
        ns = _namespace_of_module(type(trainer).__module__)
        if ns is not None and ns != self._namespace:
            raise TypeError(
                f"TorchmemCallback was built for {self._namespace} but this Trainer is {ns}'s: use "
                f"TorchmemCallback(namespace={ns!r}) or torchmem.integrations.lightning.attach(trainer)"
            )

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._check_trainer(trainer)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.recorder is not None:
            self.recorder.close()
        # The breakdown counts the LightningModule; the phases come from the hooks below, not from module
        # hooks (a training_step need not call the module's own forward).
        self.recorder = StepRecorder(
            pl_module.device, model=pl_module, hook_model=False, prefix=self.prefix, verbose=self.verbose
        )
        for optimizer in getattr(trainer, "optimizers", None) or ():
            self.recorder.add_optimizer(optimizer)
        if self.every_n_steps is None:
            self.every_n_steps = int(getattr(trainer, "log_every_n_steps", 50) or 0)
        if self.oom_dir is None:
            self.oom_dir = f"{trainer.default_root_dir}/torchmem"
        self._sinks = None if trainer.is_global_zero else []  # resolved at first use: loggers start runs lazily
        if self.recorder.dev is not None and self._oom_handler is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                self._oom_handler = arm_oom(self.oom_dir, self.recorder.dev, self.oom_history)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.recorder is not None:
            self.recorder.close()
            files = tracking.publish_end(self._active_sinks(), self.recorder.monitor, self.oom_dir, self.profile)
            self.report_files = [str(f) for f in files]

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.recorder is not None:
            self.recorder.close()
        if self._oom_handler is not None:
            self._oom_handler.disable()
            self._oom_handler = None

    # --- epochs, steps, phases ---------------------------------------------------------------------------

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if self.recorder is not None:
            self.recorder.begin_epoch(trainer.current_epoch)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self.recorder is not None:
            self.recorder.end_epoch()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.recorder is None:
            return
        self._batch_idx = batch_idx
        self.recorder.begin_step(self._batches)
        self.recorder.begin_phase(FORWARD, inputs=batch)

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        if self.recorder is not None:
            self.recorder.end_phase(FORWARD)
            self.recorder.begin_phase(BACKWARD)

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        if self.recorder is not None:
            self.recorder.end_phase(BACKWARD)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.recorder is not None:
            self.recorder.add_optimizer(optimizer)
            self.recorder.end_phase(BACKWARD)
            self.recorder.begin_phase(OPTIMIZER)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.recorder is None:
            return
        self.recorder.end_step()
        self._batches += 1
        n = self.every_n_steps or 0
        if n and self._batches % n == 0 and trainer.is_global_zero and (trainer.loggers or self._active_sinks()):
            metrics = self.recorder.metrics()
            # The step Lightning's own logging uses (as DeviceStatsMonitor does), so these rows line up with
            # the loss; global_step where a Lightning version lacks it.
            loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
            step = int(getattr(loop, "_batches_that_stepped", trainer.global_step))
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
            tracking.publish_metrics(self._active_sinks(), metrics, step)
            self.logged.append((step, metrics))

    def on_validation_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self.recorder is not None and not trainer.sanity_checking:
            self.recorder.begin_phase("validation")

    def on_validation_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self.recorder is not None:
            self.recorder.end_phase("validation")

    # --- out of memory ---------------------------------------------------------------------------------------

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if not is_oom(exception):
            if self.recorder is not None:
                self.recorder.close()
            return
        context = {
            "framework": "lightning",
            "namespace": self._namespace,
            "global_step": int(trainer.global_step),
            "epoch": int(trainer.current_epoch),
            "rank": int(getattr(trainer, "global_rank", 0)),
        }
        if self._batch_idx is not None:
            context["batch_idx"] = self._batch_idx
        finish_post_mortem(self, exception, self.oom_dir or f"{trainer.default_root_dir}/torchmem", context)


def attach(trainer: Any, *args: Any, **kwargs: Any) -> Any:
    """Builds a `TorchmemCallback` for `trainer`'s namespace, adds it to `trainer.callbacks` and returns it."""
    ns = _namespace_of_module(type(trainer).__module__)
    if ns is None:
        raise TypeError(f"attach: {type(trainer).__name__} is not a Lightning Trainer")
    cb = callback_class(ns)(*args, **kwargs)
    trainer.callbacks.append(cb)
    return cb
