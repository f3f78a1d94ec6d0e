"""The PyTorch memory guide's steps, done with torchmem: read the device's total memory, watch allocated,
reserved and peak memory every epoch (with forward/backward/optimizer phases recorded by hooks), empty the
cache after each epoch and see what that really freed, then print the summary and the memory journey.

A small MLP on synthetic data: a few seconds on a CPU, and on a GPU when there is one.

    python examples/train.py                      # CUDA when available, else CPU
    python examples/train.py --device cpu --epochs 3 --steps 20
    python examples/train.py --leak               # `total_loss += loss`: memory grows, torchmem warns
    torchmem run -- python examples/train.py      # the same, recorded as a timeline profile
"""

from __future__ import annotations

import argparse
import time

import torch
import torchmem
from torch import nn


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=4, help="number of epochs (default 4)")
    p.add_argument("--steps", type=int, default=20, help="steps per epoch (default 20)")
    p.add_argument("--batch", type=int, default=128, help="batch size (default 128)")
    p.add_argument("--hidden", type=int, default=512, help="hidden width of the MLP (default 512)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    p.add_argument(
        "--leak",
        action="store_true",
        help="log the loss as `total_loss += loss` on a tensor with autograd history (not `loss.item()`): "
        "every step's graph and activations stay alive",
    )
    p.add_argument("--mermaid", action="store_true", help="also print the journey as a Mermaid diagram")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available here; use --device cpu")

    # 1. The device: total memory and what other processes use (NVML; no CUDA context is created).
    info = torchmem.device_info()
    if device.type == "cuda":
        for d in info["devices"]:
            print(
                f"GPU {d['index']}: {d['name']}, total {d['total_bytes'] / 2**30:.2f} GiB, "
                f"free {d['free_bytes'] / 2**30:.2f} GiB, "
                f"other processes {d['other_processes_bytes'] / 2**20:.0f} MiB"
            )
    print(
        f"host RAM: total {info['host_total_bytes'] / 2**30:.2f} GiB, "
        f"available {info['host_available_bytes'] / 2**30:.2f} GiB"
    )
    print(f"training on {device}")

    # 2. The model and optimizer; the Monitor hooks forward, backward and the optimizer step.
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(512, args.hidden),
        nn.ReLU(),
        nn.Linear(args.hidden, args.hidden),
        nn.ReLU(),
        nn.Linear(args.hidden, 10),
    ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    mon = torchmem.Monitor(model, optimizer)
    print(torchmem.stats())

    # 3. Train: one line per epoch (allocated, reserved, peak, CPU RSS, growth), cache emptied after each.
    started = time.perf_counter()
    total_loss: torch.Tensor | float = 0.0  # the run's running loss, for logging
    for _ in range(args.epochs):
        with mon.epoch():
            for _ in range(args.steps):
                with mon.step():
                    x = torch.randn(args.batch, 512, device=device)
                    y = torch.randint(0, 10, (args.batch,), device=device)
                    loss = loss_fn(model(x), y)
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    if args.leak:
                        # The classic leak: a loss tensor with its autograd history (here the logging
                        # forward's whole graph, activations included) is summed instead of `.item()`.
                        total_loss += loss_fn(model(x), y)
                    else:
                        total_loss += loss.item()
        released = torchmem.empty_cache()
        print(f"  {released}")
    print(f"trained {args.epochs} epochs x {args.steps} steps in {time.perf_counter() - started:.2f} s")

    # 4. Where the memory went.
    print(torchmem.peak())
    print(torchmem.stats(uss=True))
    print(mon.summary())
    print(mon.journey())
    if args.mermaid:
        print(mon.journey(format="mermaid"))


if __name__ == "__main__":
    main()
