"""`torchmem estimate` on the patterns of real CUDA training scripts, each a small unchanged script run by the CLI
on this CPU-only machine (issue 23, item 1): deep-copied modules (nn.TransformerEncoder, EMA models), pinned
memory and DataLoader workers with `non_blocking` copies, a forked `multiprocessing` pool, the `torch.cuda` calls
programs make (streams, events, memory counters, RNG state, device properties), GradScaler, clipping and gradient
accumulation, and a torchrun-style `init_process_group("nccl")`, which runs as one rank of an emulated world
instead of waiting for ranks that never come."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

if torch.cuda.is_available():  # pragma: no cover - these tests are about machines without a GPU
    pytest.skip("the estimator tests run on a machine without a GPU", allow_module_level=True)


def _estimate(script: Path, *args: str, env: dict | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, TORCHMEM_PYTHON=sys.executable, **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "torchmem", "estimate", "--gpu", "H200", "--steps", "2", "--json", "--",
         sys.executable, str(script), *args],
        capture_output=True, text=True, cwd=script.parent, env=full_env, timeout=timeout,
    )  # fmt: skip


def _ok(p: subprocess.CompletedProcess) -> dict:
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout)
    assert r["steps_traced"] == 2, r
    return r


# A model with a deep-copied submodule (nn.TransformerEncoder copies its layer), trained with AdamW; the variants
# copy the whole model before `.to("cuda")` (the copy goes to the GPU, the original stays on the CPU) or keep an
# EMA copy on the GPU, updated in place after each step (no temporaries).
DEEPCOPY_SCRIPT = """
import copy, sys
import torch, torch.nn as nn

variant = sys.argv[1]
torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(500, 64)
        if variant == "layers":
            self.enc = nn.ModuleList([nn.TransformerEncoderLayer(64, 4, 128, batch_first=True) for _ in range(2)])
        else:
            self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(64, 4, 128, batch_first=True), 2)
        self.head = nn.Linear(64, 500)

    def forward(self, x):
        h = self.emb(x)
        if variant == "layers":
            for layer in self.enc:
                h = layer(h)
        else:
            h = self.enc(h)
        return self.head(h)


model = Net()
if variant == "copy-before-cuda":
    model = copy.deepcopy(model)
model = model.to("cuda")
ema = copy.deepcopy(model).eval() if variant == "ema" else None
if ema is not None:
    for p in ema.parameters():
        p.requires_grad_(False)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
