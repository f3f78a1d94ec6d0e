"""What a world's size costs `torchmem estimate` (issue 24 goal: <= 60 s for 1,024 ranks on a 2-core machine).

Runs the same tiny FSDP2 program (`fully_shard` per layer and the root, AdamW, 3 steps) under `torchmem estimate`
as 1 rank, 8 ranks (`--nproc-per-node 8`) and 1,024 ranks (`--nnodes 128 --nproc-per-node 8`), side by side, each
`--repeat` times in fresh processes, and prints the median wall time of each and its ratio to 1 rank. Ranks that
behave alike are traced once, so the world's size should cost only what the fake process group and the larger
mesh cost.

Usage: `python bench/estimate/world_size.py [--repeat 3] [--layers 4] [--hidden 1024]`
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROGRAM = """
import torch, torch.nn as nn
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

dist.init_process_group("nccl")
model = nn.Sequential(*[nn.Linear({hidden}, {hidden}) for _ in range({layers})]).cuda()
for layer in model:
    fully_shard(layer)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters())
for _ in range(3):
    model(torch.randn(8, {hidden}, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
"""

WORLDS = {
    "1 rank": (),
    "8 ranks": ("--nproc-per-node", "8"),
    "1024 ranks": ("--nnodes", "128", "--nproc-per-node", "8"),
}
# The same 1,024 ranks with a hidden size that does not divide (1000: ranks 0-999 hold a row of each weight,
# 1000-1023 none): two rank classes, each traced and simulated (issue 24's classes).
UNEVEN = "1024, uneven"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "fsdp.py"
        script.write_text(PROGRAM.format(hidden=a.hidden, layers=a.layers))
        uneven = Path(d) / "fsdp_uneven.py"
        uneven.write_text(PROGRAM.format(hidden=1000, layers=a.layers))
        worlds = {**WORLDS, UNEVEN: WORLDS["1024 ranks"]}
        times: dict[str, list[float]] = {k: [] for k in worlds}
        classes: dict[str, int] = {}
        for _ in range(a.repeat):
            for name, flags in worlds.items():  # interleaved: the machine's load falls on every world alike
                t0 = time.perf_counter()
                p = subprocess.run(
                    [sys.executable, "-m", "torchmem", "estimate", "--json", *flags, "--", sys.executable,
                     str(uneven if name == UNEVEN else script)],
                    capture_output=True, text=True,
                )  # fmt: skip
                if p.returncode == 0:
                    classes[name] = len(json.loads(p.stdout).get("ranks") or [1])
                times[name].append(time.perf_counter() - t0)
                if p.returncode != 0:
                    print(f"{name}: failed\n{p.stderr[-2000:]}", file=sys.stderr)
                    return 1
    base = statistics.median(times["1 rank"])
    print(f"{'world':<14} {'classes':>7} {'median s':>9} {'vs 1 rank':>10}   (torchmem estimate, {a.repeat} runs each)")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"{name:<14} {classes.get(name, 0):>7} {m:>9.2f} {m / base:>9.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
