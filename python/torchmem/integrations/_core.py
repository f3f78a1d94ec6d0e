"""The one adapter layer under torchmem's framework callbacks (Lightning, Hugging Face): turns "a step began",
"backward ended", "the optimizer is about to step" into torchmem's public API — a `torchmem.Monitor` for the
epoch/step/phase tables and the breakdown (what the memory is: parameters, gradients, optimizer state,
activations, inputs), the Monitor's own phases for forward/backward/optimizer step (their ends carry the
breakdown; their markers reach, under `torchmem run`, the profile), `torchmem.track` windows for other
phases (validation), and a `torchmem.peak` window per step — and builds the scalars the callbacks log
(bytes, keys `torchmem/...`) and the out-of-memory post-mortem.

The frameworks create their optimizers after the callback starts (the HF Trainer in `train()`, Lightning in
`configure_optimizers`): the callbacks hand each one to `StepRecorder.add_optimizer` when they see it, and
until then the breakdown's optimizer state is "not measured" (None), never 0.

No collective is ever called: every rank measures itself; the callbacks decide who logs (rank 0).
Nothing here keeps a reference to a batch, an output or a loss.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torchmem
from torchmem import _autowatch, _devices, _native

#: Phase names, as the Monitor's own hooks name them (so tables and profiles read the same).
FORWARD, BACKWARD, OPTIMIZER = "forward", "backward", "optimizer step"
_METRIC_NAME = {FORWARD: "forward", BACKWARD: "backward", OPTIMIZER: "optimizer_step"}

#: The phases whose end is a breakdown boundary ("end of forward", …, as the Monitor's own hooks mark them).
_BOUNDARY_PHASES = (FORWARD, BACKWARD, OPTIMIZER)

_OOM_TEXT = ("out of memory", "DefaultCPUAllocator: can't allocate memory", "CUDNN_STATUS_NOT_SUPPORTED")


def is_oom(exc: BaseException) -> bool:
    """An out-of-memory error: torch's OutOfMemoryError by type, or the messages accelerate matches."""
    torch = sys.modules.get("torch")
    oom_type = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    if oom_type is not None and isinstance(exc, oom_type):
        return True
    return isinstance(exc, (RuntimeError, MemoryError)) and any(t in str(exc) for t in _OOM_TEXT)


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a framework's wrapper (accelerate's `AcceleratedOptimizer.optimizer`,
    Lightning's `LightningOptimizer._optimizer`), or `optimizer` itself; None for anything without
    `param_groups` and `state`."""
    for _ in range(4):
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if inner is None or inner is optimizer or not hasattr(inner, "param_groups"):
            break
        optimizer = inner
    if not hasattr(optimizer, "param_groups") or not hasattr(optimizer, "state"):
        return None
    return optimizer


def cuda_index(device: Any) -> int | None:
    """The CUDA index of the model's device (a torch.device, str or int) by torchmem's one resolver
    (`_devices.cuda_index`: 'cuda' is the current device); None for the CPU, for no device, and without CUDA.
    A device torchmem cannot read (say 'xla') raises ValueError, as everywhere in torchmem."""
    if device is None:
        return None
    return _devices.cuda_index(device, _devices.imported_torch())


class StepRecorder:
    """Epochs, steps and phases of one training run on one rank, measured through torchmem's public API.

    `device`: the model's device (a CUDA device gets allocated/reserved numbers; the CPU gets RSS only).
    `model`: the model the breakdown counts; with `hook_model` (the default) the Monitor's own hooks also
    record its forward and backward phases (for frameworks without callbacks at those points, the HF
    Trainer); without, the framework's callbacks mark them (`begin_phase`, Lightning, whose `training_step`
    need not call the module's own forward). `prefix`: metric key prefix. `verbose`: the Monitor's per-epoch
    line on stderr."""

    def __init__(
        self,
        device: Any = None,
        *,
        model: Any = None,
        hook_model: bool = True,
        prefix: str = "torchmem/",
        verbose: bool = False,
    ) -> None:
        self.dev = cuda_index(device)
        self.device = f"cuda:{self.dev}" if self.dev is not None else "cpu"
        self.prefix = prefix
        if model is not None and not hook_model:
            self.monitor = torchmem.Monitor(device=self.device, verbose=verbose, breakdown=True)
            self.monitor._bd.add_model(model)
            _autowatch.user_monitor_started()  # under `torchmem run`: this one records the phases
        else:
            self.monitor = torchmem.Monitor(model, device=self.device, verbose=verbose)
        self._saving = False  # the saved-tensors hooks are on for a forward marked by `begin_phase`
        self._tracks: dict[str, Any] = {}
        self._open_phases: list[str] = []
        self._step_cm: Any = None
        self._step_peak: Any = None
        self._epoch_cm: Any = None
        self.steps = 0
        self.step_index: int | None = None
        #: The last finished step: its peaks and the peak of each phase inside it, in bytes.
        self.last_step: dict[str, int] = {}
        self._phase_peaks: dict[str, int] = {}

    # --- spans ---------------------------------------------------------------------------------------------

    def begin_epoch(self, index: int | None = None) -> None:
        self.end_epoch()
        self._epoch_cm = self.monitor.epoch(index)
        self._epoch_cm.__enter__()

    def end_epoch(self) -> None:
        cm, self._epoch_cm = self._epoch_cm, None
        if cm is not None:
            self.end_step()
            cm.__exit__(None, None, None)

    def begin_step(self, index: int | None = None) -> None:
        self.end_step()
        self.step_index = index
        self._phase_peaks = {}
        self._step_cm = self.monitor.step(index)
        self._step_cm.__enter__()
        self._step_peak = torchmem.peak(self.device)
        self._step_peak.__enter__()

    def end_step(self) -> dict[str, int] | None:
        """Closes the open phases and the step; returns the step's peaks (None when no step was open)."""
        self.end_phases()
        if self._step_cm is None:
            return None
        peak, self._step_peak = self._step_peak, None
        peak.__exit__(None, None, None)
        cm, self._step_cm = self._step_cm, None
        cm.__exit__(None, None, None)
        self.steps += 1
        step = {
            "step_peak_allocated_bytes": peak.allocated_bytes,
            "step_peak_reserved_bytes": peak.reserved_bytes,
            "step_peak_rss_bytes": peak.rss_bytes,
        }
        step.update(self._phase_peaks)
        self.last_step = {k: v for k, v in step.items() if v is not None}
        return self.last_step

    def add_optimizer(self, optimizer: Any) -> None:
        """Counts `optimizer`'s state in the breakdown (unwrapped from the framework's wrapper); one seen
        before is ignored. Called by the callbacks whenever an event hands them the optimizer."""
        bd = self.monitor._bd
        opt = unwrap_optimizer(optimizer)
        if bd is not None and opt is not None:
            bd.add_optimizer(opt)

    def _monitor_phase(self, name: str) -> bool:
        """Whether phase `name` is the Monitor's own (its end a breakdown boundary) rather than a track."""
        return self.monitor._bd is not None and name in _BOUNDARY_PHASES

    def begin_phase(self, name: str, inputs: Any = None) -> None:
        """Opens phase `name`. `inputs`: for "forward", the batch (the breakdown's inputs; on a measured step
        the saved-tensors hooks then count the activations until the forward ends)."""
        if name in self._open_phases:
            return
        if self._monitor_phase(name):
            mon = self.monitor
            if name in mon._phase:  # opened by the Monitor's own hooks: theirs to close
                return
            mon._start(name)
            bd = mon._bd
            if name == FORWARD and bd is not None and bd.sampling:
                torch = sys.modules.get("torch")
                if torch is not None and torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
                    bd.forward_begin((inputs,), {})
                    self._saving = bd.saved is not None
                else:
                    bd.set_inputs((inputs,), {})
        else:
            t = self._tracks.get(name)
            if t is None:
                t = self._tracks[name] = torchmem.track(name, self.device)
            t.__enter__()
        self._open_phases.append(name)

    def _close(self, name: str) -> dict[str, Any] | None:
        """Closes one open phase; its exit memory (None when it was not open)."""
        if self._monitor_phase(name):
            mon = self.monitor
            if name == FORWARD and self._saving:
                self._saving = False
                mon._bd.forward_end()
            end = mon._end(name)
            return None if end is None else end["memory"]
        t = self._tracks[name]
        t.__exit__(None, None, None)
        return t.result.exit

    def end_phase(self, name: str) -> None:
        if name not in self._open_phases:
            return
        # Phases nest in opening order: close any opened after this one first.
        while self._open_phases:
            top = self._open_phases.pop()
            exit_memory = self._close(top) or {}
            key = _METRIC_NAME.get(top, top.replace(" ", "_"))
            for kind in ("allocated", "rss"):
                value = exit_memory.get(f"peak_{kind}_bytes")
                if value is not None:
                    k = f"{key}_peak_{kind}_bytes"
                    self._phase_peaks[k] = max(self._phase_peaks.get(k, 0), value)
            if top == name:
                break

    def end_phases(self) -> None:
        if self._open_phases:
            self.end_phase(self._open_phases[0])

    @property
    def open_phase(self) -> str | None:
        return self._open_phases[-1] if self._open_phases else None

    # --- numbers ---------------------------------------------------------------------------------------------

    def metrics(self) -> dict[str, int]:
        """The scalars to log now: current allocated/reserved (CUDA) and RSS, the last step's peaks and its
        phases' peaks. Bytes, keys with `prefix`; a number the device does not have is left out, never 0."""
        s = torchmem.stats(self.device)
        now = {"allocated_bytes": s.allocated_bytes, "reserved_bytes": s.reserved_bytes, "rss_bytes": s.rss_bytes}
        if s.device is not None:
            now["peak_allocated_bytes"] = s.peak_allocated_bytes
            now["peak_reserved_bytes"] = s.peak_reserved_bytes
        now.update(self.last_step)
        return {self.prefix + k: int(v) for k, v in now.items() if v is not None}

    def close(self) -> None:
        self.end_epoch()
        self.end_step()
        self.monitor.close()


