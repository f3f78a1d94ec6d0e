"""Records, on a real CUDA GPU (run it on the H200), the allocator requests CUDA libraries make *inside* operators
that no fake kernel shows: cuDNN's convolution workspaces above all (cuDNN's heuristics pick an algorithm and a
workspace per shape), and any other operator whose kernel allocates and frees a temporary (reduction staging
buffers, sort buffers). The result is the catalogue `torchmem estimate` looks convolutions up in
(`python/torchmem/estimator/_workspaces.py`), and a table of the other operators for study.

How: a TorchDispatchMode on real CUDA tensors wraps every operator of a real training step. Before the call it
makes a 1-byte marker allocation and frees it; after the call it compares torch's allocation counters and, for
every convolution and any other operator that allocated more than its outputs or freed anything, takes an
allocator snapshot (history on, small ring buffer) and reads the events after the marker: each allocation is
an output (its address is an output's storage), a temporary (freed inside the call) or kept (neither). Sizes
are the bytes requested, in order.

Workloads: the convolutional configs of `gpu_estimator_truth.py` and more torchvision models and batch sizes
(`CAPTURES`), 2 steps each (the second confirms the choice is the same), in one process.

Output: ``OUT/op-workspaces-h200.json``: versions, cuDNN flags, and per convolution key (``_opsig.signature``)
the templates per batch size with the workloads that produced them; ``other_ops``: the non-convolution
operators with temporaries (op, argument shapes, template, count).
Usage: ``python scripts/gpu_op_workspaces.py OUT [--only SOURCE,...|large-batch]`` (``large-batch``: ResNet-50 at
batch 256-2048, the second recording of the fixture).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

import gpu_estimator_truth  # noqa: E402  (model recipes, optimizer, train_step)

_spec = importlib.util.spec_from_file_location("_opsig", HERE.parent.parent / "python/torchmem/estimator/_opsig.py")
_opsig = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_opsig)


def _tv(arch: str, dtype: str, batch: int, opt: str = "sgd") -> dict:
    return {"kind": "tv", "arch": arch, "opt": opt, "dtype": dtype, "batch": batch}


# source name -> spec. The estimator truth's convolutional configs, plus batch sweeps and other architectures so
# a model's convolutions can be looked up from recordings of *other* models (leave-one-model-out in
# bench/estimate/accuracy.py).
CAPTURES: dict[str, dict] = {}
for _name, _w in gpu_estimator_truth.WORKLOADS.items():
    if _w["kind"] == "tv":
        CAPTURES[f"{_w['arch']}/{_w['dtype']}/b{_w['batch']}"] = {**_w, "alloc_conf": ""}
for _arch in ("resnet18", "resnet34", "resnet50", "resnet101"):
    for _dt in ("fp32", "amp_bf16", "amp_fp16"):
        for _b in (8, 16, 32, 64, 128):
            CAPTURES.setdefault(f"{_arch}/{_dt}/b{_b}", _tv(_arch, _dt, _b))
for _arch in ("mobilenet_v2", "efficientnet_b0", "densenet121", "vgg11", "convnext_tiny", "regnet_y_400mf"):
    for _dt in ("fp32", "amp_bf16"):
        for _b in (16, 32, 64):
            CAPTURES.setdefault(f"{_arch}/{_dt}/b{_b}", _tv(_arch, _dt, _b))
for _dt in ("fp32", "amp_bf16"):
    for _b in (16, 32, 64):
        CAPTURES.setdefault(f"vit_b_16/{_dt}/b{_b}", _tv("vit_b_16", _dt, _b))
# Large batches (the `--fit` searches of a big GPU go there; not in the default run: `--only` them).
LARGE_BATCH = {
    f"resnet50/{dt}/b{b}": _tv("resnet50", dt, b)
    for dt, batches in (("fp32", (256, 512, 1024, 1536)), ("amp_bf16", (256, 512, 1024, 2048)))
    for b in batches
}
CAPTURES.update(LARGE_BATCH)


def _describe(func_name: str, args, kwargs) -> str:
    import torch

    parts = [func_name]
    for a in list(args) + [kwargs[k] for k in sorted(kwargs)]:
        if isinstance(a, torch.Tensor):
            parts.append(f"T[{','.join(map(str, a.shape))}]{str(a.dtype)[6:]}/{_opsig.layout_tag(a)}")
        elif isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            parts.append(f"L{len(a)}")
        else:
            parts.append(_opsig._value(a) if not isinstance(a, torch.dtype) else str(a))
    return "|".join(parts)


class Capture:
    """The dispatch mode (built lazily so the module imports without torch)."""

    def __init__(self, torch) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        self.torch = torch
        self.source = ""
        self.step = 0
        self.conv: dict = defaultdict(dict)  # key -> batch -> {"template", "sources", "steps"}
        self.other: dict = {}  # (desc, template) -> count
        self.errors: list[str] = []
        self.snapshots = 0
        cap = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                return cap.dispatch(func, args, kwargs or {}, tree_flatten)

        self.mode = Mode()

    def dispatch(self, func, args, kwargs, tree_flatten):
        torch = self.torch
        m = torch.empty(1, dtype=torch.uint8, device="cuda")
        marker = m.data_ptr()
        del m
        s0 = torch.cuda.memory_stats()
        out = func(*args, **kwargs)
        s1 = torch.cuda.memory_stats()
        n_alloc = s1["allocation.all.allocated"] - s0["allocation.all.allocated"]
        n_free = s1["allocation.all.freed"] - s0["allocation.all.freed"]
        flat, _ = tree_flatten(out)
        outs = {}
        for i, t in enumerate(flat):
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                try:
                    outs.setdefault(t.untyped_storage().data_ptr(), i)
                except (RuntimeError, NotImplementedError):
                    pass
        name = str(func)
        if n_free == 0 and n_alloc <= len(outs):
            # No temporary: still a recording for a convolution (cuDNN picked an algorithm without a workspace,
            # which the estimate must know from a shape never recorded).
            if name in _opsig.CONV_OPS:
                self.record(name, args, kwargs, marker, n_alloc, n_free, outs)
            return out
        self.record(name, args, kwargs, marker, n_alloc, n_free, outs)
        return out

    def record(self, name, args, kwargs, marker, n_alloc, n_free, outs) -> None:
        torch = self.torch
        self.snapshots += 1
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
        # The marker: its alloc, free_requested, free_completed; the call's events follow it.
        start = None
        for i in range(len(trace) - 3, -1, -1):
            e = trace[i]
            if (
                e["action"] == "alloc"
                and e["addr"] == marker
                and e["size"] in (1, 512)
                and trace[i + 1]["action"] == "free_requested"
                and trace[i + 1]["addr"] == marker
            ):
                start = i + 3 if trace[i + 2]["action"] == "free_completed" else i + 2
                break
        if start is None:
            self.errors.append(f"{name}: marker not found in the trace ({len(trace)} entries)")
            return
        events = [e for e in trace[start:] if e["action"] in ("alloc", "free_requested")]
        allocs = sum(e["action"] == "alloc" for e in events)
        frees = sum(e["action"] == "free_requested" for e in events)
        if allocs != n_alloc or frees != n_free:
            self.errors.append(f"{name}: trace {allocs}/{frees} vs counters {n_alloc}/{n_free}")
            return
        ids: dict[int, int] = {}
        freed = {e["addr"] for e in events if e["action"] == "free_requested"}
        template = []
        for e in events:
            addr = e["addr"]
            if e["action"] == "alloc":
                if addr in outs and addr not in freed:
                    template.append(["out", outs[addr], e["size"]])
                elif addr in freed:
                    ids[addr] = len(ids)
                    template.append(["tmp", ids[addr], e["size"]])
                else:
                    template.append(["kept", -1, e["size"]])
            elif addr in ids:
                template.append(["free", ids[addr], 0])
            else:
                template.append(["free_input", -1, e["size"]])
        sig = _opsig.signature(name, args)
        if sig is not None:
            key, batch = sig
            slot = self.conv[key].setdefault(str(batch), {"templates": [], "sources": []})
            if template not in slot["templates"]:
                slot["templates"].append(template)
            if self.source not in slot["sources"]:
                slot["sources"].append(self.source)
        else:
            k = (_describe(name, args, kwargs), json.dumps(template))
            self.other[k] = self.other.get(k, 0) + 1


def run_source(torch, cap: Capture, name: str, spec: dict) -> dict:
    model, opt, loss_fn, _info = gpu_estimator_truth.build(spec, torch)
    scaler = torch.amp.GradScaler("cuda") if spec["dtype"] == "amp_fp16" else None
    cap.source = name
    t0 = time.time()
    for step in range(2):
        cap.step = step
        with cap.mode:
            gpu_estimator_truth.train_step(spec, torch, opt, loss_fn, scaler)
        torch.cuda.synchronize()
    del model, opt, loss_fn, scaler
    torch.cuda.empty_cache()
    return {"seconds": round(time.time() - t0, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--only", default="")
    ap.add_argument("--budget-s", type=float, default=400.0, help="stop starting new workloads after this")
    args = ap.parse_args()
    import torch

    torch.cuda.init()
    torch.cuda.memory._record_memory_history(context=None, stacks="python", max_entries=4096)
    cap = Capture(torch)
    if args.only == "large-batch":
        names = list(LARGE_BATCH)
    else:
        names = [n for n in CAPTURES if n not in LARGE_BATCH and (not args.only or n in args.only.split(","))]
    done: dict = {}
    t0 = time.time()
    for n in names:
        if time.time() - t0 > args.budget_s:
            done[n] = {"skipped": "time budget"}
            continue
        try:
            done[n] = run_source(torch, cap, n, CAPTURES[n])
        except Exception as e:  # noqa: BLE001 - one workload's failure is recorded, the rest go on
            done[n] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            torch.cuda.empty_cache()
        print(f"{n:32s} {done[n]}  ({len(cap.conv)} conv keys, {cap.snapshots} snapshots)", flush=True)
    torch.cuda.memory._record_memory_history(enabled=None)
    other = [
        {"op": d, "template": json.loads(t), "count": c} for (d, t), c in sorted(cap.other.items(), key=lambda x: -x[1])
    ]
    result = {
        "device_name": torch.cuda.get_device_name(0),
        "capability": list(torch.cuda.get_device_capability(0)),
        "sm_count": torch.cuda.get_device_properties(0).multi_processor_count,
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "cudnn_version": torch.backends.cudnn.version(),
        "cudnn_flags": {
            "benchmark": torch.backends.cudnn.benchmark,
            "deterministic": torch.backends.cudnn.deterministic,
            "allow_tf32": torch.backends.cudnn.allow_tf32,
        },
        "sources": done,
        "seconds": round(time.time() - t0, 1),
        "errors": cap.errors[:200],
        "conv": cap.conv,
        "other_ops": other,
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "op-workspaces-h200.json").write_text(json.dumps(result, indent=0, sort_keys=True))
    print(
        f"{len(cap.conv)} convolution keys, {len(other)} other templates, {len(cap.errors)} errors, "
        f"{result['seconds']} s"
    )
    if cap.errors and not cap.conv:
        sys.exit(f"nothing recorded; first error: {cap.errors[0]}")


if __name__ == "__main__":
    main()
