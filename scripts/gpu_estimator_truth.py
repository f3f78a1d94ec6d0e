"""Records the ground truth for `torchmem estimate` on a real CUDA GPU (run it on the H200).

Each config is a real training run (3 optimizer steps by default, the estimator's default) in a fresh process, under
its own ``PYTORCH_ALLOC_CONF``. For each step it records torch's peaks (``memory_stats()``: allocated, reserved,
requested, active), and NVML's view of this process (``usedGpuMemory`` of this pid, and the device's used memory
less what was used before the process started) right after the step; a thread samples NVML every 2 ms so a short
spike between two step ends is seen too. With ``--snapshots`` (default on) the run keeps allocator history from the
first CUDA allocation, so the estimator's trace can be compared request by request with the real one.

The workloads reuse `scripts/gpu_sim_truth.py`'s recipes (`_build`) and add T5, LoRA (peft; a built-in LoRA when
peft is missing, recorded as such), ConvNeXt-Tiny, batch sweeps (ResNet-50, GPT-2, BERT) and expandable segments.
The tests of the estimator build the same models from `WORKLOADS` and `build()` here.

Output: ``OUT/estimator-truth.json`` (one object: versions, device, per config its stats per step and NVML numbers)
and, with snapshots, ``OUT/estimator-h200-N.tar`` of gzipped snapshots (at most ~14 MiB each).
Usage: ``python scripts/gpu_estimator_truth.py OUT [--jobs 4] [--only NAME,...] [--steps 3] [--no-snapshots]``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import gzip
import json
import os
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

import gpu_sim_truth  # noqa: E402  (the shared model recipes)

EXPANDABLE = "expandable_segments:True"

# name -> spec. "kind"/"arch"/"opt"/"dtype"/"batch"/"seq" as in gpu_sim_truth.WORKLOADS; "alloc_conf" is the
# allocator setting of that run; "lora" wraps the model in LoRA adapters (rank, target modules).
WORKLOADS: dict[str, dict] = {
    "mlp_sgd_fp32": {**gpu_sim_truth.WORKLOADS["mlp_sgd_fp32"]},
    "resnet18_sgd_fp32": {**gpu_sim_truth.WORKLOADS["resnet18_sgd_fp32"]},
    "resnet50_adamw_foreach_fp32_b32": {**gpu_sim_truth.WORKLOADS["resnet50_adamw_foreach_fp32"], "batch": 32},
    "resnet50_adamw_foreach_fp32_b64": {**gpu_sim_truth.WORKLOADS["resnet50_adamw_foreach_fp32"], "batch": 64},
    "resnet50_adamw_foreach_fp32_b128": {**gpu_sim_truth.WORKLOADS["resnet50_adamw_foreach_fp32"], "batch": 128},
    "resnet50_adamw_foreach_fp32_b64_expandable": {
        **gpu_sim_truth.WORKLOADS["resnet50_adamw_foreach_fp32"],
        "alloc_conf": EXPANDABLE,
    },
    "resnet50_adamw_fused_amp": {**gpu_sim_truth.WORKLOADS["resnet50_adamw_fused_amp"]},
    # fp16 GradScaler: the first steps overflow at the initial scale and are skipped (no SGD momentum yet), so
    # 3 steps would measure a run that never stepped; 12 reach the steady state a training run has.
    "resnet50_sgd_amp_fp16": {**gpu_sim_truth.WORKLOADS["resnet50_sgd_amp_fp16"], "steps": 12},
    "convnext_tiny_adamw_fp32": {
        "kind": "tv",
        "arch": "convnext_tiny",
        "opt": "adamw_foreach",
        "dtype": "fp32",
        "batch": 32,
    },
    "vit_b16_adamw_amp": {**gpu_sim_truth.WORKLOADS["vit_b16_adamw_amp"]},
    # Convolutional networks whose convolutions the estimator's cuDNN catalogue was not recorded from in
    # leave-one-model-out, at batch sizes between the catalogue's (see scripts/gpu_op_workspaces.py).
    "resnet34_sgd_fp32_b48": {"kind": "tv", "arch": "resnet34", "opt": "sgd", "dtype": "fp32", "batch": 48},
    "mobilenet_v2_adamw_amp_b48": {
        "kind": "tv",
        "arch": "mobilenet_v2",
        "opt": "adamw_foreach",
        "dtype": "amp_bf16",
        "batch": 48,
    },
    "efficientnet_b0_sgd_fp32_b24": {
        "kind": "tv",
        "arch": "efficientnet_b0",
        "opt": "sgd",
        "dtype": "fp32",
        "batch": 24,
    },
    "densenet121_adamw_fp32_b24": {
        "kind": "tv",
        "arch": "densenet121",
        "opt": "adamw_foreach",
        "dtype": "fp32",
        "batch": 24,
    },
    "resnet101_adamw_fused_amp_b48": {
        "kind": "tv",
        "arch": "resnet101",
        "opt": "adamw_fused",
        "dtype": "amp_bf16",
        "batch": 48,
    },
    "bert_base_adamw_fp32_b8": {**gpu_sim_truth.WORKLOADS["bert_base_adamw_fp32"]},
    "bert_base_adamw_fp32_b16": {**gpu_sim_truth.WORKLOADS["bert_base_adamw_fp32"], "batch": 16},
    "bert_base_adamw_fp32_b32": {**gpu_sim_truth.WORKLOADS["bert_base_adamw_fp32"], "batch": 32},
    "bert_base_adamw_fp32_b16_expandable": {
        **gpu_sim_truth.WORKLOADS["bert_base_adamw_fp32"],
        "batch": 16,
        "alloc_conf": EXPANDABLE,
    },
    "gpt2_adamw_amp_b4": {**gpu_sim_truth.WORKLOADS["gpt2_adamw_amp"], "batch": 4},
    "gpt2_adamw_amp_b8": {**gpu_sim_truth.WORKLOADS["gpt2_adamw_amp"]},
    "gpt2_adamw_amp_b16": {**gpu_sim_truth.WORKLOADS["gpt2_adamw_amp"], "batch": 16},
    "gpt2_adamw_amp_b8_expandable": {**gpu_sim_truth.WORKLOADS["gpt2_adamw_amp"], "alloc_conf": EXPANDABLE},
    "gpt2_ckpt_adamw_amp": {**gpu_sim_truth.WORKLOADS["gpt2_ckpt_adamw_amp"]},
    "gpt2_adamw_fused_bf16": {**gpu_sim_truth.WORKLOADS["gpt2_adamw_fused_bf16"]},
    "gpt2_lora_adamw_amp": {
        **gpu_sim_truth.WORKLOADS["gpt2_adamw_amp"],
        "lora": {"r": 16, "alpha": 32, "targets": ["c_attn", "c_proj"]},
    },
    "llama_adamw_fused_amp": {**gpu_sim_truth.WORKLOADS["llama_adamw_fused_amp"]},
    "llama_adamw_fused_amp_expandable": {**gpu_sim_truth.WORKLOADS["llama_adamw_fused_amp"], "alloc_conf": EXPANDABLE},
    "llama_lora_bf16": {
        **gpu_sim_truth.WORKLOADS["llama_adamw_fused_amp"],
        "dtype": "bf16",
        "opt": "adamw_foreach",
        "batch": 8,
        "lora": {"r": 8, "alpha": 16, "targets": ["q_proj", "v_proj"]},
    },
    "opt125m_adam_fp32": {**gpu_sim_truth.WORKLOADS["opt125m_adam_fp32"]},
    "t5_small_adamw_fp32": {
        "kind": "hf",
        "arch": "t5",
        "opt": "adamw_foreach",
        "dtype": "fp32",
        "batch": 16,
        "seq": 256,
    },
    "t5_small_adamw_amp": {
        "kind": "hf",
        "arch": "t5",
        "opt": "adamw_foreach",
        "dtype": "amp_bf16",
        "batch": 16,
        "seq": 256,
    },
}


# ----------------------------------------------------------------------------------------------- model recipes
class _LoRALinear:
    """Built-in LoRA (used only when peft is not installed): y = W x + (alpha/r) B A x, W frozen."""

    @staticmethod
    def wrap(torch, base, r: int, alpha: int):
        class LoRA(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.base = base
                fan_in, fan_out = _in_out(base)
                dev = next(base.parameters()).device
                self.lora_A = torch.nn.Linear(fan_in, r, bias=False, device=dev)
                self.lora_B = torch.nn.Linear(r, fan_out, bias=False, device=dev)
                torch.nn.init.zeros_(self.lora_B.weight)
                self.scale = alpha / r

            def forward(self, x):
                return self.base(x) + self.lora_B(self.lora_A(x)) * self.scale

        return LoRA()


def _in_out(layer) -> tuple[int, int]:
    w = layer.weight
    if type(layer).__name__ == "Conv1D":  # HF GPT-2 stores (in, out)
        return w.shape[0], w.shape[1]
    return w.shape[1], w.shape[0]


def _apply_lora(torch, model, cfg: dict):
    try:
        import peft

        conf = peft.LoraConfig(
            r=cfg["r"], lora_alpha=cfg["alpha"], target_modules=cfg["targets"], lora_dropout=0.0, bias="none"
        )
        return peft.get_peft_model(model, conf), "peft " + peft.__version__
    except ImportError:
        for p in model.parameters():
            p.requires_grad_(False)
        for _name, mod in list(model.named_modules()):
            for child_name, child in list(mod.named_children()):
                if child_name in cfg["targets"]:
                    setattr(mod, child_name, _LoRALinear.wrap(torch, child, cfg["r"], cfg["alpha"]))
        return model, "builtin"


def build(spec: dict, torch):
    """(model, optimizer, loss_fn, info) for a spec, on `cuda`. Shared by this script and the estimator's tests."""
    info: dict = {}
    kind, arch = spec["kind"], spec.get("arch")
    if kind == "hf" and arch == "t5":
        import transformers as tf

        cfg = tf.T5Config(
            d_model=512,
            d_ff=2048,
            num_layers=6,
            num_heads=8,
            d_kv=64,
            vocab_size=32128,
            decoder_start_token_id=0,
            pad_token_id=0,
        )
        model = tf.T5ForConditionalGeneration(cfg).to("cuda")
        ids = torch.randint(0, cfg.vocab_size, (spec["batch"], spec["seq"]), device="cuda")
        labels = torch.randint(0, cfg.vocab_size, (spec["batch"], spec["seq"] // 4), device="cuda")
        model.train()

        def loss_fn():
            return model(input_ids=ids, labels=labels).loss

        opt = _optimizer(torch, spec["opt"], model.parameters())
        return model, opt, loss_fn, info
    if spec.get("lora"):
        # Build the base model through the shared recipe, then wrap; the optimizer sees trainable parameters only.
        model, _, loss_fn = gpu_sim_truth._build({**spec, "opt": "sgd"}, torch)
        inner = _find_model(loss_fn)
        wrapped, impl = _apply_lora(torch, inner, spec["lora"])
        info["lora_impl"] = impl
        if spec["dtype"] == "bf16":
            wrapped = wrapped.to(torch.bfloat16)
        ids = _find_ids(loss_fn)

        def lora_loss():
            return wrapped(input_ids=ids, labels=ids).loss

        params = [p for p in wrapped.parameters() if p.requires_grad]
        info["trainable_params"] = sum(p.numel() for p in params)
        return wrapped, _optimizer(torch, spec["opt"], params), lora_loss, info
    if kind == "tv" and arch == "convnext_tiny":
        import torchvision

        model = torchvision.models.convnext_tiny(weights=None).to("cuda")
        x = torch.randn(spec["batch"], 3, 224, 224, device="cuda")
        y = torch.randint(0, 1000, (spec["batch"],), device="cuda")
        model.train()

        def loss_fn():
            return torch.nn.functional.cross_entropy(model(x), y)

        return model, _optimizer(torch, spec["opt"], model.parameters()), loss_fn, info
    model, opt, loss_fn = gpu_sim_truth._build(spec, torch)
    return model, opt, loss_fn, info


def _find_model(loss_fn):
    for cell in loss_fn.__closure__ or ():
        obj = cell.cell_contents
        if hasattr(obj, "parameters"):
            return obj
    raise RuntimeError("no model in the loss closure")


def _find_ids(loss_fn):
    for cell in loss_fn.__closure__ or ():
        obj = cell.cell_contents
        if not hasattr(obj, "parameters") and hasattr(obj, "shape"):
            return obj
    raise RuntimeError("no input ids in the loss closure")


_optimizer = gpu_sim_truth.optimizer
train_step = gpu_sim_truth.train_step


# ----------------------------------------------------------------------------------------------- NVML
class _Nvml:
    """This process's NVML numbers: pynvml when installed, else libnvidia-ml through ctypes."""

    def __init__(self, index: int) -> None:
        self.pid = os.getpid()
        try:
            import pynvml

            pynvml.nvmlInit()
            self._py = pynvml
            self._h = pynvml.nvmlDeviceGetHandleByIndex(index)
            self.backend = "pynvml"
        except Exception:  # noqa: BLE001 - fall back to the C library
            import ctypes

            self._py = None
            self._lib = ctypes.CDLL("libnvidia-ml.so.1")
            self._lib.nvmlInit_v2()
            self._h = ctypes.c_void_p()
            self._lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self._h))
            self.backend = "ctypes"

    def process_bytes(self) -> int | None:
        if self._py is not None:
            for p in self._py.nvmlDeviceGetComputeRunningProcesses(self._h):
                if p.pid == self.pid and p.usedGpuMemory is not None:
                    return int(p.usedGpuMemory)
            return None
        import ctypes

        class Info(ctypes.Structure):
            _fields_ = [
                ("pid", ctypes.c_uint),
                ("used", ctypes.c_ulonglong),
                ("gi", ctypes.c_uint),
                ("ci", ctypes.c_uint),
            ]

        n = ctypes.c_uint(64)
        arr = (Info * 64)()
        if self._lib.nvmlDeviceGetComputeRunningProcesses_v3(self._h, ctypes.byref(n), arr) != 0:
            return None
        for i in range(n.value):
            if arr[i].pid == self.pid:
                return int(arr[i].used)
        return None

    def device_used_bytes(self) -> int:
        if self._py is not None:
            return int(self._py.nvmlDeviceGetMemoryInfo(self._h).used)
        import ctypes

        class Mem(ctypes.Structure):
            _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]

        m = Mem()
        self._lib.nvmlDeviceGetMemoryInfo(self._h, ctypes.byref(m))
        return int(m.used)


