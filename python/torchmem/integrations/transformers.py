"""torchmem for the Hugging Face `Trainer`: `TorchmemCallback`, `attach(trainer)` and an out-of-memory-aware
`find_executable_batch_size`. Importing this module imports transformers (install `torchmem[transformers]`).

`TorchmemCallback` feeds a `torchmem.Monitor` per rank: an update step per `on_step_begin` → `on_step_end`
(so `state.global_step` is the step: with gradient accumulation one step holds several micro-batches), the
forward and backward phases from the Monitor's own hooks on the model, the "optimizer step" phase from
`on_pre_optimizer_step` → `on_optimizer_step`, an epoch per `on_epoch_begin` → `on_epoch_end`. On every
logging step it adds its scalars (bytes, `torchmem/...`) to the `logs` of `on_log` on the world's main process.

Why `attach(trainer)`: the Trainer puts user callbacks *after* its `report_to` reporters (TensorBoard, W&B,
MLflow, …), and every callback gets the same `logs` dict in list order, so numbers a user callback adds in
`on_log` reach no reporter. `attach` inserts the callback right after `DefaultFlowCallback`, before them, and
wraps `trainer.train` so an out-of-memory error writes the post-mortem (the Trainer has no exception event)
before it propagates. Keep `skip_memory_metrics=True` (the default): the Trainer's own memory tracker resets
torch's peak counters and empties the cache; torchmem's peaks survive that, its cache emptying still changes
what you measure.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import os
import sys
import time
import warnings
from typing import Any, Callable

from transformers import TrainerCallback

import torchmem
from torchmem import _native

from . import tracking
from ._core import OPTIMIZER, StepRecorder, arm_oom, is_oom, write_post_mortem

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
        self.recorder = StepRecorder(_model_device(model), model=model, prefix=self.prefix, verbose=self.verbose)
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

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.recorder is not None:
            self.recorder.begin_step(int(state.global_step))

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.recorder is not None:
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
        try:
            path = write_post_mortem(
                exc,
                self.oom_dir or os.path.join(trainer.args.output_dir or ".", "torchmem"),
                self.recorder,
                self._oom_handler,
                context,
            )
            self.post_mortem = str(path)
        except Exception as e:  # never hide the user's OOM behind ours
            print(f"torchmem: could not write the out-of-memory post-mortem: {e}", file=sys.stderr)
        finally:
            self._oom_handler = None
            if self.recorder is not None:
                self.recorder.close()


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


# --- find_executable_batch_size ----------------------------------------------------------------------------


@dataclasses.dataclass
class Attempt:
    """One try of `find_executable_batch_size`: the batch size, whether it ran, its peaks inside the try
    (bytes; GPU numbers None without CUDA), its duration, and the out-of-memory message of a failed try."""

    batch_size: int
    ok: bool
    peak_allocated_bytes: int | None
    peak_reserved_bytes: int | None
    peak_rss_bytes: int | None
    duration_s: float
    error: str | None = None

    def __str__(self) -> str:
        def f(v: int | None) -> str:
            return "-" if v is None else _native.format_bytes(v)

        head = f"batch size {self.batch_size}: " + ("ran" if self.ok else "out of memory")
        peaks = (
            f"peak allocated {f(self.peak_allocated_bytes)}, reserved {f(self.peak_reserved_bytes)}, "
            if (self.peak_allocated_bytes is not None)
            else ""
        )
        tail = f" — {self.error}" if self.error else ""
        return f"{head} ({peaks}peak RSS {f(self.peak_rss_bytes)}, {self.duration_s:.2f} s){tail}"


def _shrink(batch_size: int) -> int:
    return min(int(batch_size * 0.9), batch_size - 1)


def find_executable_batch_size(
    function: Callable | None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[int], int] | None = None,
    *,
    device: Any = None,
) -> Any:
    """accelerate's `find_executable_batch_size`, recording every try. A decorator: `function(batch_size,
    *args)` runs with `starting_batch_size`, and on an out-of-memory error (torch's OutOfMemoryError by type,
    or the CUDA / CPU-allocator / cuDNN messages) again with a smaller one (×0.9, as accelerate does now),
    until it runs; `RuntimeError` when it reaches zero. Each try runs inside a `torchmem.track` phase named
    `batch_size=N` (so under `torchmem run` it lands in the profile), and the wrapper's `attempts` lists them
    all (`Attempt`: batch size, ok, peak allocated/reserved/RSS, duration, the OOM message). Between tries the
    failed try's frames are dropped, `gc.collect()` runs and `torchmem.empty_cache()` gives the memory back."""
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
            device=device,
        )
    if not isinstance(starting_batch_size, int) or starting_batch_size <= 0:
        raise ValueError(f"starting_batch_size must be a positive int, not {starting_batch_size!r}")
    shrink = reduce_batch_size_fn or _shrink

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        attempts: list[Attempt] = []
        run.attempts = attempts  # type: ignore[attr-defined]
        batch_size = starting_batch_size
        while True:
            if batch_size <= 0:
                tries = "; ".join(str(a) for a in attempts)
                raise RuntimeError(f"No executable batch size found, reached zero. Tries: {tries}")
            tracker = torchmem.track(f"batch_size={batch_size}", device)
            t0 = time.perf_counter()
            error: BaseException | None = None
            try:
                with tracker:
                    result = function(batch_size, *args, **kwargs)
            except Exception as exc:
                if not is_oom(exc):
                    raise
                error = exc
            r = tracker.result
            attempt = Attempt(
                batch_size,
                error is None,
                r.peak_allocated_bytes if r else None,
                r.peak_reserved_bytes if r else None,
                r.peak_rss_bytes if r else None,
                time.perf_counter() - t0,
                str(error).splitlines()[0] if error is not None else None,
            )
            attempts.append(attempt)
            if error is None:
                return result
            error.__traceback__ = None  # its frames hold the failed try's tensors
            error = None
            gc.collect()
            torchmem.empty_cache(device)
            smaller = int(shrink(batch_size))
            if smaller >= batch_size:
                raise ValueError(f"reduce_batch_size_fn({batch_size}) gave {smaller}: it must shrink the batch size")
            batch_size = smaller

    run.attempts = []  # type: ignore[attr-defined]
    return run
