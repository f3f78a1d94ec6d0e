"""Records the allocator simulator's ground truth on a real CUDA GPU (run it on the H200).

Three kinds of run, each in a fresh process (the allocator's settings are fixed when CUDA starts):

* ``recorded``: a training workload (2 optimizer steps) under the default settings, with allocator history on
  from the first CUDA allocation; its snapshot and ``torch.cuda.memory_stats()``.
* ``real``: the same workload under a what-if setting (a few workloads), to check the replay oracle below.
* ``replay``: the recorded trace replayed through the real allocator under each setting — ``alloc`` becomes
  ``torch.empty(size, uint8)`` on the entry's stream, ``free_requested`` drops that tensor — including memory caps
  (``set_per_process_memory_fraction``) that force retries and caps that run out of memory.

Output: ``OUT/truth.json`` and ``OUT/sim-h200-N.tar`` holding one gzipped snapshot per run; unpack them into
``tests/fixtures/sim-h200/``. Usage: ``python scripts/gpu_sim_truth.py OUT [--jobs 6] [--only NAME,...]``.
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
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()

# name -> (builder kind, options). Each builds a model, an optimizer and a batch; two steps are recorded.
WORKLOADS: dict[str, dict] = {
    "mlp_sgd_fp32": {"kind": "mlp", "opt": "sgd", "dtype": "fp32", "batch": 256},
    "resnet18_sgd_fp32": {"kind": "tv", "arch": "resnet18", "opt": "sgd", "dtype": "fp32", "batch": 64},
    "resnet50_adamw_foreach_fp32": {
        "kind": "tv",
        "arch": "resnet50",
        "opt": "adamw_foreach",
        "dtype": "fp32",
        "batch": 64,
    },
    "resnet50_adamw_fused_amp": {
        "kind": "tv",
        "arch": "resnet50",
        "opt": "adamw_fused",
        "dtype": "amp_bf16",
        "batch": 64,
    },
    "resnet50_sgd_amp_fp16": {"kind": "tv", "arch": "resnet50", "opt": "sgd", "dtype": "amp_fp16", "batch": 64},
    "vit_b16_adamw_amp": {"kind": "tv", "arch": "vit_b_16", "opt": "adamw_foreach", "dtype": "amp_bf16", "batch": 32},
    "bert_base_adamw_fp32": {
        "kind": "hf",
        "arch": "bert",
        "opt": "adamw_foreach",
        "dtype": "fp32",
        "batch": 8,
        "seq": 128,
    },
    "gpt2_adamw_amp": {
        "kind": "hf",
        "arch": "gpt2",
        "opt": "adamw_foreach",
        "dtype": "amp_bf16",
        "batch": 8,
        "seq": 512,
    },
    "gpt2_ckpt_adamw_amp": {
        "kind": "hf",
        "arch": "gpt2",
        "opt": "adamw_foreach",
        "dtype": "amp_bf16",
        "batch": 8,
        "seq": 512,
        "ckpt": True,
    },
    "gpt2_adamw_fused_bf16": {
        "kind": "hf",
        "arch": "gpt2",
        "opt": "adamw_fused",
        "dtype": "bf16",
        "batch": 8,
        "seq": 512,
    },
    "llama_adamw_fused_amp": {
        "kind": "hf",
        "arch": "llama",
        "opt": "adamw_fused",
        "dtype": "amp_bf16",
        "batch": 4,
        "seq": 512,
    },
    "opt125m_adam_fp32": {"kind": "hf", "arch": "opt", "opt": "adam_single", "dtype": "fp32", "batch": 4, "seq": 256},
}

# What-if settings replayed for every workload. "cap_*" limits are set from the recorded run's peaks.
SETTINGS: dict[str, dict] = {
    "default": {"alloc_conf": ""},
    "expandable": {"alloc_conf": "expandable_segments:True"},
    "max_split_64": {"alloc_conf": "max_split_size_mb:64"},
    "roundup_4": {"alloc_conf": "roundup_power2_divisions:4"},
    "roundup_intervals": {"alloc_conf": "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]"},
    "gc_06_cap_reserved": {"alloc_conf": "garbage_collection_threshold:0.6", "cap": "reserved"},
    "cap_retry": {"alloc_conf": "", "cap": "between"},
    "cap_oom": {"alloc_conf": "", "cap": "below_allocated"},
    "expandable_cap_retry": {"alloc_conf": "expandable_segments:True", "cap": "between"},
}
# Real (non-replayed) runs under a what-if setting, to check that replay == real for these workloads.
REAL_RUNS = {
    "resnet50_adamw_foreach_fp32": ["expandable", "max_split_64", "roundup_4", "gc_06_cap_reserved", "cap_retry"],
    "gpt2_adamw_amp": ["expandable", "max_split_64", "roundup_4", "gc_06_cap_reserved", "cap_retry"],
    "bert_base_adamw_fp32": ["expandable", "max_split_64"],
}


# ----------------------------------------------------------------------------------------------- child side
def _build(spec: dict, torch):
    dev = "cuda"
    kind = spec["kind"]
    if kind == "mlp":
        model = torch.nn.Sequential(
            torch.nn.Linear(1024, 4096),
            torch.nn.ReLU(),
            torch.nn.Linear(4096, 4096),
            torch.nn.ReLU(),
            torch.nn.Linear(4096, 10),
        ).to(dev)
        x = torch.randn(spec["batch"], 1024, device=dev)
        y = torch.randint(0, 10, (spec["batch"],), device=dev)

        def loss_fn():
            return torch.nn.functional.cross_entropy(model(x), y)
    elif kind == "tv":
        import torchvision

        model = getattr(torchvision.models, spec["arch"])(weights=None).to(dev)
        x = torch.randn(spec["batch"], 3, 224, 224, device=dev)
        y = torch.randint(0, 1000, (spec["batch"],), device=dev)

        def loss_fn():
            return torch.nn.functional.cross_entropy(model(x), y)
    else:
        import transformers as tf

        arch = spec["arch"]
        if arch == "bert":
            cfg = tf.BertConfig()
            model = tf.BertForMaskedLM(cfg)
        elif arch == "gpt2":
            cfg = tf.GPT2Config()
            model = tf.GPT2LMHeadModel(cfg)
        elif arch == "llama":
            cfg = tf.LlamaConfig(
                hidden_size=1024,
                intermediate_size=2816,
                num_hidden_layers=8,
                num_attention_heads=16,
                num_key_value_heads=16,
                vocab_size=32000,
                max_position_embeddings=1024,
            )
            model = tf.LlamaForCausalLM(cfg)
        elif arch == "opt":
            cfg = tf.OPTConfig(hidden_size=768, num_hidden_layers=12, ffn_dim=3072, num_attention_heads=12)
            model = tf.OPTForCausalLM(cfg)
        else:
            raise SystemExit(f"unknown arch {arch}")
        if spec.get("ckpt"):
            model.gradient_checkpointing_enable()
        model = model.to(dev)
        ids = torch.randint(0, cfg.vocab_size, (spec["batch"], spec["seq"]), device=dev)

        def loss_fn():
            return model(input_ids=ids, labels=ids).loss

    if spec["dtype"] == "bf16":
        model = model.to(torch.bfloat16)
    model.train()
    return model, optimizer(torch, spec["opt"], model.parameters()), loss_fn


def optimizer(torch, kind: str, params):
    """The spec's optimizer ("sgd", "adamw_foreach", "adamw_fused", else Adam for-loop): every truth recorder's."""
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    if kind == "adamw_foreach":
        return torch.optim.AdamW(params, lr=1e-4, foreach=True)
    if kind == "adamw_fused":
        return torch.optim.AdamW(params, lr=1e-4, fused=True)
    return torch.optim.Adam(params, lr=1e-4, foreach=False)


def train_step(spec: dict, torch, opt, loss_fn, scaler) -> None:
    """One optimizer step under the spec's dtype (autocast for amp_*, a GradScaler for amp_fp16): every truth
    recorder's step."""
    amp = spec["dtype"].startswith("amp")
    amp_dtype = torch.float16 if spec["dtype"] == "amp_fp16" else torch.bfloat16
    with torch.autocast("cuda", dtype=amp_dtype, enabled=amp):
        loss = loss_fn()
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        opt.step()
    opt.zero_grad(set_to_none=True)
    del loss


