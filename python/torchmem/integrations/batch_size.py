"""An out-of-memory-aware `find_executable_batch_size` that records every try (framework-free: plain loops,
Lightning and the Hugging Face Trainer alike; also importable from `torchmem.integrations.transformers`).

accelerate's decorator retries with a smaller batch after an out-of-memory error and forgets why; this one
keeps each try's batch size, peaks and OOM message (`fn.attempts`), and runs each inside a `torchmem.track`
phase, so under `torchmem run` the tries are in the profile.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import time
from typing import Any, Callable

import torchmem
from torchmem import _native

from ._core import is_oom

__all__ = ["Attempt", "find_executable_batch_size"]


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
