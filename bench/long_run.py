"""A long monitored run on the CPU: a tiny model, `--epochs` x `--steps` steps under a Monitor (8 API events per
step). For the reading-back numbers of docs/benchmarks.md and to check that the Monitor's memory stays flat:

    torchmem run -q -o /tmp/long.sqlite -- python bench/long_run.py --epochs 4 --steps 25000
    /usr/bin/time -f "%e s %M KiB" torchmem report /tmp/long.sqlite
    /usr/bin/time -f "%e s %M KiB" torchmem plot /tmp/long.sqlite -o /tmp/long.html
"""

from __future__ import annotations

import argparse

import torch
import torchmem


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5000)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.CrossEntropyLoss()
    x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
    mon = torchmem.Monitor(model, opt, verbose=True)
    for _ in range(args.epochs):
        with mon.epoch():
            for _ in range(args.steps):
                with mon.step():
                    loss_fn(model(x), y).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
    print(mon.summary())


if __name__ == "__main__":
    main()