def _train(spec: dict, torch, steps: int) -> None:
    model, opt, loss_fn = _build(spec, torch)
    scaler = torch.amp.GradScaler("cuda") if spec["dtype"] == "amp_fp16" else None
    for _ in range(steps):
        train_step(spec, torch, opt, loss_fn, scaler)
    torch.cuda.synchronize()


def _history_kwargs(spec: dict | None) -> dict:
    # Python stacks, except where they break backward (checkpointed HF models on 2.11: internals doc §11).
    if spec is not None and spec.get("ckpt"):
        return {"context": None, "stacks": "python", "max_entries": 2_000_000}
    return {"stacks": "python", "max_entries": 2_000_000}


def _set_cap(torch, limit_bytes: int | None) -> float | None:
    if limit_bytes is None:
        return None
    total = torch.cuda.get_device_properties(0).total_memory
    fraction = limit_bytes / total
    torch.cuda.set_per_process_memory_fraction(fraction, 0)
    return fraction


def _oom_entry(snapshot: dict) -> dict | None:
    for dev_trace in snapshot.get("device_traces", []):
        for i, e in enumerate(dev_trace):
            if e.get("action") == "oom":
                return {"entry": i, "requested_bytes": e.get("size")}
    return None


def child_train(args) -> None:
    import torch

    spec = WORKLOADS[args.workload]
    limit = args.limit_bytes if args.limit_bytes >= 0 else None
    torch.cuda.init()
    torch.cuda.memory._record_memory_history(**_history_kwargs(spec))
    fraction = _set_cap(torch, limit)
    oom = None
    try:
        _train(spec, torch, args.steps)
    except torch.OutOfMemoryError as e:
        oom = {"message": str(e).splitlines()[0][:300]}
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    with gzip.open(args.snapshot, "wb", compresslevel=9) as f:
        pickle.dump(snap, f, protocol=4)
    if oom is not None:
        found = _oom_entry(snap)
        if found:
            oom.update(found)
    print(
        json.dumps(
            {
                "stats": torch.cuda.memory_stats(),
                "oom": oom,
                "memory_fraction": fraction,
                "device_total_bytes": torch.cuda.get_device_properties(0).total_memory,
                "torch_version": torch.__version__,
            }
        )
    )


