"""What `torchmem run`'s automatic watch costs a step of bench/short_steps.py's loop (a 3-layer MLP, batch 64,
one thread), measured inside one process: blocks of 100 steps alternate between the modes, and the median
and the lower quartile of each mode's blocks count (whole-process timings on a shared machine vary by
±30 %; blocks side by side in one process see the same machine). Run it under the recorder with the
automatic watch off (the script makes its own):

    TORCHMEM_WATCH=0 torchmem run -q -o /tmp/ac.sqlite -- python bench/autowatch_cost.py [--rounds 25]

Modes: `bare` (no hooks; the sampler thread runs, as under `torchmem run`), `no sampler` (no hooks, the
sampler thread stopped: what the sampler costs), `every step` (`torchmem.watch`: phases and markers on
every step, what the automatic watch did before it skipped unmeasured steps) and `automatic` (the automatic
watch's Monitor, `_sampled_watch.SampledWatch`: the measured steps only, one in 10 within a 1 % budget)."""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torchmem
from torchmem import _events, _native
from torchmem._sampled_watch import sampled_watch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--steps", type=int, default=100, help="steps per block")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    w = 256
    model = torch.nn.Sequential(
        torch.nn.Linear(w, w), torch.nn.ReLU(), torch.nn.Linear(w, w), torch.nn.ReLU(), torch.nn.Linear(w, 10)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    xs, ys = torch.randn(8, 64, w), torch.randint(0, 10, (8, 64))

    def block(n: int) -> float:
        start = time.perf_counter()
        for i in range(n):
            loss = loss_fn(model(xs[i % 8]), ys[i % 8])
            opt.zero_grad()
            loss.backward()
            opt.step()
        return (time.perf_counter() - start) / n * 1e6

    sampler = _native.allocator_sampler_running()
    modes = ["bare", "no sampler", "every step", "automatic"] if sampler else ["bare", "every step", "automatic"]
    results: dict[str, list[float]] = {m: [] for m in modes}
    block(200)  # warm-up
    # The automatic watch's blocks continue one run: its step count, budget and time carry over.
    auto_forwards, auto_spent_ns, auto_elapsed_ns = 1000, 0, 0  # past the first measured steps
    for _ in range(args.rounds):
        for mode in modes:
            mon = None
            if mode == "no sampler":
                _native.stop_allocator_sampler()
            elif mode == "every step":
                mon = torchmem.watch(model, opt)
            elif mode == "automatic":
                mon = sampled_watch(model, opt, "total")
                mon._forwards, mon._spent_ns = auto_forwards, auto_spent_ns
                mon._t0_ns = time.perf_counter_ns() - auto_elapsed_ns
            block(10)
            results[mode].append(block(args.steps))
            if mode == "automatic":
                auto_forwards, auto_spent_ns = mon._forwards, mon._spent_ns
                auto_elapsed_ns = time.perf_counter_ns() - mon._t0_ns
            if mon is not None:
                mon.close()
            if mode == "no sampler":
                _native.start_allocator_sampler(10.0)
    print(f"events sent: {_events.enabled()}   sampler: {sampler}   rounds: {args.rounds} x {args.steps} steps")
    base = statistics.median(results["bare"])
    print(f"{'mode':<12} {'median us/step':>15} {'q1 us/step':>11} {'ratio':>7}")
    for mode, v in results.items():
        med, q1 = statistics.median(v), statistics.quantiles(v, n=4)[0]
        print(f"{mode:<12} {med:15.0f} {q1:11.0f} {med / base:7.3f}")


if __name__ == "__main__":
    main()
