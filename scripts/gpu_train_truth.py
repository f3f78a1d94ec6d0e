"""A GPU training run that writes what torch.cuda and NVML say at its end, for `tests/gpu/test_gpu_run.py` to compare
with the profile `torchmem run` recorded of it. No torchmem API calls: the allocator timeline comes from
torchmem's injection alone, so the check also proves "no change to the user's code".

    torchmem run -o p.sqlite -- python scripts/gpu_train_truth.py truth.json
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch


def nvml_process_bytes(pid: int) -> int | None:
    try:
        import pynvml
    except ImportError:
        return None
    pynvml.nvmlInit()
    total = None
    for i in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(i)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if p.pid == pid and p.usedGpuMemory is not None:
                total = (total or 0) + p.usedGpuMemory
    return total


def nvml_total_bytes() -> int | None:
    try:
        import pynvml
    except ImportError:
        return None
    pynvml.nvmlInit()
    return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total


def main() -> None:
    out = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    dev = torch.device("cuda")
    try:
        import torchvision

        model = torchvision.models.resnet18(num_classes=100).to(dev)
        shape = (64, 3, 224, 224)
    except ImportError:
        model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 100)).to(dev)
        shape = (256, 4096)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        x = torch.randn(*shape, device=dev)
        loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    # One big temporary that is freed at once: the peak must be caught exactly even between samples.
    spike = torch.empty(3 << 30, dtype=torch.uint8, device=dev)
    del spike
    torch.cuda.synchronize()
    time.sleep(0.5)  # steady state: every sampler sees the final values
    truth = {
        "pid": os.getpid(),
        "t_ns": time.monotonic_ns(),
        "allocated_bytes": torch.cuda.memory_allocated(),
        "reserved_bytes": torch.cuda.memory_reserved(),
        "max_allocated_bytes": torch.cuda.max_memory_allocated(),
        "max_reserved_bytes": torch.cuda.max_memory_reserved(),
        "nvml_process_bytes": nvml_process_bytes(os.getpid()),
        "device_total_bytes": torch.cuda.get_device_properties(0).total_memory,
        "nvml_total_bytes": nvml_total_bytes(),
    }
    with open(out, "w") as f:
        json.dump(truth, f)
    time.sleep(0.5)


if __name__ == "__main__":
    main()
