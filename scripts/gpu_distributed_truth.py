"""Records per-rank allocator truth of sharded training on ONE GPU (issue 24; run it on the H200).

Each config runs in a fresh process as rank R of a world of N on torch's `fake` process group
(`torch.testing._internal.distributed.fake_pg`, a `FakeStore`): every collective allocates its real outputs on the
GPU and sends nothing, so the caching allocator's peaks are rank R's peaks of the real N-GPU job, NCCL's own buffers
excepted (../shared/docs/distributed-estimation.md). DDP's reducer does not run on the fake backend (its comm hook
asserts), and its buckets do not depend on N: DDP configs run on a real 1-rank NCCL group (world 1, via a local
TCP store); their NCCL buffers are then a 1-rank communicator's (none), which the estimate's NCCL model states
apart anyway.

Per config and step: `torch.cuda.memory_stats()` peaks (allocated, reserved, active, requested) after each optimizer
step, and the number of parameter elements this rank holds. Output: `OUT/distributed-truth.json.gz` (one object:
versions, device, configs). The estimate of each config is `torchmem estimate --nnodes 1 --nproc-per-node N --rank R
--json -- python scripts/gpu_distributed_truth.py --child CONFIG` (the child runs the same code on the emulated device
when it finds no GPU).

Usage: `python scripts/gpu_distributed_truth.py OUT [--only NAME,PREFIX*,...] [--steps 3] [--jobs 6]`
       `python scripts/gpu_distributed_truth.py --child NAME --snapshot FILE.pickle` (with the allocator history)
       `python scripts/gpu_distributed_truth.py --child NAME` (one config in this process; prints JSON)
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# name -> (kind, world size, rank, options). Sizes: a Llama-like MLP stack big enough to matter on an H200.
CONFIGS: dict[str, tuple[str, int, int, dict]] = {}
for n in (2, 8, 64, 1024):
    CONFIGS[f"fsdp2-w{n}"] = ("fsdp2", n, 0, {})
    CONFIGS[f"fsdp2-bf16-w{n}"] = ("fsdp2", n, 0, {"mp": "bf16"})
CONFIGS["fsdp2-noreshard-w8"] = ("fsdp2", 8, 0, {"reshard_after_forward": False})
CONFIGS["fsdp2-ckpt-w8"] = ("fsdp2", 8, 0, {"checkpoint": True})
CONFIGS["fsdp2-w8-rank7"] = ("fsdp2", 8, 7, {})
CONFIGS["hsdp-2x8"] = ("hsdp", 16, 0, {})
CONFIGS["tp-w4"] = ("tp", 4, 0, {})
CONFIGS["tp-w8"] = ("tp", 8, 0, {})
CONFIGS["fsdp-tp-4x4"] = ("fsdp_tp", 16, 0, {})
# FSDP2's other knobs, FSDP1, sequence parallel and checkpointing under TP (issue 24's remaining parallelisms).
CONFIGS["fsdp2-reshard2-w8"] = ("fsdp2", 8, 0, {"reshard_after_forward": 2})
CONFIGS["fsdp2-offload-w8"] = ("fsdp2", 8, 0, {"offload": True})
CONFIGS["fsdp2-prefetch-w8"] = ("fsdp2", 8, 0, {"prefetch": 2})
CONFIGS["hsdp-ckpt-2x8"] = ("hsdp", 16, 0, {"checkpoint": True})
CONFIGS["fsdp1-w8"] = ("fsdp1", 8, 0, {})
CONFIGS["fsdp1-noreshard-w8"] = ("fsdp1", 8, 0, {"sharding": "SHARD_GRAD_OP"})
CONFIGS["tp-sp-w4"] = ("tp", 4, 0, {"sequence_parallel": True})
CONFIGS["tp-ckpt-w4"] = ("tp", 4, 0, {"checkpoint": True})
CONFIGS["ddp"] = ("ddp", 1, 0, {})
CONFIGS["ddp-bucket-view"] = ("ddp", 1, 0, {"gradient_as_bucket_view": True})
CONFIGS["ddp-static"] = ("ddp", 1, 0, {"static_graph": True})
# Uneven shards (issue 24 rank classes): a hidden size of 1000 (up: 4000 x 1000, down: 1000 x 4000) at 24 ranks
# (torch.chunk: ranks 0-22 hold 42 / 167 rows, rank 23 34 / 159) and at 64 (ranks 0-61 16 / 63 rows, rank 62 8 / 63,
# rank 63 0 / 31): one config per class.
for n, ranks in ((24, (0, 23)), (64, (0, 62, 63))):
    for r in ranks:
        CONFIGS[f"fsdp2-uneven-w{n}" + (f"-rank{r}" if r else "")] = ("fsdp2", n, r, {"hidden": 1000})
# Pipeline parallel (torch.distributed.pipelining): the 8 blocks split over 2 or 4 stages, one stage per rank, 8
# microbatches of 1 sequence, GPipe and 1F1B; every stage's rank.
for n in (2, 4):
    for sched in ("gpipe", "1f1b"):
        for r in range(n):
            CONFIGS[f"pp{n}-{sched}" + (f"-rank{r}" if r else "")] = ("pp", n, r, {"schedule": sched})

HIDDEN, LAYERS, BATCH, SEQ = 4096, 8, 8, 1024
MICROBATCHES = 8
DDP_PORT = 29517  # + the config's index: DDP configs run side by side (--jobs), each on its own 1-rank group


def _p2p_done() -> None:
    """Point-to-point ops complete at once with nothing sent (pipeline parallel on the fake backend, which may not
    implement send/recv): the receive buffers are the stage's own, allocated before the receive, so the memory is
    what the real job's is (NCCL's buffers apart, as for every collective here)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    class Done:
        def wait(self, *args, **kwargs):
            return True

        def is_completed(self):
            return True

        def is_success(self):
            return True

    def isend(*args, **kwargs):
        return Done()

    def irecv(*args, **kwargs):
        return Done()

    def batch_isend_irecv(ops):
        return [Done() for _ in ops]

    for mod in (dist, c10d):
        mod.isend, mod.irecv, mod.batch_isend_irecv = isend, irecv, batch_isend_irecv