def child_replay(args) -> None:
    import torch

    with gzip.open(args.source, "rb") as f:
        snap = pickle.load(f)
    traces = snap["device_traces"][0]
    limit = args.limit_bytes if args.limit_bytes >= 0 else None
    torch.cuda.init()
    torch.cuda.memory._record_memory_history(context=None, max_entries=2_000_000)
    fraction = _set_cap(torch, limit)
    streams: dict[int, object] = {}
    live: dict[int, object] = {}
    oom = None
    default = torch.cuda.current_stream()
    for i, e in enumerate(traces):
        action = e["action"]
        if action == "alloc":
            sid = e.get("stream", 0)
            if sid not in streams:
                streams[sid] = default if sid in (0, default.cuda_stream) else torch.cuda.Stream()
            s = streams[sid]
            try:
                with torch.cuda.stream(s):
                    live[e["addr"]] = torch.empty(e["size"], dtype=torch.uint8, device="cuda")
            except torch.OutOfMemoryError as err:
                oom = {"entry": i, "requested_bytes": e["size"], "message": str(err).splitlines()[0][:300]}
                break
        elif action == "free_requested":
            live.pop(e["addr"], None)
    torch.cuda.synchronize()
    out = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    with gzip.open(args.snapshot, "wb", compresslevel=9) as f:
        pickle.dump(out, f, protocol=4)
    print(
        json.dumps(
            {
                "stats": torch.cuda.memory_stats(),
                "oom": oom,
                "memory_fraction": fraction,
                "streams": len(streams),
                "entries": len(traces),
            }
        )
    )


