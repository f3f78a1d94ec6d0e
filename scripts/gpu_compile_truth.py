"""Records the ground truth of `torch.compile` programs for `torchmem estimate` (issue 23 item 4; run on the H200).

Each config is a real training run in a fresh process with a fresh, empty Inductor cache (a user's first run):
step 0 compiles (dynamo, aot_autograd, Inductor's code generation and its first-run kernel tuning), steps 1-3 are
what the user sees afterwards. Per step it records torch's peaks twice: cumulative (the whole process so far,
compile step included: what `max_memory_allocated()` says) and the step's own (peaks reset before the step), the
NVML numbers of this process right after the step, and the seconds. A thread samples NVML every 2 ms. Every
compiled config has its eager twin (same model, same step, no `torch.compile`) in the same run, so the direction
and size of the compile effect is measured on the same GPU, torch and allocator.

The compiled convolutional configs run one more step with their cuDNN convolution calls captured (channels-last
layouts that Inductor chooses; `scripts/gpu_op_workspaces.py`'s format, for the catalogue).

Per config the output holds the allocator history (`torch.cuda.memory._record_memory_history`, gzipped pickle)
and, for compiled ones, Inductor's generated code (`TORCH_LOGS=output_code`, gzipped): the wrapper's buffer plan
(`empty_strided_cuda`, `del bufN`, reuse) that the estimate executes on the emulated device.

The model recipes (`build`, `CONFIGS`) are shared with `bench/estimate/compile_accuracy.py` and
`tests/e2e/test_estimate_compile.py`, which run the same programs on the emulated device.

Output: OUT/compile-truth.json and OUT/compile-h200-N.tar (snapshots and generated code, gzipped; <= 14 MiB each).
Usage: python scripts/gpu_compile_truth.py OUT [--jobs 10] [--only NAME,...] [--steps 4] [--no-snapshots]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import gzip
import json
import math
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

import gpu_sim_truth  # noqa: E402  (the shared packing)

# name -> spec: "model" (mlp | cnn | resnet50 | nanogpt), "batch", "dtype" (fp32 | amp_bf16), "opt"
# (adamw_foreach | adamw_fused | sgd), "compile" (True: torch.compile(model) with the default mode).
_BASE: dict[str, dict] = {
    "mlp_adamw_fp32_b512": {"model": "mlp", "batch": 512, "dtype": "fp32", "opt": "adamw_foreach"},
    "cnn_sgd_fp32_b64": {"model": "cnn", "batch": 64, "dtype": "fp32", "opt": "sgd"},
    "resnet50_adamw_fp32_b64": {"model": "resnet50", "batch": 64, "dtype": "fp32", "opt": "adamw_foreach"},
    "resnet50_adamw_amp_b64": {"model": "resnet50", "batch": 64, "dtype": "amp_bf16", "opt": "adamw_foreach"},
    # nanoGPT's train.py: GPT-2 small (124M), block 1024, vocab 50304, bf16 autocast, fused AdamW in two groups,
    # clip_grad_norm_ 1.0; batch 8 x 1024.
    "nanogpt_adamw_bf16_b8": {"model": "nanogpt", "batch": 8, "dtype": "amp_bf16", "opt": "adamw_fused"},
}
CONFIGS: dict[str, dict] = {}
for _name, _spec in _BASE.items():
    CONFIGS[f"{_name}_compiled"] = {**_spec, "compile": True}
    CONFIGS[f"{_name}_eager"] = {**_spec, "compile": False}


# ----------------------------------------------------------------------------------------------- model recipes
def _nanogpt(torch, n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304):
    """nanoGPT's model.py (Karpathy), dropout 0, bias True: the modules and forward as written there."""
    nn = torch.nn
    F = torch.nn.functional

    class LayerNorm(nn.Module):
        def __init__(self, ndim):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(ndim))
            self.bias = nn.Parameter(torch.zeros(ndim))

        def forward(self, x):
            return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)

    class CausalSelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = nn.Linear(n_embd, 3 * n_embd)
            self.c_proj = nn.Linear(n_embd, n_embd)

        def forward(self, x):
            B, T, C = x.size()
            q, k, v = self.c_attn(x).split(n_embd, dim=2)
            k = k.view(B, T, n_head, C // n_head).transpose(1, 2)
            q = q.view(B, T, n_head, C // n_head).transpose(1, 2)
            v = v.view(B, T, n_head, C // n_head).transpose(1, 2)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
            y = y.transpose(1, 2).contiguous().view(B, T, C)
            return self.c_proj(y)

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_fc = nn.Linear(n_embd, 4 * n_embd)
            self.gelu = nn.GELU()
            self.c_proj = nn.Linear(4 * n_embd, n_embd)

        def forward(self, x):
            return self.c_proj(self.gelu(self.c_fc(x)))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = LayerNorm(n_embd)
            self.attn = CausalSelfAttention()
            self.ln_2 = LayerNorm(n_embd)
            self.mlp = MLP()

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.transformer = nn.ModuleDict(
                dict(
                    wte=nn.Embedding(vocab_size, n_embd),
                    wpe=nn.Embedding(block_size, n_embd),
                    h=nn.ModuleList([Block() for _ in range(n_layer)]),
                    ln_f=LayerNorm(n_embd),
                )
            )
            self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
            self.transformer.wte.weight = self.lm_head.weight
            self.apply(self._init_weights)
            for pn, p in self.named_parameters():
                if pn.endswith("c_proj.weight"):
                    torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

        def _init_weights(self, module):
            if isinstance(module, nn.Linear):
                torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if module.bias is not None:
                    torch.nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

        def forward(self, idx, targets):
            _b, t = idx.size()
            pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
            x = self.transformer.wte(idx) + self.transformer.wpe(pos)
            for block in self.transformer.h:
                x = block(x)
            x = self.transformer.ln_f(x)
            logits = self.lm_head(x)
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)

    return GPT()


def build(spec: dict, torch, compile_fn=None):
    """(step, info): `step()` runs one optimizer step of the config on "cuda". `compile_fn` is the
    `torch.compile` to use (default: torch.compile), applied to the model when spec["compile"]."""
    nn = torch.nn
    F = torch.nn.functional
    dev = "cuda"
    kind, b = spec["model"], spec["batch"]
    if kind == "mlp":
        model = nn.Sequential(
            nn.Linear(1024, 4096),
            nn.LayerNorm(4096),
            nn.GELU(),
            nn.Linear(4096, 4096),
            nn.LayerNorm(4096),
            nn.GELU(),
            nn.Linear(4096, 1024),
        ).to(dev)
        x = torch.randn(b, 1024, device=dev)
        y = torch.randn(b, 1024, device=dev)

        def loss_of(m):
            return F.mse_loss(m(x), y)

    elif kind == "cnn":
        model = nn.Sequential(
            nn.Conv2d(3, 64, 3, padding=1),
            nn.BatchNorm2d(64),
            nn.ReLU(),
            nn.Conv2d(64, 128, 3, padding=1),
            nn.BatchNorm2d(128),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(128, 128, 3, padding=1),
            nn.BatchNorm2d(128),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(128, 10),
        ).to(dev)
        x = torch.randn(b, 3, 32, 32, device=dev)
        y = torch.randint(0, 10, (b,), device=dev)

        def loss_of(m):
            return F.cross_entropy(m(x), y)

    elif kind == "resnet50":
        import torchvision

        model = torchvision.models.resnet50(weights=None).to(dev)
        x = torch.randn(b, 3, 224, 224, device=dev)
        y = torch.randint(0, 1000, (b,), device=dev)

        def loss_of(m):
            return F.cross_entropy(m(x), y)

    elif kind == "nanogpt":
        model = _nanogpt(torch).to(dev)
        x = torch.randint(0, 50304, (b, 1024), device=dev)
        y = torch.randint(0, 50304, (b, 1024), device=dev)

        def loss_of(m):
            return m(x, y)

    else:
        raise ValueError(kind)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    if spec["opt"] == "sgd":
        opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    elif kind == "nanogpt":  # configure_optimizers: 2-D weights decay, the rest not
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.95), fused=True)
    else:
        opt = torch.optim.AdamW(params, lr=1e-4, **({"fused": True} if spec["opt"] == "adamw_fused" else {}))
    run_model = model
    if spec.get("compile"):
        run_model = (compile_fn or torch.compile)(model)
    amp = spec["dtype"] == "amp_bf16"

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            loss = loss_of(run_model)
        loss.backward()
        if kind == "nanogpt":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, {"params": sum(p.numel() for p in params)}