class _Sampler(threading.Thread):
    """Max of NVML process and device used memory, every 2 ms, while the run goes."""

    def __init__(self, nvml: _Nvml) -> None:
        super().__init__(daemon=True)
        self.nvml = nvml
        self.stop = threading.Event()
        self.max_process_bytes = 0
        self.max_device_used_bytes = 0

    def run(self) -> None:
        while not self.stop.is_set():
            p = self.nvml.process_bytes()
            if p is not None:
                self.max_process_bytes = max(self.max_process_bytes, p)
            self.max_device_used_bytes = max(self.max_device_used_bytes, self.nvml.device_used_bytes())
            time.sleep(0.002)


_PEAK_KEYS = (
    "allocated_bytes.all.peak",
    "reserved_bytes.all.peak",
    "requested_bytes.all.peak",
    "active_bytes.all.peak",
    "allocated_bytes.all.current",
    "reserved_bytes.all.current",
    "num_alloc_retries",
    "num_device_alloc",
    "num_ooms",
)


def child(args) -> None:
    import torch

    spec = WORKLOADS[args.workload]
    device_used_before = int(args.device_used_before)
    nvml = _Nvml(0)
    torch.cuda.init()
    if args.snapshot:
        ctx = {"context": None} if spec.get("ckpt") else {}
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=2_000_000, **ctx)
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    context_process_bytes = nvml.process_bytes()
    sampler = _Sampler(nvml)
    sampler.start()
    t0 = time.time()
    model, opt, loss_fn, info = build(spec, torch)
    scaler = torch.amp.GradScaler("cuda") if spec["dtype"] == "amp_fp16" else None
    steps = []
    oom = None
    try:
        for _ in range(args.steps):
            train_step(spec, torch, opt, loss_fn, scaler)
            torch.cuda.synchronize()
            stats = torch.cuda.memory_stats()
            steps.append(
                {
                    **{k: stats.get(k) for k in _PEAK_KEYS},
                    "nvml_process_bytes": nvml.process_bytes(),
                    "nvml_device_used_bytes": nvml.device_used_bytes(),
                }
            )
    except torch.OutOfMemoryError as e:
        oom = str(e).splitlines()[0][:300]
    seconds = time.time() - t0
    time.sleep(0.02)
    sampler.stop.set()
    sampler.join()
    stats = torch.cuda.memory_stats()
    if args.snapshot:
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        with gzip.open(args.snapshot, "wb", compresslevel=9) as f:
            pickle.dump(snap, f, protocol=4)
    props = torch.cuda.get_device_properties(0)
    peak_step = max(range(len(steps)), key=lambda i: steps[i]["reserved_bytes.all.peak"]) if steps else None
    print(
        json.dumps(
            {
                "spec": spec,
                "info": info,
                "alloc_conf": os.environ.get("PYTORCH_ALLOC_CONF", ""),
                "steps": steps,
                "peak_allocated_bytes": stats["allocated_bytes.all.peak"],
                "peak_reserved_bytes": stats["reserved_bytes.all.peak"],
                "peak_requested_bytes": stats.get("requested_bytes.all.peak"),
                "peak_active_bytes": stats.get("active_bytes.all.peak"),
                "num_alloc_retries": stats.get("num_alloc_retries"),
                "nvml_process_bytes_at_peak_step": steps[peak_step]["nvml_process_bytes"] if steps else None,
                "nvml_process_bytes_max_sampled": sampler.max_process_bytes or None,
                "nvml_device_used_bytes_max_sampled": sampler.max_device_used_bytes,
                "nvml_device_used_before_bytes": device_used_before,
                "nvml_process_bytes_after_context": context_process_bytes,
                "nvml_backend": nvml.backend,
                "oom": oom,
                "train_seconds": round(seconds, 2),
                "device_name": props.name,
                "device_total_bytes": props.total_memory,
                "torch_version": torch.__version__,
                "cuda_version": torch.version.cuda,
                "cudnn_version": torch.backends.cudnn.version(),
                "snapshot": Path(args.snapshot).name if args.snapshot else None,
            }
        )
    )


