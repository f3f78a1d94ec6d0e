"""A CPU training loop of short steps, the case where per-step costs of `torchmem run` show most: a 3-layer MLP,
batch 64, one thread (`torch.set_num_threads(1)`), ~1.5 ms a step, 800 steps, no Monitor in the program
(`torchmem run` finds the model and optimizer by itself). Prints "trained 1 epochs x N steps in X s" (the loop
alone, as `examples/train.py` does) and the main thread's CPU time in the loop, which `bench/run_overhead.py`
reads:

    .venv/bin/python bench/run_overhead.py --short-steps      # bare, run, TORCHMEM_WATCH=0, --no-inject, mprof
    .venv/bin/python bench/short_steps.py [--steps 800] [--width 256]
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--width", type=int, default=256, help="input and hidden width")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    w = args.width
    model = torch.nn.Sequential(
        torch.nn.Linear(w, w), torch.nn.ReLU(), torch.nn.Linear(w, w), torch.nn.ReLU(), torch.nn.Linear(w, 10)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    xs = torch.randn(8, args.batch, w)
    ys = torch.randint(0, 10, (8, args.batch))
    start, start_cpu = time.perf_counter(), time.thread_time()
    for i in range(args.steps):
        loss = loss_fn(model(xs[i % 8]), ys[i % 8])
        opt.zero_grad()
        loss.backward()
        opt.step()
    elapsed, cpu = time.perf_counter() - start, time.thread_time() - start_cpu
    print(f"trained 1 epochs x {args.steps} steps in {elapsed:.3f} s")
    # The loop's own CPU time (this thread's): what the program's thread did, steadier than wall time on a
    # loaded machine (waiting for a core is not in it; waiting for the GIL is not either).
    print(f"main thread CPU {cpu:.3f} s")


if __name__ == "__main__":
    main()