# ----------------------------------------------------------------------------------------------- child
def child(args) -> None:
    import torch

    sys.path.insert(0, str(HERE.parent))
    from gpu_estimator_truth import _PEAK_KEYS, _Nvml, _Sampler

    spec = CONFIGS[args.workload]
    nvml = _Nvml(0)
    torch.cuda.init()
    if args.snapshot:
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=2_000_000)
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    context_process_bytes = nvml.process_bytes()
    sampler = _Sampler(nvml)
    sampler.start()
    t0 = time.time()
    step, info = build(spec, torch)
    steps = []
    cum_alloc = cum_res = 0
    oom = None
    try:
        for i in range(args.steps):
            before = torch.cuda.memory_stats()
            cum_alloc = max(cum_alloc, before["allocated_bytes.all.peak"])
            cum_res = max(cum_res, before["reserved_bytes.all.peak"])
            torch.cuda.reset_peak_memory_stats()
            ts = time.time()
            step()
            torch.cuda.synchronize()
            stats = torch.cuda.memory_stats()
            cum_alloc = max(cum_alloc, stats["allocated_bytes.all.peak"])
            cum_res = max(cum_res, stats["reserved_bytes.all.peak"])
            steps.append(
                {
                    "step": i,
                    "seconds": round(time.time() - ts, 2),
                    "step_peak_allocated_bytes": stats["allocated_bytes.all.peak"],
                    "step_peak_reserved_bytes": stats["reserved_bytes.all.peak"],
                    "cumulative_peak_allocated_bytes": cum_alloc,
                    "cumulative_peak_reserved_bytes": cum_res,
                    **{k: stats.get(k) for k in _PEAK_KEYS},
                    "nvml_process_bytes": nvml.process_bytes(),
                }
            )
    except torch.OutOfMemoryError as e:
        oom = str(e).splitlines()[0][:300]
    seconds = time.time() - t0
    time.sleep(0.02)
    sampler.stop.set()
    sampler.join()
    if args.snapshot:
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        with gzip.open(args.snapshot, "wb", compresslevel=9) as f:
            pickle.dump(snap, f, protocol=4)
    capture = None
    if args.capture and spec.get("compile") and spec["model"] in ("cnn", "resnet50") and oom is None:
        capture = _capture_convolutions(torch, step, args.capture)
    props = torch.cuda.get_device_properties(0)
    import torch._inductor.config as icfg

    print(
        json.dumps(
            {
                "spec": spec,
                "info": info,
                "steps": steps,
                "peak_allocated_bytes": cum_alloc,
                "peak_reserved_bytes": cum_res,
                "nvml_process_bytes_max_sampled": sampler.max_process_bytes or None,
                "nvml_process_bytes_after_context": context_process_bytes,
                "nvml_process_bytes_at_end": nvml.process_bytes(),
                "oom": oom,
                "train_seconds": round(seconds, 2),
                "device_name": props.name,
                "device_total_bytes": props.total_memory,
                "torch_version": torch.__version__,
                "cuda_version": torch.version.cuda,
                "cudnn_version": torch.backends.cudnn.version(),
                "inductor": {
                    "compile_threads": icfg.compile_threads,
                    "max_autotune": icfg.max_autotune,
                    "triton.cudagraphs": icfg.triton.cudagraphs,
                },
                "snapshot": Path(args.snapshot).name if args.snapshot else None,
                "convolution_capture": capture,
            }
        )
    )


