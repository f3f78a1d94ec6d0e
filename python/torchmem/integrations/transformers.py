"""torchmem for the Hugging Face `Trainer`: `TorchmemCallback`, `attach(trainer)` and an out-of-memory-aware
`find_executable_batch_size`. Importing this module imports transformers (install `torchmem[transformers]`).

`TorchmemCallback` feeds a `torchmem.Monitor` per rank: an update step per `on_step_begin` → `on_step_end`
(so `state.global_step` is the step: with gradient accumulation one step holds several micro-batches), the
forward and backward phases from the Monitor's own hooks on the model, the "optimizer step" phase from
`on_pre_optimizer_step` → `on_optimizer_step`, an epoch per `on_epoch_begin` → `on_epoch_end`. On every
logging step it adds its scalars (bytes, `torchmem/...`) to the `logs` of `on_log` on the world's main process.
The breakdown (what the memory is, `cb.monitor.summary()`) counts the Trainer's optimizer, which the Trainer
creates inside `train()`, after `attach`: the callback takes it from the `optimizer` every event is given
(accelerate's wrapper unwrapped), so the optimizer state is measured from the first step on.

Why `attach(trainer)`: the Trainer puts user callbacks *after* its `report_to` reporters (TensorBoard, W&B,
MLflow, …), and every callback gets the same `logs` dict in list order, so numbers a user callback adds in
`on_log` reach no reporter. `attach` inserts the callback right after `DefaultFlowCallback`, before them, and
wraps `trainer.train` so an out-of-memory error writes the post-mortem (the Trainer has no exception event)
before it propagates. Keep `skip_memory_metrics=True` (the default): the Trainer's own memory tracker resets
torch's peak counters and empties the cache; torchmem's peaks survive that, its cache emptying still changes
what you measure.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any

from transformers import TrainerCallback

from . import tracking
from ._core import OPTIMIZER, StepRecorder, arm_oom, finish_post_mortem, is_oom
from .batch_size import Attempt, find_executable_batch_size

__all__ = ["Attempt", "TorchmemCallback", "attach", "find_executable_batch_size"]


def _model_device(model: Any) -> Any:
    device = getattr(model, "device", None)
    if device is not None:
        return device
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError, TypeError):
        return None


class TorchmemCallback(TrainerCallback):
    """Memory of a Hugging Face Trainer run per epoch, update step and phase; its scalars go into the Trainer's
    logs on the main process. Use `attach(trainer)` so they reach the `report_to` loggers.

    `prefix`: metric key prefix. `oom_dir`: where `attach`'s out-of-memory post-mortem goes (default
    `<output_dir>/torchmem`). `oom_history`: record the allocator's history (CUDA) so the post-mortem names
    who holds the memory (a per-allocation cost). `verbose`: the Monitor's line per epoch on stderr.
    `sinks`: also log the scalars straight to these trackers (`"auto"`: the active W&B / MLflow runs) and at
    the end upload the Monitor's JSON and HTML report (and `profile`, a `torchmem run -o` file) to them.
    After training: `cb.monitor` (`summary()`, `to_dict()`), `cb.logged` [(global_step, scalars)]."""

    def __init__(
        self,
        *,
        prefix: str = "torchmem/",
        oom_dir: str | None = None,
        oom_history: bool = False,
        verbose: bool = False,
        sinks: Any = None,
        profile: str | None = None,
    ) -> None:
        self.prefix = prefix
        self.sinks = sinks
        self.profile = profile
        self._sinks: list[Any] | None = None
        self._metric_sinks: list[Any] = []
        self._report_to: list[str] = []
        self._attached = False
        self.report_files: list[str] = []
        self.oom_dir = oom_dir
        self.oom_history = oom_history
        self.verbose = verbose
        self.recorder: StepRecorder | None = None
        self.logged: list[tuple[int, dict[str, int]]] = []
        self.post_mortem: str | None = None
        self._pending: dict[str, int] | None = None
        self._oom_handler: Any = None
        self._optimizer: Any = None  # the Trainer's, once an event gave it
        self._epoch = 0

    def _active_sinks(self) -> list[Any]:
        """The sinks. Scalars go straight only to trackers no `report_to` reporter already carries them to
        (after `attach`, the reporters see this callback's scalars in `logs`): no row is logged twice."""
        if self._sinks is None:
            self._sinks = tracking.resolve_sinks(self.sinks, self.prefix)
            fed = set(self._report_to) if self._attached else set()
            self._metric_sinks = [s for s in self._sinks if getattr(s, "name", None) not in fed]
        return self._sinks

    @property
    def monitor(self) -> Any:
        return self.recorder.monitor if self.recorder is not None else None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self.recorder is not None:
            self.recorder.close()
        self._optimizer = None
        self.recorder = StepRecorder(_model_device(model), model=model, prefix=self.prefix, verbose=self.verbose)
        self._add_optimizer(kwargs.get("optimizer"))
        self._epoch = 0
        if self.oom_dir is None:
            self.oom_dir = os.path.join(args.output_dir or ".", "torchmem")
        # Resolved at the first logging step: the reporters start their W&B / MLflow runs in on_train_begin,
        # after this callback's.
        self._sinks = None if state.is_world_process_zero else []
        report_to = args.report_to if isinstance(args.report_to, (list, tuple)) else [args.report_to]
        self._report_to = [str(r) for r in report_to]
        if self.recorder.dev is not None and self._oom_handler is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                self._oom_handler = arm_oom(self.oom_dir, self.recorder.dev, self.oom_history)

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.recorder is not None:
            self.recorder.begin_epoch(self._epoch)
            self._epoch += 1

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.recorder is not None:
            self.recorder.end_epoch()

    def _add_optimizer(self, optimizer: Any) -> None:
        """The Trainer's optimizer into the breakdown, once it exists (`create_optimizer` runs in `train()`)."""
        if optimizer is not None and optimizer is not self._optimizer and self.recorder is not None:
            self._optimizer = optimizer
            self.recorder.add_optimizer(optimizer)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.recorder is not None:
            self._add_optimizer(kwargs.get("optimizer"))
            self.recorder.begin_step(int(state.global_step))

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.recorder is not None:
            self._add_optimizer(kwargs.get("optimizer"))
            self.recorder.begin_phase(OPTIMIZER)

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.recorder is not None:
            self.recorder.end_phase(OPTIMIZER)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.recorder is None:
            return
        self.recorder.end_step()
        # DefaultFlowCallback (first in the list) has decided whether this step logs; on_log follows.
        if control.should_log and state.is_world_process_zero:
            self._pending = self.recorder.metrics()
            self._active_sinks()
            tracking.publish_metrics(self._metric_sinks, self._pending, int(state.global_step))

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        pending, self._pending = self._pending, None
        if pending is None or logs is None:
            return
        logs.update(pending)
        # The Trainer copied `logs` into log_history just before this event: keep the two the same.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(pending)
        self.logged.append((int(state.global_step), pending))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.recorder is not None:
            self.recorder.close()
            files = tracking.publish_end(self._active_sinks(), self.recorder.monitor, self.oom_dir, self.profile)
            self.report_files = [str(f) for f in files]
        if self._oom_handler is not None:
            self._oom_handler.disable()
            self._oom_handler = None

    def _on_exception(self, trainer: Any, exc: BaseException) -> None:
        state = trainer.state
        context = {
            "framework": "transformers",
            "global_step": int(state.global_step),
            "epoch": state.epoch,
            "rank": int(getattr(trainer.args, "process_index", 0)),
        }
        finish_post_mortem(self, exc, self.oom_dir or os.path.join(trainer.args.output_dir or ".", "torchmem"), context)


def attach(trainer: Any, callback: TorchmemCallback | None = None, **kwargs: Any) -> TorchmemCallback:
    """Puts a `TorchmemCallback` (made with `kwargs` unless given) into `trainer`'s callbacks right after
    `DefaultFlowCallback`, before the `report_to` reporters, so its scalars in `on_log` reach them; and wraps
    `trainer.train` so an out-of-memory error writes the post-mortem first. Returns the callback. Relies on
    the callback list's order (transformers documents no way to insert before the reporters)."""
    cb = callback if callback is not None else TorchmemCallback(**kwargs)
    callbacks = trainer.callback_handler.callbacks
    if cb in callbacks:
        callbacks.remove(cb)
    names = [type(c).__name__ for c in callbacks]
    at = names.index("DefaultFlowCallback") + 1 if "DefaultFlowCallback" in names else 0
    callbacks.insert(at, cb)
    cb._attached = True
    if not getattr(trainer.train, "_torchmem_wrapped", False):
        train = trainer.train

        @functools.wraps(train)
        def train_with_post_mortem(*args: Any, **kw: Any) -> Any:
            try:
                return train(*args, **kw)
            except BaseException as exc:
                if is_oom(exc):
                    for c in trainer.callback_handler.callbacks:
                        if isinstance(c, TorchmemCallback):
                            c._on_exception(trainer, exc)
                raise

        train_with_post_mortem._torchmem_wrapped = True  # type: ignore[attr-defined]
        trainer.train = train_with_post_mortem
    return cb
