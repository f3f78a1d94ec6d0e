"""What the Monitor's memory breakdown costs a training step, side by side in one process: blocks of steps
alternate between modes and the fastest block of each mode counts (process start and CUDA start are out of
the numbers; a loaded machine slows every mode alike, and interleaving spreads its noise over all of them).

    python bench/breakdown.py [--model mlp|transformer|resnet50|gpt2] [--device cuda] [--blocks 8]

Modes: `untraced` (no Monitor), `monitor` (phases only, `breakdown=False`), `breakdown` (the default with a
model: the per-category breakdown at the 4 boundaries of one step in ten, with activations through the
saved-tensors hook on that step's forward), `breakdown-every-step` (`breakdown_every=1`: every step
measured), `breakdown-no-saves` (every step's boundaries, `activations=None`: no hook, so it and the row
above split a measured step's cost), `breakdown+modules` (`activations="modules"`, one step in ten: two
more hooks per submodule call on every step), and `torch.profiler`
(`profile(profile_memory=True, record_shapes=True, with_stack=True)` around the same steps: what
`export_memory_timeline`'s categories need). Also printed: one boundary's measurement alone and the pack
hook's cost per saved tensor, from the breakdown mode's own steps. Wall time is the user's number; the
process's CPU time per step (`time.process_time()`, all threads) is printed too, because on a shared,
overloaded machine it is the steadier of the two."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
import torchmem
from torch import nn


def build(name: str, device: torch.device, batch: int) -> tuple[nn.Module, Any, Any]:
    if name == "mlp":
        model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
        x = torch.randn(batch, 512)
        return model.to(device), x.to(device), lambda out: out.float().logsumexp(1).mean()
    if name == "transformer":
        layer = nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True, dropout=0.0)
        model = nn.Sequential(nn.Embedding(1000, 256), nn.TransformerEncoder(layer, 4), nn.Linear(256, 1000))
        x = torch.randint(0, 1000, (batch, 64))
        return model.to(device), x.to(device), lambda out: out.float().logsumexp(-1).mean()
    if name == "resnet50":
        import torchvision

        model = torchvision.models.resnet50()
        x = torch.randn(batch, 3, 224, 224)
        return model.to(device), x.to(device), lambda out: out.float().logsumexp(1).mean()
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(GPT2Config())
        x = torch.randint(0, 50257, (batch, 512))
        return model.to(device), x.to(device), lambda out: out.logits.float().logsumexp(-1).mean()
    raise SystemExit(f"--model {name!r}: expected mlp, transformer, resnet50 or gpt2")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="transformer")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=6, help="blocks per mode")
    ap.add_argument(
        "--steps", type=int, default=10, help="steps per block (a multiple of 10: one measured step per block)"
    )
    ap.add_argument(
        "--modes",
        default="untraced,monitor,breakdown,breakdown+modules,torch.profiler",
        help="comma-separated modes to run (untraced always runs)",
    )
    args = ap.parse_args()
    from torchmem._breakdown import EVERY_STEPS as every
    if args.steps % every:
        raise SystemExit(
            f"--steps {args.steps}: expected a multiple of {every} (the default breakdown_every), so that every "
            "block of the sampled modes holds one measured step"
        )
    device = torch.device(args.device)
    if device.type == "cpu":
        # One intra-op thread: on a shared machine torch's spinning worker threads make every mode's time
        # (wall and CPU) mostly waiting; one thread keeps the comparison about the work done.
        torch.set_num_threads(1)
    torch.manual_seed(0)
    model, x, loss_of = build(args.model, device, args.batch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def train_step(mon: Any) -> None:
        if mon is None:
            loss_of(model(x)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return
        with mon.step():
            loss_of(model(x)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    monitors: dict[str, Any] = {}
    cpu_times: dict[str, list[float]] = {}

    def make(mode: str) -> Any:
        if mode == "monitor":
            return torchmem.Monitor(model, opt, verbose=False, warn=False, breakdown=False)
        if mode == "breakdown":
            return torchmem.Monitor(model, opt, verbose=False, warn=False)
        if mode == "breakdown-every-step":
            return torchmem.Monitor(model, opt, verbose=False, warn=False, breakdown_every=1)
        if mode == "breakdown-no-saves":  # the boundaries' measurement without the saved-tensors hook
            return torchmem.Monitor(model, opt, verbose=False, warn=False, activations=None, breakdown_every=1)
        if mode == "breakdown+modules":
            return torchmem.Monitor(model, opt, verbose=False, warn=False, activations="modules")
        return None

    # The sampled modes' step count carried from block to block, as in one long run: a fresh Monitor per block
    # would measure each block's first steps (its parameter walk is done before the block's clock starts).
    carried: dict[str, int] = {}

    def block(mode: str) -> float:
        mon = monitors.get(mode)
        if mode not in ("untraced", "torch.profiler") and mon is None:
            mon = monitors[mode] = make(mode)
            if mode in carried and mon._bd is not None:
                mon._bd.refresh_parameters()
                mon._bd._steps = mon._bd._walked_at = carried[mode]
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        if mode == "torch.profiler":
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
            with torch.profiler.profile(activities=acts, profile_memory=True, record_shapes=True, with_stack=True):
                for _ in range(args.steps):
                    train_step(None)
                sync()
        else:
            for _ in range(args.steps):
                train_step(mon)
            sync()
        dt = (time.perf_counter() - t0) / args.steps
        cpu_times[mode].append((time.process_time() - c0) / args.steps)
        if mon is not None:
            if mon._bd is not None:
                carried[mode] = mon._bd._steps
            mon.close()  # one Monitor at a time: every Monitor receives every marker
            monitors.pop(mode)
        return dt

    known = [
        "untraced",
        "monitor",
        "breakdown-no-saves",
        "breakdown-every-step",
        "breakdown",
        "breakdown+modules",
        "torch.profiler",
    ]
    asked = set(args.modes.split(",")) | {"untraced", "monitor", "breakdown"}
    if asked - set(known):
        raise SystemExit(f"--modes: unknown {sorted(asked - set(known))}; expected some of {known}")
    modes = [m for m in known if m in asked]
    for mode in modes:
        cpu_times[mode] = []
    for mode in modes:  # warm-up: optimizer state, allocator, lazy imports
        block(mode)
    for mode in modes:
        cpu_times[mode].clear()
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.blocks):
        for mode in modes:
            times[mode].append(block(mode))

    # One boundary's measurement, and the hook per saved tensor, from a breakdown Monitor's own steps.
    mon = torchmem.Monitor(model, opt, verbose=False, warn=False, breakdown_every=1)
    train_step(mon)
    bd = mon._bd
    dev = mon._dev()
    n = 50
    t0 = time.perf_counter()
    for _ in range(n):
        bd.measure(dev)
    measure_us = (time.perf_counter() - t0) / n * 1e6
    # Where one boundary's time goes (each part alone, n times; the caches as in a step's later boundaries).
    from torchmem import _devices, _ledger

    def per_call_us(f: Any) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        return (time.perf_counter() - t0) / n * 1e6

    params = bd._parameters()[0]
    parts = {
        "parameters": per_call_us(bd._parameters),
        "gradients": per_call_us(lambda: bd._gradients(params)),
        "optimizer": per_call_us(bd._optimizer_state),
        "saves": per_call_us(bd.saved.live) if bd.saved is not None else 0.0,
        "allocator": per_call_us(lambda: _ledger.counters(torch, dev)) if dev is not None else 0.0,
        "nvml": per_call_us(lambda: _devices.nvml_reading(torch, dev)) if dev is not None else 0.0,
        "rss": per_call_us(torchmem._native.self_rss_bytes),
    }
    split = ", ".join(f"{k} {v:.0f}" for k, v in parts.items())
    saved = 0
    with mon.step():
        out = model(x)
        saved = sum(len(r[0]) for r in bd.saved.records.values())
        loss_of(out).backward()
    mon.close()
    pack_calls = []

    def count(t: Any) -> Any:
        pack_calls.append(1)
        return t

    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        loss_of(model(x)).backward()
    opt.zero_grad(set_to_none=True)

    params = sum(p.numel() for p in model.parameters())
    print(
        f"model {args.model} ({params / 1e6:.1f} M parameters), device {device}, batch {args.batch}, "
        f"{args.blocks} blocks x {args.steps} steps per mode, torch {torch.__version__}, "
        f"python {sys.version.split()[0]}"
    )
    base = min(times["untraced"])
    cpu_base = min(cpu_times["untraced"])
    print(f"{'mode':<20} {'min ms/step':>12} {'median':>9} {'vs untraced':>12} {'CPU ms/step':>12} {'vs untraced':>12}")
    for mode in modes:
        t, c = times[mode], cpu_times[mode]
        print(
            f"{mode:<20} {min(t) * 1e3:>12.2f} {statistics.median(t) * 1e3:>9.2f} {min(t) / base:>12.3f} "
            f"{min(c) * 1e3:>12.2f} {min(c) / cpu_base:>12.3f}"
        )
    over = (min(times["breakdown"]) - min(times["monitor"])) * 1e6
    print(f"breakdown over monitor: {over:+.0f} us/step ({over / (base * 1e6) * 100:+.2f} % of an untraced step)")
    if "breakdown-every-step" in times:
        over = (min(times["breakdown-every-step"]) - min(times["monitor"])) * 1e6
        print(
            f"breakdown-every-step over monitor: {over:+.0f} us/step "
            f"({over / (base * 1e6) * 100:+.2f} % of an untraced step)"
        )
    print(
        "a measured step's parts: "
        f"one boundary's measure(): {measure_us:.0f} us (4 per step); "
        f"saved tensors per step: {len(pack_calls)} ({saved} live saves recorded at the end of forward)"
    )
    print(f"one boundary's parts, us each: {split}")


if __name__ == "__main__":
    main()