def _capture_convolutions(torch, step, path: str) -> dict:
    """One more step (after the measured ones and the snapshot) with the compiled program's cuDNN convolution calls
    recorded as `scripts/gpu_op_workspaces.py` records eager ones (its `Capture`; the same JSON, so
    `scripts/build_conv_catalogue.py` can take it): Inductor runs convolutions in channels-last layouts that eager
    programs rarely use. The wrapper calls `extern_kernels.convolution(..., stride=...)` (keywords) and
    `torch.ops.aten.convolution_backward.default(...)`; both are routed through the capture with the positional
    arguments the dispatcher gives `aten.convolution.default`."""
    import gpu_op_workspaces
    from torch._inductor.select_algorithm import extern_kernels
    from torch.utils._pytree import tree_flatten

    t0 = time.time()
    torch.cuda.memory._record_memory_history(context=None, stacks="python", max_entries=4096)
    cap = gpu_op_workspaces.Capture(torch)
    cap.source = "compiled/" + Path(path).name.split("__")[0]
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "transposed", "output_padding", "groups")
    conv_fwd = torch.ops.aten.convolution.default
    conv_bwd = torch.ops.aten.convolution_backward
    original_conv = extern_kernels.convolution

    def convolution(*a, **k):
        full = tuple(a) + tuple(k[n] for n in names[len(a) :])
        return cap.dispatch(conv_fwd, full, {}, tree_flatten)

    class _Backward:
        default = staticmethod(lambda *a, **k: cap.dispatch(conv_bwd.default, a, k, tree_flatten))

        def __getattr__(self, name):
            return getattr(conv_bwd, name)

    extern_kernels.convolution = convolution
    torch.ops.aten.convolution_backward = _Backward()
    try:
        step()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - the capture is extra; the run's numbers are already taken
        cap.errors.append(f"{type(e).__name__}: {str(e)[:300]}")
    finally:
        extern_kernels.convolution = original_conv
        torch.ops.aten.convolution_backward = conv_bwd
        torch.cuda.memory._record_memory_history(enabled=None)
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
        "sources": {cap.source: {"seconds": round(time.time() - t0, 2)}},
        "errors": cap.errors[:200],
        "conv": cap.conv,
        "other_ops": [],
    }
    with gzip.open(path, "wt") as f:
        json.dump(result, f, indent=0, sort_keys=True)
    return {"keys": len(cap.conv), "errors": len(cap.errors), "snapshots": cap.snapshots}


