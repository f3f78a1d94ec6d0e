"""The Monitor of `torchmem run`'s automatic watch (`_autowatch.py`): `torchmem.watch`'s phases and breakdown,
recorded on the measured steps only. A step that is not measured costs its hooks a counter and a flag: no
memory read, no marker, no gradient hook on the output, no backward callback, no allocation.

Which steps are measured: the first `FIRST_STEPS` forwards, then one in `breakdown_every` (10) as long as the
time spent measuring stays within `BUDGET` (1 %) of the time since the first forward; a due step over budget
is skipped. A measured step costs ~0.4-1 ms (the breakdown at four boundaries, six markers, three peak
windows): one in ten of 30 ms GPU steps is 0.3 %, under budget, so every tenth is measured as before; one in
ten of 1 ms CPU steps would be +12 % (bench/autowatch_cost.py), so there the budget spaces them out.

Why: the program never asked for phases. Measuring every step cost +17 % on a CPU loop of 1.7 ms steps
(docs/benchmarks.md, "Short steps"). The recorder still samples the whole process every interval, so the
run's timeline and peaks are complete; the Phases and breakdown tables count the measured steps. A Monitor or
`torchmem.watch` the program makes itself records every step, as before.

The measured steps are chosen here, by the forward count, and the breakdown is told how many steps it did
not see (`Breakdown.skip_steps`), so its own choice (`step_started`) agrees and its re-walks of the
parameter lists keep their period in real steps."""

from __future__ import annotations

import time
from typing import Any

from . import _breakdown
from .monitor import Monitor

#: The largest share of the run's time (since the first forward) that measured steps may take.
BUDGET = 0.01


class SampledWatch(Monitor):
    """`torchmem.watch(model, optimizer)` whose unmeasured steps cost nothing measurable (see the module)."""

    #: Outermost forwards started (the watch's steps), measured or not.
    _forwards = 0
    #: True from a measured step's forward until the next step's forward begins.
    _measuring = False
    #: perf_counter_ns() at the first forward, and the nanoseconds spent in the hooks of measured steps since.
    _t0_ns = 0
    _spent_ns = 0

    def _step_is_measured(self, n: int) -> bool:
        if n <= _breakdown.FIRST_STEPS:
            return True
        bd = self._bd
        if n % (bd.every if bd is not None else _breakdown.EVERY_STEPS):
            return False
        return self._spent_ns <= BUDGET * (time.perf_counter_ns() - self._t0_ns)

    def _forward_pre_kw(self, module: Any, args: Any, kwargs: Any) -> None:
        if self._forward_depth or "backward" in self._phase:
            # Inside a forward (the model calls itself), or a recomputation during a measured backward.
            if self._measuring:
                super()._forward_pre_kw(module, args, kwargs)
            else:
                self._forward_depth += 1
            return
        n = self._forwards = self._forwards + 1
        if n == 1:
            self._t0_ns = time.perf_counter_ns()
        if not self._step_is_measured(n) or _in_backward():
            if self._measuring:  # the measured step ends here: `breakdown()` keeps it
                self._measuring = False
                self._finish_implicit_step()
            self._forward_depth = 1
            return
        t0 = time.perf_counter_ns()
        bd = self._bd
        if bd is not None:
            bd.skip_steps(n - 1 - bd.steps_seen)
        self._measuring = True
        super()._forward_pre_kw(module, args, kwargs)
        self._spent_ns += time.perf_counter_ns() - t0

    def _forward_post(self, module: Any, args: Any, output: Any) -> None:
        if self._measuring:
            t0 = time.perf_counter_ns()
            super()._forward_post(module, args, output)
            self._spent_ns += time.perf_counter_ns() - t0
        elif self._forward_depth:
            self._forward_depth -= 1

    def _on_output_grad(self, grad: Any) -> None:
        t0 = time.perf_counter_ns()
        super()._on_output_grad(grad)
        self._spent_ns += time.perf_counter_ns() - t0

    def _backward_done(self) -> None:
        t0 = time.perf_counter_ns()
        super()._backward_done()
        self._spent_ns += time.perf_counter_ns() - t0

    def _hook_optimizer(self, optimizer: Any) -> None:
        self._handles.append(optimizer.register_step_pre_hook(self._optimizer_pre))
        self._handles.append(optimizer.register_step_post_hook(self._optimizer_post))

    def _optimizer_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._measuring:
            t0 = time.perf_counter_ns()
            self._start("optimizer step")
            self._spent_ns += time.perf_counter_ns() - t0

    def _optimizer_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._measuring:
            t0 = time.perf_counter_ns()
            self._end("optimizer step")
            self._spent_ns += time.perf_counter_ns() - t0
        elif self._bd is not None:
            self._bd.invalidate_optimizer()  # the state may change on a step not measured


def _in_backward() -> bool:
    """True while autograd runs a backward pass in this thread (a forward recomputed by checkpointing)."""
    import torch

    try:
        return torch._C._current_graph_task_id() != -1
    except Exception:
        return False


def sampled_watch(model: Any, optimizer: Any, activations: str | None) -> SampledWatch:
    """`torchmem.watch(model, optimizer, activations=...)` with the defaults, as a `SampledWatch`."""
    mon = SampledWatch(
        model,
        optimizer,
        verbose=False,
        warn=False,
        keep_markers=100,
        breakdown=True,
        activations=activations,
        breakdown_every=_breakdown.EVERY_STEPS,
    )
    mon._watching = True
    return mon
