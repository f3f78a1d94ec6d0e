"""A training program with a batch-size argument, for `torchmem estimate --fit` and its check on a real GPU:
`python bench/estimate/fit_train.py --workload NAME --batch B [--steps 3]` trains the workload of
`scripts/gpu_estimator_truth.py` (its model, optimizer and dtype) at batch B on "cuda" and prints one JSON line:
peak allocated / reserved and whether it ran out of memory (exit 0, or 3 on an out-of-memory error).

    torchmem estimate --gpu H200 --fit 'batch=1..4096' --json -- \\
        python bench/estimate/fit_train.py --workload gpt2_adamw_amp_b8 --batch {batch}
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import gpu_estimator_truth as truth  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", required=True, choices=sorted(truth.WORKLOADS))
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument(
        "--snapshot", metavar="PATH", help="record the allocator's history and write its snapshot here (on a GPU)"
    )
    args = ap.parse_args()
    import torch

    if args.snapshot:
        torch.cuda.memory._record_memory_history(max_entries=1_000_000)

    spec = {**truth.WORKLOADS[args.workload], "batch": args.batch}
    model, opt, loss_fn, _info = truth.build(spec, torch)
    scaler = torch.amp.GradScaler("cuda") if spec["dtype"] == "amp_fp16" else None
    oom = None
    try:
        for _ in range(args.steps):
            truth.train_step(spec, torch, opt, loss_fn, scaler)
    except torch.OutOfMemoryError as e:
        oom = str(e).splitlines()[0][:200]
    out = {"workload": args.workload, "batch": args.batch, "oom": oom}
    if torch.cuda.is_available() and not oom:
        out["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        out["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    if torch.cuda.is_available():
        # Out-of-memory errors raised and caught inside the step (cuDNN then tries a plan with a smaller workspace),
        # and the allocator's free-the-cache-and-retry passes.
        stats = torch.cuda.memory_stats()
        out["num_ooms"] = stats.get("num_ooms")
        out["num_alloc_retries"] = stats.get("num_alloc_retries")
    if args.snapshot:
        torch.cuda.memory._dump_snapshot(args.snapshot)
    print(json.dumps(out), flush=True)
    return 3 if oom else 0


if __name__ == "__main__":
    sys.exit(main())