# ----------------------------------------------------------------------------------------------- parent side
def _run(name: str, work: Path, steps: int, snapshots: bool) -> dict:
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env["PYTORCH_ALLOC_CONF"] = ""
    cache = Path(tempfile.mkdtemp(prefix=f"inductor-{name}-"))
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache)  # a cold compile, as a user's first run
    env["TRITON_CACHE_DIR"] = str(cache / "triton")
    env["TORCHINDUCTOR_COMPILE_THREADS"] = env.get("TORCHINDUCTOR_COMPILE_THREADS", "4")
    code = work / f"{name}__output_code.txt"
    if CONFIGS[name]["compile"]:
        env["TORCH_LOGS"] = "output_code"
        env["TORCH_LOGS_OUT"] = str(code)
    argv = [sys.executable, str(HERE), "--child", "--workload", name, "--steps", str(steps)]
    if snapshots:
        argv += ["--snapshot", str(work / f"{name}__compile.pickle.gz")]
    argv += ["--capture", str(work / f"{name}__op-workspaces.json.gz")]
    t0 = time.time()
    try:
        p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    if code.exists():
        with open(code, "rb") as f, gzip.open(str(code) + ".gz", "wb", compresslevel=9) as g:
            shutil.copyfileobj(f, g)
        code.unlink()
    if p.returncode != 0:
        return {"error": p.stderr[-4000:], "seconds": round(time.time() - t0, 1)}
    res = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("{")][-1])
    res["seconds"] = round(time.time() - t0, 1)
    res["stderr_tail"] = p.stderr[-1500:]
    return res


def parent(args) -> None:
    out = Path(args.out)
    work = out / "compile-h200"
    work.mkdir(parents=True, exist_ok=True)
    names = [n for n in CONFIGS if not args.only or n in args.only.split(",")]
    # The largest compiles first, so the wall time is the longest one's.
    names.sort(key=lambda n: (CONFIGS[n]["model"] not in ("nanogpt", "resnet50"), not CONFIGS[n]["compile"]))
    t0 = time.time()
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
        per_step = " ".join(f"{s['step_peak_allocated_bytes'] / 2**20:.0f}/{s['seconds']}s" for s in r["steps"])
        print(
            f"{n:40s} alloc {r['peak_allocated_bytes'] / 2**20:9.1f} MiB  reserved "
            f"{r['peak_reserved_bytes'] / 2**20:9.1f} MiB  nvml "
            f"{(r['nvml_process_bytes_max_sampled'] or 0) / 2**20:9.1f} MiB  "
            f"steps(alloc MiB/s) {per_step}  {r['seconds']} s",
            flush=True,
        )
    print(f"all {len(names)} configs in {time.time() - t0:.0f} s", flush=True)
    (out / "compile-truth.json").write_text(json.dumps(truth, indent=1, sort_keys=True))
    # What comes back from the device: at most 8 files of <= 16 MiB. Tars of <= 14 MiB, at most 6, the compiled
    # configs' files first (their generated code, then their snapshots); what does not fit is named.
    files = sorted(
        work.iterdir(),
        key=lambda f: ("_eager__" in f.name, not f.name.endswith((".txt.gz", ".json.gz")), f.name),
    )
    gpu_sim_truth.pack_tars(files, out, "compile-h200", max_tars=6)
    shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?")
    ap.add_argument("--jobs", type=int, default=10)
    ap.add_argument("--only", default="")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--no-snapshots", action="store_true")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--workload")
    ap.add_argument("--snapshot")
    ap.add_argument("--capture")
    args = ap.parse_args()
    if args.child:
        child(args)
    else:
        if not args.out:
            ap.error("give the output directory")
        parent(args)


if __name__ == "__main__":
    main()
