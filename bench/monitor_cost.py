"""What the in-process side of `torchmem run` costs a training step, measured inside one process: blocks of
steps alternate between four modes and the fastest block of each mode counts. Run it under the recorder:

    torchmem run -q -o /tmp/mc.sqlite -- python bench/monitor_cost.py [--device cuda] [--blocks 12]
    python bench/monitor_cost.py        # without the recorder: `bare` and `monitor` only

Modes: `bare` (no Monitor, no events, sampler stopped), `monitor` (the Monitor's hooks, events not sent: what
the same program costs outside `torchmem run`), `monitor+events` (events sent, sampler stopped: they are
written at once) and `monitor+events+sampler` (the default of `torchmem run`). Process start, torch's
import and CUDA's start, which swamp whole-process timings, are not in these numbers; the external
recorder's cost is (it samples this process throughout), equally in every mode."""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torchmem
import torchmem._bootstrap  # noqa: F401  (as the injected sitecustomize does; harmless when already loaded)
from torchmem import _events, _ledger, _native


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--blocks", type=int, default=12, help="blocks per mode")
    ap.add_argument("--steps", type=int, default=50, help="steps per block")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument(
        "--profile", action="store_true", help="also: cProfile of monitored steps, and what each read costs"
    )
    args = ap.parse_args()
    recording = _events.enabled()  # False outside `torchmem run`: then only `bare` and `monitor` run
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 10),
    ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.CrossEntropyLoss()
    x = torch.randn(args.batch, 512, device=device)
    y = torch.randint(0, 10, (args.batch,), device=device)
    interval_ms = 10.0

    def train_step() -> float:
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    def block(mon: torchmem.Monitor | None) -> float:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            if mon is None:
                train_step()
            else:
                with mon.step():
                    train_step()
        return (time.perf_counter() - t0) / args.steps

    bare_model_hooks = None
    mon = torchmem.Monitor(model, optimizer, verbose=False, warn=False)
    modes = ["bare", "monitor", "monitor+events", "monitor+events+sampler"] if recording else ["bare", "monitor"]
    per_step: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(3):  # warm-up: allocator, cuBLAS handles, lazy imports
        block(None)
    for _ in range(args.blocks):
        for m in modes:
            _events._on = recording and "events" in m
            if "sampler" in m:
                _native.start_allocator_sampler(interval_ms)
            else:
                _native.stop_allocator_sampler()
            if m == "bare":
                mon.close()  # removes the hooks
                bare_model_hooks = True
            elif bare_model_hooks:
                mon = torchmem.Monitor(model, optimizer, verbose=False, warn=False)
                bare_model_hooks = None
            with mon.epoch() if m != "bare" else _Null():
                per_step[m].append(block(None if m == "bare" else mon))
    _events._on = recording
    _native.start_allocator_sampler(interval_ms)
    smaps_ms = []
    for _ in range(5):  # what one PSS/USS read of this process costs the recorder (it holds our mmap lock)
        t0 = time.perf_counter()
        with open("/proc/self/smaps_rollup") as f:
            f.read()
        smaps_ms.append((time.perf_counter() - t0) * 1e3)
    if args.profile:
        _profile(mon, block, args.device)
    base = min(per_step["bare"])
    mon_base = min(per_step["monitor"])
    where = "under torchmem run" if recording else "without torchmem run"
    print(f"device {args.device}, {where}, {args.blocks} blocks x {args.steps} steps per mode, python {_pyver()}")
    print(f"{'mode':<24} {'min us/step':>12} {'median':>9} {'vs bare':>8} {'vs monitor':>10}")
    for m in modes:
        v = per_step[m]
        print(
            f"{m:<24} {min(v) * 1e6:12.1f} {statistics.median(v) * 1e6:9.1f} "
            f"{min(v) / base:8.3f} {min(v) / mon_base:10.3f}"
        )
    print("events per monitored step: 8 (step, forward, backward, optimizer step; start and end)")
    print(
        f"one /proc/self/smaps_rollup read: {min(smaps_ms):.2f} ms (min of 5), RSS {_native.self_rss_bytes() >> 20} MiB"
    )


def _profile(mon: torchmem.Monitor, block, device: str) -> None:  # noqa: ANN001
    """Where a monitored step's extra time goes: cProfile, then the cost of each read the API makes."""
    import cProfile
    import pstats
    import timeit

    from torchmem import _devices, _markers

    prof = cProfile.Profile()
    with mon.epoch():
        prof.enable()
        block(mon)
        prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    dev = 0 if device.startswith("cuda") else None
    torch_now = _devices.imported_torch
    reads = {
        "self_memory (/proc/self/status)": _native.self_memory,
        "self_rss_bytes (statm)": _native.self_rss_bytes,
        "rss_period_restart (own peak counter)": _native.rss_period_restart,
        "ledger open+close": lambda: _ledger.close_window(torch_now(), _ledger.open_window(torch_now(), dev)[0]),
        "_Span open+close (phase)": lambda: _markers.Span("phase", "x", None, dev).close(),
        "mon._dev()": mon._dev,
    }
    if dev is not None:
        reads["_cuda_memoryStats"] = lambda: torch._C._cuda_memoryStats(0)
        reads["_counters"] = lambda: _devices.counters(torch, 0)
        reads["_cuda_resetPeakMemoryStats"] = lambda: torch._C._cuda_resetPeakMemoryStats(0)
    for name, fn in reads.items():
        n = 2000
        t = min(timeit.repeat(fn, number=n, repeat=3)) / n
        print(f"  {name:<36} {t * 1e6:8.2f} us")


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _pyver() -> str:
    import sys

    return sys.version.split()[0]


if __name__ == "__main__":
    main()