print("PARAM_BYTES", sum((p.numel() * p.element_size() + 511) // 512 * 512 for p in model.parameters()), flush=True)
for step in range(5):
    x = torch.randint(0, 500, (8, 32), device="cuda")
    loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if ema is not None:
        with torch.no_grad():
            for pe, pm in zip(ema.parameters(), model.parameters()):
                pe.lerp_(pm, 0.01)
"""


def test_deepcopied_modules_transformer_encoder_and_ema(tmp_path):
    """Failed before: `_apply(): Couldn't swap Linear.weight` (a deep-copied fake tensor got a copy of the fake
    mode, whose memo held a weak reference to it). A TransformerEncoder (it deep-copies its layer) costs what
    the same layers built one by one cost; copying the model before `.to("cuda")` costs nothing on the GPU; an
    EMA copy on the GPU costs exactly one more copy of the parameters."""
    script = tmp_path / "train.py"
    script.write_text(DEEPCOPY_SCRIPT)
    procs = {v: _estimate(script, v) for v in ("layers", "encoder", "copy-before-cuda", "ema")}
    runs = {v: _ok(p) for v, p in procs.items()}
    base = runs["layers"]
    for v in ("encoder", "copy-before-cuda"):
        for key in ("peak_allocated_bytes", "peak_reserved_bytes"):
            assert runs[v][key] == base[key], (v, key, runs[v][key], base[key])
    # One more copy of the parameters, each tensor rounded as the allocator rounds it (512 B).
    line = next(ln for ln in procs["ema"].stderr.splitlines() if ln.startswith("PARAM_BYTES"))
    param_bytes = int(line.split()[1])
    assert param_bytes > 500 * 64 * 4 * 2
    assert runs["ema"]["peak_allocated_bytes"] == base["peak_allocated_bytes"] + param_bytes


# Most CUDA training scripts: a DataLoader with pinned memory and worker processes, copies with non_blocking=True;
# and a program's own forked pool of CPU workers.
LOADER_SCRIPT = """
import multiprocessing as mp, sys
import torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

pin, workers = sys.argv[1] == "pin", int(sys.argv[2])


def cpu_work(i):
    t = torch.arange(4.0) + i
    return t, type(t).__name__


if __name__ == "__main__":
    if workers:
        with mp.get_context("fork").Pool(2) as pool:
            got = pool.map(cpu_work, range(2))
        print("POOL", [(r[1], r[0].tolist()) for r in got], flush=True)
        if pin:
            x = torch.randn(16, 32).pin_memory()
            print("PINNED", x.is_pinned(), torch.empty(8, pin_memory=True).is_pinned(), flush=True)
    ds = TensorDataset(torch.randn(512, 3, 32, 32), torch.randint(0, 10, (512,)))
    kw = dict(num_workers=workers, persistent_workers=True, prefetch_factor=4) if workers else {}
    dl = DataLoader(ds, batch_size=64, shuffle=True, pin_memory=pin, drop_last=True, **kw)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 32 * 32, 10))
    model = model.cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(3):
        for x, y in dl:
            if pin:
                print("BATCH_PINNED", x.is_pinned(), flush=True)
            x = x.cuda(non_blocking=True)
            y = y.to("cuda", non_blocking=True)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
"""


def test_pinned_memory_dataloader_workers_and_a_forked_pool(tmp_path):
    """Failed before: `NYI: aten._pin_memory.default`, and a forked pool's results could not be sent back (a
    fake tensor cannot be pickled). Pinned memory is host memory: the estimate equals the one without it; the
    workers cost no device memory either; a forked child computes real CPU tensors."""
    script = tmp_path / "train.py"
    script.write_text(LOADER_SCRIPT)
    plain = _ok(_estimate(script, "plain", "0"))
    p = _estimate(script, "pin", "2")
    pinned = _ok(p)
    for key in ("peak_allocated_bytes", "peak_reserved_bytes", "nvml_bytes"):
        assert pinned[key] == plain[key], key
    assert "POOL [('Tensor', [0.0, 1.0, 2.0, 3.0]), ('Tensor', [1.0, 2.0, 3.0, 4.0])]" in p.stderr, p.stderr[-2000:]
    assert "PINNED True True" in p.stderr
    assert "BATCH_PINNED True" in p.stderr and "BATCH_PINNED False" not in p.stderr
    assert any("DataLoader workers" in n for n in pinned["notes"]), pinned["notes"]


# The torch.cuda calls a training script makes around its step, and a step with AMP's GradScaler, gradient
# accumulation and clipping. "bare" is the same training without the calls.
CUDA_CALLS_SCRIPT = """
import sys
import torch, torch.nn as nn

calls = sys.argv[1] == "calls"
if calls:
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(0)
    torch.cuda.manual_seed(0)
    torch.cuda.manual_seed_all(0)
    torch.cuda.set_rng_state(torch.cuda.get_rng_state())
    torch.cuda.set_rng_state_all(torch.cuda.get_rng_state_all())
    with torch.random.fork_rng(devices=[0]):
        pass
    props = torch.cuda.get_device_properties(0)
    print("DEVICE", torch.cuda.get_device_name(0), "|", props.name, props.total_memory, flush=True)
model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cuda")
side = torch.cuda.Stream() if calls else None
accum = 2
if calls:
    torch.cuda.reset_peak_memory_stats()
