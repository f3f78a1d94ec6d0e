"""What the leak detector costs a training step, in one process: blocks of steps alternate between modes and
the fastest block of each mode counts (process start and torch's import are not in the numbers).

    python bench/leaks.py [--device cuda] [--blocks 8] [--steps 30]

Modes: `untraced` (no Monitor), `monitor, leaks off` (`Monitor(leaks=False)`), `monitor` (the default: leak
detection on, memory flat, so no probe runs: what every healthy run pays), `probing` (a probe forced over the
whole block: every torch function's outputs recorded with their line, the graph walk and a tracemalloc
snapshot at each step end; what a leaking run pays for `probe_steps` steps, then never again). Two more rows
say why the probe uses a TorchFunctionMode: a bare `TorchFunctionMode` and a bare `TorchDispatchMode`, each
keeping a weak reference to every output and nothing else. `step_end hook` is the detector's own cost per
step in a healthy run (one call into Rust), timed alone."""

from __future__ import annotations

import argparse
import platform
import statistics
import time
import weakref

import torch
import torchmem
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode


class BareFunctionMode(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.refs: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self.refs.append(weakref.ref(out))
        return out


class BareDispatchMode(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.refs: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self.refs.append(weakref.ref(out))
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--blocks", type=int, default=8, help="blocks per mode")
    ap.add_argument("--steps", type=int, default=30, help="steps per block")
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
    ).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.CrossEntropyLoss()
    x = torch.randn(args.batch, 256, device=device)
    y = torch.randint(0, 10, (args.batch,), device=device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def train_step() -> None:
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    def block(mode: str) -> float:
        mon = None
        ctx = None
        if mode == "monitor, leaks off":
            mon = torchmem.Monitor(model, opt, verbose=False, leaks=False)
        elif mode in ("monitor", "probing"):
            mon = torchmem.Monitor(model, opt, verbose=False)
        if mode == "probing":
            mon._leaks.probe_now(args.steps + 1)  # noqa: SLF001  (forced: the block's steps are all probed)
        if mode == "bare TorchFunctionMode":
            ctx = BareFunctionMode()
        elif mode == "bare TorchDispatchMode":
            ctx = BareDispatchMode()
        sync()
        t0 = time.perf_counter()
        if ctx is not None:
            with ctx:
                for _ in range(args.steps):
                    train_step()
        elif mon is not None:
            for _ in range(args.steps):
                with mon.step():
                    train_step()
        else:
            for _ in range(args.steps):
                train_step()
        sync()
        dt = (time.perf_counter() - t0) / args.steps
        if mon is not None:
            mon.close()
        return dt

    modes = [
        "untraced",
        "monitor, leaks off",
        "monitor",
        "probing",
        "bare TorchFunctionMode",
        "bare TorchDispatchMode",
    ]
    for _ in range(3):  # warm-up: allocator, optimizer state
        train_step()
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.blocks):
        for m in modes:
            times[m].append(block(m))
    # The detector's own step-end hook, alone: a healthy step's reading pushed into Rust.
    det = torchmem._leaks.LeakDetector()
    memory = {"rss_bytes": 300 << 20, "allocated_bytes": None}
    n = 200_000
    t0 = time.perf_counter()
    for i in range(n):
        det.step_end(memory, i)
    hook_ns = (time.perf_counter() - t0) / n * 1e9

    base = min(times["untraced"])
    mon_base = min(times["monitor, leaks off"])
    print(
        f"device {device.type}, {args.blocks} blocks x {args.steps} steps per mode, batch {args.batch}, "
        f"python {platform.python_version()}, torch {torch.__version__}"
    )
    print(f"{'mode':<24} {'min us/step':>12} {'median':>9} {'vs untraced':>12} {'vs leaks off':>13}")
    for m in modes:
        lo, med = min(times[m]) * 1e6, statistics.median(times[m]) * 1e6
        print(f"{m:<24} {lo:>12.1f} {med:>9.1f} {min(times[m]) / base:>12.3f} {min(times[m]) / mon_base:>13.3f}")
    print(f"step_end hook (healthy, no growth): {hook_ns:.0f} ns per step")


if __name__ == "__main__":
    main()