# --- out-of-memory post-mortem ---------------------------------------------------------------------------


def arm_oom(directory: str | os.PathLike[str], dev: int | None, record_history: bool) -> Any:
    """`torchmem.on_oom(directory)` on a CUDA device (the allocator's observer writes a snapshot and a report
    at the failing allocation); None on the CPU (the post-mortem is then built from the error)."""
    if dev is None:
        return None
    return torchmem.on_oom(directory, record_history=record_history)


def write_post_mortem(
    exc: BaseException,
    directory: str | os.PathLike[str],
    recorder: StepRecorder | None,
    handler: Any,
    context: dict[str, Any],
) -> Path:
    """Writes `oom-<pid>-<time>-<framework>.txt` (and `.json`) to `directory`: where training was (framework,
    step, batch, the phase that was open), the error, torchmem's diagnosis of it, the allocator report that
    `on_oom` wrote at the failing allocation (CUDA), and the Monitor's tables of the steps before it.
    Returns the text file's path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    phase = recorder.open_phase if recorder is not None else None
    if recorder is not None:
        context = {**context, "phase": phase, "steps_done": recorder.steps, "last_step": recorder.last_step}
    reports: list[str] = []
    if handler is not None:
        # The context-manager exit writes the report from the message when the observer did not run.
        handler.__exit__(type(exc), exc, exc.__traceback__)
        reports = [str(p) for p in handler.reports]
    message = str(exc)
    diagnosis: dict[str, Any] | None = None
    try:
        diagnosis = _native.explain_oom(message)
    except Exception:
        diagnosis = None
    framework = context.get("framework", "training")
    stem = f"oom-{os.getpid()}-{time.strftime('%Y%m%d-%H%M%S')}-{framework}"
    txt, js = directory / f"{stem}.txt", directory / f"{stem}.json"
    where = f"step {context.get('global_step')}" + (f", batch {context['batch_idx']}" if "batch_idx" in context else "")
    lines = [
        f"torchmem out-of-memory post-mortem ({framework}, pid {os.getpid()}, rank {context.get('rank', 0)})",
        f"  at {where}, phase {phase or '-'} (after {context.get('steps_done', 0)} finished steps)",
        f"  {type(exc).__name__}: {message.splitlines()[0] if message else ''}",
        "",
    ]
    if context.get("last_step"):
        lines.append("Last finished step (bytes):")
        lines += [f"  {k:<36} {v:>16,d}  {_native.format_bytes(v)}" for k, v in context["last_step"].items()]
        lines.append("")
    if diagnosis is not None:
        lines += [diagnosis["text"].rstrip(), ""]
    if reports:
        lines.append("Allocator report written at the failing allocation: " + ", ".join(reports))
        lines.append("")
    if recorder is not None:
        lines += ["Memory of the run up to the failure:", recorder.monitor.summary().rstrip(), ""]
    txt.write_text("\n".join(lines) + "\n")
    data = {
        "context": context,
        "exception": {"type": type(exc).__name__, "message": message},
        "diagnosis": {k: v for k, v in diagnosis.items() if k != "text"} if diagnosis else None,
        "allocator_reports": reports,
        "monitor": recorder.monitor.to_dict() if recorder is not None else None,
    }
    js.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"torchmem: out of memory at {where} (phase {phase or '-'}); post-mortem in {txt}", file=sys.stderr)
    return txt


def finish_post_mortem(
    callback: Any, exc: BaseException, directory: str | os.PathLike[str], context: dict[str, Any]
) -> None:
    """A callback's end after an out-of-memory error: writes the post-mortem (`write_post_mortem`) into
    `callback.post_mortem`, never hiding the user's OOM behind an error of ours, then drops the armed OOM
    handler and closes the step recorder. Shared by the Lightning and Hugging Face callbacks."""
    try:
        path = write_post_mortem(exc, directory, callback.recorder, callback._oom_handler, context)
        callback.post_mortem = str(path)
    except Exception as e:  # never hide the user's OOM behind ours
        print(f"torchmem: could not write the out-of-memory post-mortem: {e}", file=sys.stderr)
    finally:
        callback._oom_handler = None
        if callback.recorder is not None:
            callback.recorder.close()