def _child(name: str, steps: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    kind, n, rank, opts = CONFIGS[name]
    session = sys.modules.get("torchmem.estimator._session")
    under_estimate = session is not None and session._active is not None  # `torchmem estimate -- ... --child`
    on_gpu = torch.cuda.is_available() and not under_estimate
    if kind == "ddp":
        port = DDP_PORT + list(CONFIGS).index(name)
        dist.init_process_group("nccl" if on_gpu else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1)  # fmt: skip
    elif on_gpu:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=n)
    else:  # under `torchmem estimate`: the emulated world
        dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    hidden = opts.get("hidden", HIDDEN)
    # The rank as the process group says: under `torchmem estimate --rank R` the traced rank, else the config's.
    me = dist.get_rank()

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(hidden, 4 * hidden, bias=False)
            self.down = nn.Linear(4 * hidden, hidden, bias=False)
            self.norm = nn.LayerNorm(hidden) if opts.get("sequence_parallel") else None

        def forward(self, x):
            h = x if self.norm is None else self.norm(x)
            return x + self.down(torch.nn.functional.gelu(self.up(h)))

    blocks = LAYERS // n if kind == "pp" else LAYERS  # a pipeline stage holds its share of the blocks
    model = nn.Sequential(*[Block() for _ in range(blocks)]).cuda()
    schedule = None
    from torch.distributed.device_mesh import init_device_mesh

    if kind in ("fsdp2", "hsdp", "fsdp_tp"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if kind == "hsdp":
            mesh = init_device_mesh("cuda", (2, n // 2), mesh_dim_names=("replicate", "shard"))
        elif kind == "fsdp_tp":
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            mesh2 = init_device_mesh("cuda", (4, n // 4), mesh_dim_names=("dp", "tp"))
            for block in model:
                parallelize_module(block, mesh2["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
            mesh = mesh2["dp"]
        else:
            mesh = init_device_mesh("cuda", (n,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if opts.get("mp") else None
        kw = {"mesh": mesh, "reshard_after_forward": opts.get("reshard_after_forward", True)}
        if mp is not None:
            kw["mp_policy"] = mp
        if opts.get("offload"):
            from torch.distributed.fsdp import CPUOffloadPolicy

            kw["offload_policy"] = CPUOffloadPolicy()
        for block in model:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        if opts.get("prefetch"):  # explicit prefetching, `prefetch` blocks ahead in both directions
            blocks_ = list(model)
            for i, block in enumerate(blocks_):
                block.set_modules_to_forward_prefetch(blocks_[i + 1 : i + 1 + opts["prefetch"]])
                block.set_modules_to_backward_prefetch(blocks_[max(0, i - opts["prefetch"]) : i][::-1])
    elif kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        strategy = ShardingStrategy[opts.get("sharding", "FULL_SHARD")]
        model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=0,
                                         sharding_strategy=strategy)  # fmt: skip
    elif kind == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cuda", (n,))
        if opts.get("sequence_parallel"):  # activations sharded on the sequence between blocks (torchtitan's plan)
            from torch.distributed.tensor import Shard
            from torch.distributed.tensor.parallel import SequenceParallel

            plan = {"norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
                    "down": RowwiseParallel(output_layouts=Shard(1))}  # fmt: skip
        else:
            plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
        for block in model:
            parallelize_module(block, mesh, plan)
    elif kind == "pp":
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        if on_gpu:
            _p2p_done()
        # Static metadata (one microbatch in and out): no shape inference, which would need the peers.
        meta = torch.empty(BATCH // MICROBATCHES, SEQ, hidden, device="meta")
        stage = PipelineStage(model, me, n, torch.device("cuda", 0), input_args=(meta,),
                              output_args=(meta.clone().requires_grad_(),))  # fmt: skip
        cls = ScheduleGPipe if opts["schedule"] == "gpipe" else Schedule1F1B
        schedule = cls(stage, n_microbatches=MICROBATCHES, loss_fn=lambda y, t: y.float().pow(2).mean())
    elif kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, device_ids=[0], gradient_as_bucket_view=opts.get("gradient_as_bucket_view", False),
                    static_graph=opts.get("static_graph", False))  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    per_step = []
    for _ in range(steps):
        seq = SEQ // n if opts.get("sequence_parallel") else SEQ  # this rank's slice of the sequence
        x = torch.randn(BATCH, seq, hidden, device="cuda") if schedule is None or me == 0 else None
        if schedule is not None:
            if me == 0:
                schedule.step(x)
            elif me == n - 1:
                schedule.step(target=torch.empty(BATCH, device="cuda"), losses=[])
            else:
                schedule.step()
        elif opts.get("checkpoint"):
            from torch.utils.checkpoint import checkpoint

            y = x
            for block in model:
                y = checkpoint(block, y, use_reentrant=False)
        else:
            y = model(x)
        if schedule is None:
            y.float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if on_gpu:
            s = torch.cuda.memory_stats()
            per_step.append({k: s.get(k, 0) for k in (
                "allocated_bytes.all.peak", "reserved_bytes.all.peak", "active_bytes.all.peak",
                "requested_bytes.all.peak", "allocated_bytes.all.current")})  # fmt: skip
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
    return {"name": name, "kind": kind, "world_size": n, "rank": rank, "options": opts, "steps": per_step,
            "local_parameter_elements": local}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?")
    ap.add_argument("--child")
    ap.add_argument("--only")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=1, help="configs run side by side, each in its own process")
    ap.add_argument("--snapshot", help="with --child: keep the allocator history, dump it to this pickle")
    a = ap.parse_args()
    if a.child and a.snapshot:
        import torch

        torch.cuda.memory._record_memory_history(max_entries=2_000_000)
        r = _child(a.child, a.steps)
        torch.cuda.memory._dump_snapshot(a.snapshot)
        print(json.dumps(r))
        return 0
    if a.child:
        print(json.dumps(_child(a.child, a.steps)))
        return 0
    if not a.out:
        ap.error("give OUT (a folder)")
    import torch

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    names = list(CONFIGS)
    if a.only:  # names, or prefixes ending in '*'
        want = a.only.split(",")
        names = [c for c in CONFIGS if any(c == w or (w.endswith("*") and c.startswith(w[:-1])) for w in want)]
        unknown = [w for w in want if not w.endswith("*") and w not in CONFIGS]
        if unknown:
            ap.error(f"unknown config(s): {', '.join(unknown)}")
    done: dict[str, dict] = {}
    lock = threading.Lock()

    def one(name: str) -> None:
        t0 = time.time()
        p = subprocess.run([sys.executable, __file__, "--child", name, "--steps", str(a.steps)], capture_output=True,
                           text=True, timeout=1800)  # fmt: skip
        r = {"name": name, "seconds": round(time.time() - t0, 1)}
        if p.returncode == 0:
            r.update(json.loads(p.stdout.strip().splitlines()[-1]))
        else:
            r["error"] = p.stderr[-3000:]
        with lock:
            done[name] = r
            print(name, "ok" if "error" not in r else "FAILED", r["seconds"], "s", flush=True)
            doc = {  # written after each config: a run cut short keeps what it recorded
                "torch": torch.__version__,
                "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                "configs": [done[n] for n in names if n in done],
            }
            with gzip.open(out / "distributed-truth.json.gz", "wt") as f:
                json.dump(doc, f)

    # Fresh processes side by side (--jobs): each has its own caching allocator, so its peaks are its own.
    with ThreadPoolExecutor(max(1, a.jobs)) as ex:
        list(ex.map(one, names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