# ----------------------------------------------------------------------------------------------- parent side
def _run_child(argv: list[str], conf: str) -> dict:
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env["PYTORCH_ALLOC_CONF"] = conf
    t0 = time.time()
    p = subprocess.run([sys.executable, str(HERE), *argv], env=env, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        return {"error": p.stderr[-3000:], "seconds": time.time() - t0}
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("{")][-1]
    res = json.loads(line)
    res["seconds"] = round(time.time() - t0, 1)
    return res


def _limit_for(cap: str | None, stats: dict) -> int | None:
    if cap is None:
        return None
    alloc = stats["allocated_bytes.all.peak"]
    reserved = stats["reserved_bytes.all.peak"]
    if cap == "reserved":
        return reserved
    if cap == "between":
        return alloc + (reserved - alloc) // 2
    if cap == "below_allocated":
        return int(alloc * 0.85)
    raise ValueError(cap)


def _slim(res: dict, name: str | None, conf: str, limit: int | None) -> dict:
    return {
        "alloc_conf": conf,
        "memory_fraction": res.get("memory_fraction"),
        "memory_limit_bytes": limit,
        "snapshot": name,
        "stats": res.get("stats"),
        "oom": res.get("oom"),
        "seconds": res.get("seconds"),
        "error": res.get("error"),
    }


def parent(args) -> None:
    out = Path(args.out)
    work = out / "sim-h200"
    work.mkdir(parents=True, exist_ok=True)
    names = [n for n in WORKLOADS if not args.only or n in args.only.split(",")]
    truth: dict = {"workloads": {}, "settings": SETTINGS}
    t0 = time.time()
    with cf.ThreadPoolExecutor(args.jobs) as pool:
        rec = {
            n: pool.submit(
                _run_child, ["--child-train", "--workload", n, "--snapshot", str(work / f"{n}__recorded.pickle.gz")], ""
            )
            for n in names
        }
        recorded = {n: f.result() for n, f in rec.items()}
        print(f"recorded {len(names)} workloads in {time.time() - t0:.0f} s", flush=True)
        jobs = {}
        for n in names:
            r = recorded[n]
            truth["workloads"][n] = {
                "recorded": _slim(r, f"{n}__recorded.pickle.gz", "", None),
                "real": {},
                "replay": {},
            }
            if "error" in r:
                print(f"{n}: recording failed:\n{r['error']}", flush=True)
                continue
            truth.setdefault("torch_version", r["torch_version"])
            truth.setdefault("device_total_bytes", r["device_total_bytes"])
            for s, cfg in SETTINGS.items():
                limit = _limit_for(cfg.get("cap"), r["stats"])
                snap = f"{n}__replay__{s}.pickle.gz"
                argv = [
                    "--child-replay",
                    "--source",
                    str(work / f"{n}__recorded.pickle.gz"),
                    "--snapshot",
                    str(work / snap),
                    "--limit-bytes",
                    str(-1 if limit is None else limit),
                ]
                jobs[(n, "replay", s)] = (pool.submit(_run_child, argv, cfg["alloc_conf"]), snap, cfg, limit)
            for s in REAL_RUNS.get(n, []):
                cfg = SETTINGS[s]
                limit = _limit_for(cfg.get("cap"), r["stats"])
                snap = f"{n}__real__{s}.pickle.gz"
                argv = [
                    "--child-train",
                    "--workload",
                    n,
                    "--snapshot",
                    str(work / snap),
                    "--limit-bytes",
                    str(-1 if limit is None else limit),
                ]
                jobs[(n, "real", s)] = (pool.submit(_run_child, argv, cfg["alloc_conf"]), snap, cfg, limit)
        for (n, kind, s), (fut, snap, cfg, limit) in jobs.items():
            res = fut.result()
            truth["workloads"][n][kind][s] = _slim(res, snap if "error" not in res else None, cfg["alloc_conf"], limit)
            if "error" in res:
                print(f"{n} {kind} {s}: failed:\n{res['error']}", flush=True)
    print(f"all runs done in {time.time() - t0:.0f} s", flush=True)
    # A short table: replay vs recorded/real, so the log shows at once whether the oracle holds.
    for n, w in truth["workloads"].items():
        rs = w["recorded"]["stats"]
        if not rs:
            continue
        print(f"{n}: recorded alloc {rs['allocated_bytes.all.peak']} reserved {rs['reserved_bytes.all.peak']}")
        for s, rep in w["replay"].items():
            st = rep["stats"] or {}
            real = w["real"].get(s) or ({"stats": rs} if s == "default" else None)
            rst = (real or {}).get("stats") or {}
            match = (
                ""
                if not rst
                else (
                    " == real"
                    if (rst.get("allocated_bytes.all.peak"), rst.get("reserved_bytes.all.peak"))
                    == (st.get("allocated_bytes.all.peak"), st.get("reserved_bytes.all.peak"))
                    else f" != real ({rst.get('allocated_bytes.all.peak')}, {rst.get('reserved_bytes.all.peak')})"
                )
            )
            print(
                f"   replay {s:22s} alloc {st.get('allocated_bytes.all.peak')} reserved "
                f"{st.get('reserved_bytes.all.peak')} retries {st.get('num_alloc_retries')} "
                f"oom {bool(rep['oom'])}{match}"
            )
    (work / "truth.json").write_text(json.dumps(truth, indent=1, sort_keys=True))
    # What comes back from the device is at most 8 files of 16 MiB: the (already gzipped) snapshots in plain
    # tars of at most ~14 MiB each, truth.json on its own.
    pack_tars(sorted(work.glob("*.pickle.gz")), out, "sim-h200")
    (out / "truth.json").write_text((work / "truth.json").read_text())
    for f in work.iterdir():
        f.unlink()
    work.rmdir()