# ----------------------------------------------------------------------------------------------- parent side
def _device_used_now() -> int:
    try:
        return _Nvml(0).device_used_bytes()
    except Exception:  # noqa: BLE001 - no NVML: the delta is then unknown
        return -1


def _run(name: str, work: Path, steps: int, snapshots: bool) -> dict:
    spec = WORKLOADS[name]
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env["PYTORCH_ALLOC_CONF"] = spec.get("alloc_conf", "")
    argv = [sys.executable, str(HERE), "--child", "--workload", name, "--steps", str(spec.get("steps", steps))]
    argv += ["--device-used-before", str(_device_used_now())]
    if snapshots:
        argv += ["--snapshot", str(work / f"{name}__estimator.pickle.gz")]
    t0 = time.time()
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        return {"error": p.stderr[-3000:], "seconds": round(time.time() - t0, 1)}
    res = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("{")][-1])
    res["seconds"] = round(time.time() - t0, 1)
    return res


def parent(args) -> None:
    out = Path(args.out)
    work = out / "estimator-h200"
    work.mkdir(parents=True, exist_ok=True)
    names = [n for n in WORKLOADS if not args.only or n in args.only.split(",")]
    t0 = time.time()
    # Concurrent runs share the GPU, so NVML's device-wide numbers overlap; --jobs 1 gives clean device deltas
    # (the per-process usedGpuMemory is per pid and stays exact either way).
    with cf.ThreadPoolExecutor(args.jobs) as pool:
        futs = {n: pool.submit(_run, n, work, args.steps, not args.no_snapshots) for n in names}
        results = {n: f.result() for n, f in futs.items()}
    truth = {"steps": args.steps, "jobs": args.jobs, "configs": results}
    for n, r in results.items():
        if "error" in r:
            print(f"{n}: failed:\n{r['error']}", flush=True)
            continue
        truth.setdefault("torch_version", r["torch_version"])
        truth.setdefault("device_name", r["device_name"])
        truth.setdefault("device_total_bytes", r["device_total_bytes"])
        print(
            f"{n:45s} alloc {r['peak_allocated_bytes'] / 2**20:9.1f} MiB  reserved "
            f"{r['peak_reserved_bytes'] / 2**20:9.1f} MiB  nvml "
            f"{(r['nvml_process_bytes_at_peak_step'] or 0) / 2**20:9.1f} MiB  {r['seconds']} s",
            flush=True,
        )
    print(f"all {len(names)} configs in {time.time() - t0:.0f} s", flush=True)
    (out / "estimator-truth.json").write_text(json.dumps(truth, indent=1, sort_keys=True))
    gpu_sim_truth.pack_tars(sorted(work.glob("*.pickle.gz")), out, "estimator-h200")
    for f in work.iterdir():
        f.unlink()
    work.rmdir()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?")
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--only", default="")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--no-snapshots", action="store_true")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--workload")
    ap.add_argument("--snapshot")
    ap.add_argument("--device-used-before", default="-1")
    args = ap.parse_args()
    if args.child:
        child(args)
    else:
        if not args.out:
            ap.error("give the output directory")
        parent(args)


if __name__ == "__main__":
    main()
