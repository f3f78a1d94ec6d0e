"""GPU checks of the Monitor's memory breakdown (python/torchmem/_breakdown.py), run on the H200:
`python scripts/gpu_check_breakdown.py` (about 2-3 minutes; `--device cpu` runs the same checks, minus the
allocator ones, on a CPU-only machine as a smoke test). One PASS/FAIL line per check, INFO lines for
numbers that are printed, not judged; the exit code is non-zero when any check failed.

Per model (an MLP always; ResNet-18 from torchvision and GPT-2 from transformers when installed), one
training step on cuda:0 under a Monitor, AdamW (foreach; fused for the MLP too):
  - parameters == Σ numel·element_size of the unique parameters (GPT-2's tied embedding once);
  - gradients at the end of backward == the same (fp32); optimizer state at the end of the optimizer step
    == 2 × parameters on the GPU, plus 4 bytes per parameter for the step tensors (on the CPU for foreach,
    on the GPU for fused);
  - activations at the end of forward == an independent walk of the autograd graph (unique storages of
    every node's saved tensors, minus parameters and inputs);
  - cache == reserved − allocated and allocated/reserved == torch.cuda's own numbers at the same moment;
    other == allocated − the five counted categories (>= 0);
  - non_torch == NVML's bytes for this process − reserved (torchmem.stats() at the same moment);
  - each category against torch.profiler's memory timeline (`export_memory_timeline` raw `.raw.json.gz`:
    PARAMETER, OPTIMIZER_STATE, INPUT, ACTIVATION, GRADIENT; the highest value of each over the same step
    vs the highest breakdown value over the step's boundaries): a table with the differences; parameters,
    gradients and optimizer state judged (within 1 %), the others printed (the profiler infers them by
    data flow, and counts temporaries of the forward it cannot tell from activations as ACTIVATION).
Also: GPT-2 with gradient checkpointing and bf16 autocast trains under the Monitor with the same loss and
gradients as without it (the hazard of docs/pytorch-memory-internals.md §11 is about allocator history; this
checks that the saved-tensors hook does not add one); and the cost on a ResNet-50 / GPT-2 step
(bench/breakdown.py, the default breakdown — one step in 10 measured — vs a phases-only Monitor, target
≤ 1 % of an untraced step; every step measured and torch.profiler side by side, for the record).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

import torch
import torchmem
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAILURES: list[str] = []
MIB = 1 << 20


def check(name: str, ok: bool, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        FAILURES.append(name)


def info(name: str, detail: str) -> None:
    print(f"INFO {name}: {detail}", flush=True)


def nbytes(params: Any) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MIB:.2f} MiB"


def storage_key(t: torch.Tensor) -> tuple[int, int]:
    return (t.get_device(), t.untyped_storage().data_ptr())


def graph_saved_bytes(output: torch.Tensor, exclude: set, device: torch.device) -> int:
    """Independent count of what autograd saved, on `device`: unique storages of every node's `_saved_*`
    tensors (and custom Functions' `saved_tensors`), minus `exclude`; Python numbers (0-dim float64 CPU
    tensors, which autograd saves without any hook) left out."""
    seen_nodes, seen, total = set(), set(exclude), 0
    if not isinstance(output, torch.Tensor):  # a Hugging Face ModelOutput
        output = output.logits
    stack = [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen_nodes:
            continue
        seen_nodes.add(node)
        values = [getattr(node, n) for n in dir(node) if n.startswith("_saved_")]
        if hasattr(node, "saved_tensors"):
            values.append(node.saved_tensors)
        for v in values:
            for t in v if isinstance(v, (tuple, list)) else [v]:
                if not isinstance(t, torch.Tensor) or t.device != device:
                    continue
                if t.dim() == 0 and t.dtype == torch.float64 and not t.is_cuda:
                    continue
                s = t.untyped_storage()
                k = storage_key(t)
                if s.nbytes() and k not in seen:
                    seen.add(k)
                    total += s.nbytes()
        stack.extend(f for f, _ in node.next_functions)
    return total


def entry(marker: dict, device: str) -> dict:
    found = [e for e in marker["breakdown"] if e["device"] == device]
    if not found:
        raise AssertionError(f"no {device} entry in {[e['device'] for e in marker['breakdown']]}")
    return found[0]


# --- models ----------------------------------------------------------------------------------------------


def make_models(device: torch.device) -> list[tuple[str, nn.Module, Any, Any]]:
    """(name, model, batch, loss function of the output)."""
    torch.manual_seed(0)
    out = []
    mlp = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 4096), nn.Tanh(), nn.Linear(4096, 10))
    out.append(("mlp", mlp.to(device), torch.randn(256, 1024, device=device), lambda o: o.float().pow(2).mean()))
    try:
        import torchvision

        r18 = torchvision.models.resnet18().to(device)
        out.append(
            ("resnet18", r18, torch.randn(32, 3, 224, 224, device=device), lambda o: o.float().logsumexp(1).mean())
        )
    except ImportError:
        info("resnet18", "torchvision not installed: skipped")
    try:
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_layer=4, n_embd=768, n_head=12, vocab_size=50257, n_positions=512)
        gpt = GPT2LMHeadModel(cfg).to(device)
        ids = torch.randint(0, cfg.vocab_size, (4, 256), device=device)
        out.append(("gpt2", gpt, ids, lambda o: o.logits.float().logsumexp(-1).mean()))
    except ImportError:
        info("gpt2", "transformers not installed: skipped")
    return out


def one_step(mon: Any, model: nn.Module, x: Any, loss_of: Any, opt: Any) -> dict[str, Any]:
    """One monitored step; returns what the checks need, read at the end of forward."""
    got: dict[str, Any] = {}
    with mon.step():
        out = model(x)
        ends = [m for m in mon.markers if m["kind"] == "phase" and m["name"] == "forward" and m["edge"] == "end"]
        got["forward_end"] = ends[-1]
        exclude = {storage_key(p) for p in model.parameters()} | {storage_key(x)}
        got["graph_saved"] = graph_saved_bytes(out, exclude, x.device)
        loss_of(out).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return got


def check_model(name: str, model: nn.Module, x: Any, loss_of: Any, device: torch.device, fused: bool) -> None:
    tag = f"{name}{' fused AdamW' if fused else ''}"
    dev = "cuda:0" if device.type == "cuda" else "cpu"
    params = list({id(p): p for p in model.parameters()}.values())
    want_params = nbytes(params)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True) if fused else torch.optim.AdamW(model.parameters())
    mon = torchmem.Monitor(model, opt, verbose=False, warn=False)
    try:
        one_step(mon, model, x, loss_of, opt)  # optimizer state exists from here on
        got = one_step(mon, model, x, loss_of, opt)
        b = {bd["boundary"]: bd for bd in mon.breakdown()["boundaries"]}
        fwd, bwd, ost = b["end of forward"], b["end of backward"], b["end of optimizer step"]
        p = entry(fwd, dev)["parameters_bytes"]
        check(f"{tag} parameters", p == want_params, f"{p} B vs Σ numel·element_size {want_params} B")
        g = entry(bwd, dev)["gradients_bytes"]
        check(f"{tag} gradients", g == want_params, f"{g} B at the end of backward vs {want_params} B")
        o = entry(ost, dev)["optimizer_state_bytes"]
        step_bytes = 4 * len(params)
        if device.type == "cuda" and not fused:
            cpu_o = entry(ost, "cpu")["optimizer_state_bytes"]
            check(
                f"{tag} optimizer state",
                o == 2 * want_params and cpu_o == step_bytes,
                f"GPU {o} B vs 2 x {want_params} B; CPU step tensors {cpu_o} B vs 4 x {len(params)}",
            )
        else:
            check(
                f"{tag} optimizer state",
                o == 2 * want_params + step_bytes,
                f"{o} B vs 2 x {want_params} + 4 x {len(params)} B (step tensors on {dev})",
            )
        a = entry(got["forward_end"], dev)["activations_bytes"]
        check(
            f"{tag} activations", a == got["graph_saved"], f"{mib(a)} vs autograd graph walk {mib(got['graph_saved'])}"
        )
        i = entry(got["forward_end"], dev)["inputs_bytes"]
        check(
            f"{tag} inputs", i == x.numel() * x.element_size(), f"{i} B vs the batch {x.numel() * x.element_size()} B"
        )
        if device.type == "cuda":
            check_allocator(tag, mon, model)
            check_vs_profiler(tag, mon, model, x, loss_of, opt, device)
    finally:
        mon.close()


def check_allocator(tag: str, mon: Any, model: nn.Module) -> None:
    torch.cuda.synchronize()
    a0, r0 = torch.cuda.memory_allocated(0), torch.cuda.memory_reserved(0)
    entries, _ = mon._bd.measure(0)
    a1, r1 = torch.cuda.memory_allocated(0), torch.cuda.memory_reserved(0)
    s = torchmem.stats(0)
    e = [x for x in entries if x["device"] == "cuda:0"][0]
    same = a0 == a1 and r0 == r1
    check(
        f"{tag} allocated/reserved/cache",
        same and e["allocated_bytes"] == a0 and e["reserved_bytes"] == r0 and e["cache_bytes"] == r0 - a0,
        f"allocated {e['allocated_bytes']} vs torch {a0}, reserved {e['reserved_bytes']} vs {r0}, "
        f"cache {e['cache_bytes']} vs {r0 - a0}",
    )
    counted = sum(
        e[k] or 0
        for k in ("parameters_bytes", "gradients_bytes", "optimizer_state_bytes", "activations_bytes", "inputs_bytes")
    )
    check(
        f"{tag} other",
        e["other_bytes"] == e["allocated_bytes"] - counted and e["other_bytes"] >= 0,
        f"other {mib(e['other_bytes'])} = allocated {mib(e['allocated_bytes'])} - counted {mib(counted)}",
    )
    if s.nvml_process_bytes is None:
        info(f"{tag} non_torch", f"{mib(e['non_torch_bytes'])} (NVML gives no per-process bytes here: device used)")
    else:
        want = s.nvml_process_bytes - s.reserved_bytes
        check(
            f"{tag} non_torch",
            abs(e["non_torch_bytes"] - want) <= 2 * MIB,
            f"{mib(e['non_torch_bytes'])} vs NVML process {mib(s.nvml_process_bytes)} - reserved = {mib(want)}",
        )


_PROFILER_INDEX = {"PARAMETER": 0, "OPTIMIZER_STATE": 1, "INPUT": 2, "ACTIVATION": 4, "GRADIENT": 5}
_OURS = {
    "PARAMETER": "parameters_bytes",
    "OPTIMIZER_STATE": "optimizer_state_bytes",
    "INPUT": "inputs_bytes",
    "ACTIVATION": "activations_bytes",
    "GRADIENT": "gradients_bytes",
}


def profiler_maxima(path: str) -> dict[str, int]:
    """The highest bytes of each category over the profiled step, from the raw timeline
    ([t_ns, action, ±bytes, category index] events, in order)."""
    with gzip.open(path, "rt") as f:
        events = json.load(f)
    now = [0] * 8
    high = [0] * 8
    for _t, _action, n, cat in events:
        now[cat] += n
        high[cat] = max(high[cat], now[cat])
    return {name: high[i] for name, i in _PROFILER_INDEX.items()}


def check_vs_profiler(
    tag: str, mon: Any, model: nn.Module, x: Any, loss_of: Any, opt: Any, device: torch.device
) -> None:
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "timeline.raw.json.gz")
        with torch.profiler.profile(activities=acts, profile_memory=True, record_shapes=True, with_stack=True) as prof:
            with mon.step():
                out = model(x)
                # Our activations and inputs of this step, by storage, while the saves are alive.
                bd = mon._bd
                inputs = {key: n for _ref, key, n in bd._inputs}
                saved = {k: r[1] for k, r in bd.saved.live().items() if k not in inputs} if bd.saved else {}
                loss_of(out).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        prof.export_memory_timeline(path, device="cuda:0")
        theirs = profiler_maxima(path)
    ours_b = mon.breakdown()["boundaries"]
    ours = {cat: max(entry(bd, "cuda:0")[key] or 0 for bd in ours_b) for cat, key in _OURS.items()}
    print(f"  {tag}: category         torchmem (max over boundaries)   torch.profiler (max over step)   diff")
    for cat in _OURS:
        print(f"  {tag}: {cat:<16} {mib(ours[cat]):>20} {mib(theirs[cat]):>32} {mib(ours[cat] - theirs[cat]):>12}")
    extras = profiler_extras(tag, prof, model)
    for cat in ("PARAMETER", "OPTIMIZER_STATE", "GRADIENT"):
        o, t = ours[cat], theirs[cat]
        within = t > 0 and abs(o - t) <= 0.01 * t
        if within or cat not in extras:
            check(f"{tag} vs torch.profiler {cat}", within, f"{mib(o)} vs {mib(t)}")
            continue
        # Not within 1 %: explained when the difference is the profiler's own tensors of that category that
        # are not one per parameter, less the parameters' sizes it has no tensor for (ours are checked exact
        # against Σ numel·element_size above).
        extra, missing = extras[cat]
        explained = abs((t - o) - (extra - missing)) <= 0.01 * t
        check(
            f"{tag} vs torch.profiler {cat}",
            explained,
            f"{mib(o)} vs {mib(t)}: the profiler's {mib(t - o)} more is "
            f"{'exactly' if explained else 'NOT'} its tensors not one per parameter ({mib(extra)}) less the "
            f"parameters' sizes it has no tensor for ({mib(missing)}) = {mib(extra - missing)}",
        )
    for cat in ("INPUT", "ACTIVATION"):
        info(f"{tag} vs torch.profiler {cat}", f"{mib(ours[cat])} vs {mib(theirs[cat])}")
    profiler_attribution(tag, prof, {"ACTIVATION": saved, "INPUT": inputs})


def profiler_attribution(tag: str, prof: Any, ours: dict[str, dict[Any, int]]) -> None:
    """Why INPUT and ACTIVATION differ (the two define them differently: ours are the forward's tensor
    arguments and what autograd saved for backward; the profiler's come from its data-flow inference): the
    category the profiler gave to each of our storages (by storage address, over the step), and the profiler's
    tensors of that category that are not ours."""
    from collections import Counter

    try:
        from torch.profiler._memory_profiler import Action

        mp = prof._memory_profile()
        by_ptr: dict[int, Counter] = {}
        theirs: dict[str, dict[int, int]] = {"ACTIVATION": {}, "INPUT": {}}
        for _t, action, (key, version), size in mp.timeline:
            if action not in (Action.PREEXISTING, Action.CREATE) or size <= 0:
                continue
            storage = getattr(key, "storage", None)  # some keys of the timeline have none
            if storage is None:
                continue
            name = getattr(mp._categories.get(key, version), "name", None) or "none"
            by_ptr.setdefault(storage.ptr, Counter())[name] += 1
            if name in theirs:
                theirs[name][storage.ptr] = size
        for cat, mine in ours.items():
            given: Counter = Counter()
            for (_dev, ptr), n in mine.items():
                names = by_ptr.get(ptr)
                given[(cat if names and cat in names else names.most_common(1)[0][0]) if names else "not seen"] += n
            ptrs = {ptr for _dev, ptr in mine}
            extra = {p: n for p, n in theirs[cat].items() if p not in ptrs}
            sizes = Counter(extra.values())
            top = ", ".join(f"{k} x {mib(b)}" for b, k in sorted(sizes.items(), key=lambda kv: -kv[0] * kv[1])[:5])
            info(
                f"{tag} profiler categories of our {cat.lower()}",
                f"{len(mine)} storages, {mib(sum(mine.values()))}: "
                + ", ".join(f"{k} {mib(v)}" for k, v in given.most_common())
                + f"; its {cat} tensors that are not ours: {len(extra)}, {mib(sum(extra.values()))}"
                + (f" ({top})" if top else ""),
            )
    except Exception as exc:  # a private API: say so, do not fail the run
        info(f"{tag} profiler categories", f"unavailable: {type(exc).__name__}: {exc}")


def profiler_extras(tag: str, prof: Any, model: nn.Module) -> dict[str, tuple[int, int]]:
    """Why PARAMETER and GRADIENT differ: the tensors the profiler put in each category whose sizes are not
    one per parameter (a transient copy, a buffer it calls a parameter), from its per-tensor categories.
    Returns {category: (bytes of those tensors, bytes of the parameters' sizes it has no tensor for)}; empty
    when its private per-tensor API is not there."""
    from collections import Counter

    try:
        from torch.profiler._memory_profiler import Action

        mp = prof._memory_profile()
        sizes = Counter(p.untyped_storage().nbytes() for p in {id(p): p for p in model.parameters()}.values())
        found: dict[str, dict[Any, int]] = {"PARAMETER": {}, "GRADIENT": {}}
        for _t, action, (key, version), size in mp.timeline:
            if action not in (Action.PREEXISTING, Action.CREATE) or size <= 0:
                continue
            cat = mp._categories.get(key, version)
            name = getattr(cat, "name", None)
            if name in found:
                found[name][(key.id, key.storage.ptr)] = size
        out: dict[str, tuple[int, int]] = {}
        for name, tensors in found.items():
            extra = Counter(tensors.values()) - sizes
            missing = sizes - Counter(tensors.values())
            top = ", ".join(f"{n} x {mib(b)}" for b, n in sorted(extra.items(), key=lambda kv: -kv[0] * kv[1])[:6])
            gone = sum(b * n for b, n in missing.items())
            info(
                f"{tag} profiler {name} tensors",
                f"{len(tensors)} tensors for {sum(sizes.values())} parameters; not one per parameter: "
                f"{top or 'none'} ({mib(sum(b * n for b, n in extra.items()))}); parameters' sizes it has no "
                f"tensor for: {mib(gone)}",
            )
            out[name] = (sum(b * n for b, n in extra.items()), gone)
        return out
    except Exception as exc:  # a private API: say so, do not fail the run
        info(f"{tag} profiler per-tensor categories", f"unavailable: {type(exc).__name__}: {exc}")
        return {}


# --- the checkpointed, autocast GPT-2 --------------------------------------------------------------------


def check_checkpointed_gpt2(device: torch.device) -> None:
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        info("gpt2 checkpointing", "transformers not installed: skipped")
        return
    dtype = torch.bfloat16
    results = []
    for monitored in (False, True):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_positions=256)).to(device)
        model.gradient_checkpointing_enable()
        model.train()
        ids = torch.randint(0, 50257, (2, 256), device=device)
        mon = torchmem.Monitor(model, verbose=False, warn=False) if monitored else None
        try:
            if mon is not None:
                with mon.step():
                    with torch.autocast(device.type, dtype=dtype):
                        loss = model(ids, labels=ids).loss
                    loss.backward()
            else:
                with torch.autocast(device.type, dtype=dtype):
                    loss = model(ids, labels=ids).loss
                loss.backward()
            results.append((loss.item(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
        finally:
            if mon is not None:
                mon.close()
    (l0, g0), (l1, g1) = results
    same = l0 == l1 and len(g0) == len(g1) and all(torch.equal(a, b) for a, b in zip(g0, g1, strict=False))
    check(
        "gpt2 checkpointing + bf16 autocast",
        same,
        f"loss {l0:.6f} vs {l1:.6f} with the Monitor, same gradients: {same}",
    )


# --- cost ------------------------------------------------------------------------------------------------


def check_cost(device: torch.device) -> None:
    have_tv = _has("torchvision")
    runs = []
    if have_tv:
        runs.append(["--model", "resnet50", "--batch", "64"])
    if _has("transformers"):
        runs.append(["--model", "gpt2", "--batch", "8"])
    if not runs:
        runs.append(["--model", "transformer", "--batch", "64"])
    for extra in runs:
        cmd = [
            sys.executable,
            os.path.join(ROOT, "bench", "breakdown.py"),
            "--device",
            device.type,
            "--blocks",
            "8",
            "--steps",
            "10",
            "--modes",
            "untraced,monitor,breakdown-no-saves,breakdown-every-step,breakdown,torch.profiler",
            *extra,
        ]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        print("\n".join("  " + line for line in proc.stdout.splitlines()))
        if proc.returncode != 0:
            check(f"cost {extra[1]}", False, f"bench exit {proc.returncode}: {proc.stderr[-500:]}")
            continue
        # the table's rows: a later "breakdown over monitor: ..." line is not one
        rows: dict[str, list[str]] = {}
        for line in proc.stdout.splitlines():
            if line.split():
                rows.setdefault(line.split()[0], line.split())
        base, plain, bd = (float(rows[m][1]) for m in ("untraced", "monitor", "breakdown"))
        over = (bd - plain) / base * 100
        check(
            f"cost {extra[1]}",
            over <= 1.0,
            f"breakdown (default: one step in 10 measured) {bd:.2f} ms vs phases-only Monitor {plain:.2f} ms vs "
            f"untraced {base:.2f} ms per step: {over:+.2f} % of an untraced step (target <= 1 %), "
            f"{time.perf_counter() - t0:.0f} s",
        )
        for mode in ("breakdown-every-step", "torch.profiler"):
            if mode in rows:
                t = float(rows[mode][1])
                print(
                    f"INFO cost {extra[1]} {mode}: {t:.2f} ms per step, {(t - plain) / base * 100:+.2f} % over the "
                    "phases-only Monitor",
                    flush=True,
                )


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-cost", action="store_true", help="skip the cost benchmark")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check_breakdown: no CUDA device here (use --device cpu for the CPU smoke test)")
    if device.type == "cuda":
        torch.cuda.init()
        print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    start = time.perf_counter()
    for name, model, x, loss_of in make_models(device):
        for fused in (False, True) if name == "mlp" else (False,):
            try:
                check_model(name, model, x, loss_of, device, fused)
            except Exception as exc:
                check(f"{name} checks", False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            for p in model.parameters():
                p.grad = None
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    try:
        check_checkpointed_gpt2(device)
    except Exception as exc:
        check("gpt2 checkpointing + bf16 autocast", False, f"{type(exc).__name__}: {exc}")
    if not args.no_cost:
        try:
            check_cost(device)
        except Exception as exc:
            check("cost", False, f"{type(exc).__name__}: {exc}")
    print(
        f"{'FAIL' if FAILURES else 'PASS'} summary: {len(FAILURES)} failed {FAILURES}, "
        f"{time.perf_counter() - start:.0f} s",
        flush=True,
    )
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