def pack_tars(files: list[Path], out: Path, name: str, max_tars: int | None = None) -> None:
    """Packs `files`, in their order, into plain tars `out/NAME-0.tar`, … of at most ~14 MiB each (what comes
    back from the device is at most 8 files of 16 MiB), under the folder `NAME/`; past `max_tars` tars, what
    does not fit is named and left out. Every truth recorder's packing."""
    packs: list[list[Path]] = [[]]
    size = 0
    for f in files:
        n = f.stat().st_size
        if packs[-1] and size + n > 14 * 2**20:
            if max_tars is not None and len(packs) == max_tars:
                print(f"left out (size): {f.name} {n} B", flush=True)
                continue
            packs.append([])
            size = 0
        packs[-1].append(f)
        size += n
    for i, pack in enumerate(p for p in packs if p):
        tar_path = out / f"{name}-{i}.tar"
        with tarfile.open(tar_path, "w") as tar:
            for f in pack:
                tar.add(f, arcname=f"{name}/{f.name}")
        print(f"wrote {tar_path} ({tar_path.stat().st_size} bytes)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?")
    ap.add_argument("--jobs", type=int, default=6)
    ap.add_argument("--only", default="")
    ap.add_argument("--child-train", action="store_true")
    ap.add_argument("--child-replay", action="store_true")
    ap.add_argument("--workload")
    ap.add_argument("--snapshot")
    ap.add_argument("--source")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--limit-bytes", type=int, default=-1)
    args = ap.parse_args()
    if args.child_train:
        child_train(args)
    elif args.child_replay:
        child_replay(args)
    else:
        if not args.out:
            ap.error("give the output directory")
        parent(args)


if __name__ == "__main__":
    main()