for step in range(10):
    if calls:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    for micro in range(accum):
        if calls:
            with torch.cuda.stream(side):
                x = torch.randn(64, 256, device="cuda")
            torch.cuda.current_stream().wait_stream(side)
            x.record_stream(torch.cuda.current_stream())
        else:
            x = torch.randn(64, 256, device="cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().pow(2).mean() / accum
        scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    if calls:
        end.record()
        torch.cuda.synchronize()
        end.synchronize()
        rate = 64 * accum / (start.elapsed_time(end) / 1e3)
        stats = torch.cuda.memory_stats()
        print("STEP", step, torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated(),
              torch.cuda.memory_reserved(), torch.cuda.max_memory_reserved(),
              stats["reserved_bytes.all.current"], torch.cuda.mem_get_info()[1], rate > 0, flush=True)
        torch.cuda.empty_cache()
"""


def test_cuda_calls_streams_events_rng_and_amp_accumulation(tmp_path):
    """Failed before: `torch.cuda.get_rng_state() needs a real CUDA device`, then `record_stream` refused the
    stand-in stream. The calls do not change the allocated peak; the input made on the side stream comes from that
    stream's own pool (the caching allocator keeps one per stream), so reserved and NVML hold one more 2 MiB
    small-pool segment; the device is the emulated GPU; the memory counters are the trace's (allocated) and the
    allocator simulator's (reserved)."""
    script = tmp_path / "train.py"
    script.write_text(CUDA_CALLS_SCRIPT)
    bare = _ok(_estimate(script, "bare"))
    p = _estimate(script, "calls")
    r = _ok(p)
    assert r["peak_allocated_bytes"] == bare["peak_allocated_bytes"]
    for key in ("peak_reserved_bytes", "nvml_bytes"):
        assert r[key] == bare[key] + (2 << 20), key
    h200_bytes = 150_109_880_320
    assert f"DEVICE NVIDIA H200 | NVIDIA H200 {h200_bytes}" in p.stderr, p.stderr[-2000:]
    step = next(ln.split()[1:] for ln in p.stderr.splitlines() if ln.startswith("STEP 0 "))
    allocated, max_allocated, reserved, max_reserved, stats_reserved = map(int, step[1:6])
    assert step[6:] == [str(h200_bytes), "True"]
    # After the first step: weights, gradients (freed: set_to_none), AdamW's two states, cuBLAS workspaces.
    params = (256 * 1024 + 1024 + 1024 * 256 + 256) * 4
    assert 3 * params < allocated <= max_allocated <= r["peak_allocated_bytes"]
    assert max_allocated <= reserved == max_reserved == stats_reserved <= r["peak_reserved_bytes"]
    assert reserved % (2 << 20) == 0  # whole segments
    assert any("empty_cache" in n for n in r["notes"])


DIST_SCRIPT = """
import os
import torch, torch.nn as nn
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
dist.init_process_group("nccl")
model = DDP(nn.Linear(64, 64).cuda(), device_ids=[local_rank])
"""


def test_torchrun_style_script_runs_as_its_rank(tmp_path):
    """Failed before: `init_process_group("nccl")` with WORLD_SIZE=2 waited forever for the other rank (then, until
    issue 24: refused at once). Now it runs as rank 0 of an emulated world of 2 (torch's fake process group) and is
    estimated, its DDP emulated; the notes say so (tests/test_estimate_distributed.py checks the numbers)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    script = tmp_path / "ddp.py"
    script.write_text(DIST_SCRIPT + "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                      "for _ in range(3):\n"
                      "    model(torch.randn(8, 64, device='cuda')).sum().backward()\n"
                      "    opt.step()\n")  # fmt: skip
    t0 = time.monotonic()
    p = _estimate(script, env=env, timeout=90)
    assert time.monotonic() - t0 < 60
    r = _ok(p)
    assert "Traceback" not in p.stderr
    assert any("init_process_group(backend='nccl')" in n and "emulated world of 2" in n for n in r["notes"]), r["notes"]
    assert any("DistributedDataParallel is emulated" in n for n in r["notes"]), r["notes"]
