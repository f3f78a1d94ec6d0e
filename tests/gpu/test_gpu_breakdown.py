"""The Monitor's memory breakdown (python/torchmem/_breakdown.py) on a real GPU (formerly
scripts/gpu_check_breakdown.py; about 2-3 minutes on the H200).

Per model (an MLP always, with foreach and with fused AdamW; ResNet-18 from torchvision and GPT-2 from
transformers when installed), one training step on cuda:0 under a Monitor:
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
    gradients and optimizer state judged (within 1 %), the others printed (INFO: the profiler infers them by
    data flow, and counts temporaries of the forward it cannot tell from activations as ACTIVATION).
Also: GPT-2 with gradient checkpointing and bf16 autocast trains under the Monitor with the same loss and
gradients as without it (the hazard of docs/pytorch-memory-internals.md §11 is about allocator history; this
checks that the saved-tensors hook does not add one); and the cost on a ResNet-50 / GPT-2 step
(bench/breakdown.py, the default breakdown — one step in 10 measured — vs a phases-only Monitor, target
≤ 1 % of an untraced step; every step measured and torch.profiler side by side, printed for the record).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import pytest
import torch
import torchmem
from autograd_graph import graph_saved_bytes, storage_key
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIB = 1 << 20


def info(name: str, detail: str) -> None:
    print(f"INFO {name}: {detail}", flush=True)


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def nbytes(params: Any) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MIB:.2f} MiB"


def entry(marker: dict, device: str) -> dict:
    found = [e for e in marker["breakdown"] if e["device"] == device]
    if not found:
        raise AssertionError(f"no {device} entry in {[e['device'] for e in marker['breakdown']]}")
    return found[0]


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


# --- the models and one measured step of each --------------------------------------------------------------------

# tag -> (model name, fused AdamW); the module each needs
TAGS = {
    "mlp": ("mlp", False),
    "mlp fused AdamW": ("mlp", True),
    "resnet18": ("resnet18", False),
    "gpt2": ("gpt2", False),
}
NEEDS = {"resnet18": "torchvision", "gpt2": "transformers"}


def make_model(name: str, device: torch.device) -> tuple[nn.Module, Any, Any]:
    """(model, batch, loss function of the output)."""
    torch.manual_seed(0)
    if name == "mlp":
        mlp = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 4096), nn.Tanh(), nn.Linear(4096, 10))
        return mlp.to(device), torch.randn(256, 1024, device=device), lambda o: o.float().pow(2).mean()
    if name == "resnet18":
        import torchvision

        r18 = torchvision.models.resnet18().to(device)
        return r18, torch.randn(32, 3, 224, 224, device=device), lambda o: o.float().logsumexp(1).mean()
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=4, n_embd=768, n_head=12, vocab_size=50257, n_positions=512)
    gpt = GPT2LMHeadModel(cfg).to(device)
    ids = torch.randint(0, cfg.vocab_size, (4, 256), device=device)
    return gpt, ids, lambda o: o.logits.float().logsumexp(-1).mean()


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


def measure_model(tag: str) -> dict[str, Any]:
    """Two monitored steps of the model of `tag` on cuda:0, the allocator read around one boundary's measurement
    and a third step under torch.profiler: every number the tests of `tag` judge."""
    name, fused = TAGS[tag]
    device = torch.device("cuda", 0)
    dev = "cuda:0"
    model, x, loss_of = make_model(name, device)
    params = list({id(p): p for p in model.parameters()}.values())
    r: dict[str, Any] = {
        "want_params": nbytes(params),
        "n_params": len(params),
        "x_bytes": x.numel() * x.element_size(),
    }
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True) if fused else torch.optim.AdamW(model.parameters())
    mon = torchmem.Monitor(model, opt, verbose=False, warn=False)
    try:
        one_step(mon, model, x, loss_of, opt)  # optimizer state exists from here on
        got = one_step(mon, model, x, loss_of, opt)
        b = {bd["boundary"]: bd for bd in mon.breakdown()["boundaries"]}
        fwd, bwd, ost = b["end of forward"], b["end of backward"], b["end of optimizer step"]
        r["parameters"] = entry(fwd, dev)["parameters_bytes"]
        r["gradients"] = entry(bwd, dev)["gradients_bytes"]
        r["optimizer_state"] = entry(ost, dev)["optimizer_state_bytes"]
        r["cpu_optimizer_state"] = None if fused else entry(ost, "cpu")["optimizer_state_bytes"]
        r["activations"] = entry(got["forward_end"], dev)["activations_bytes"]
        r["graph_saved"] = got["graph_saved"]
        r["inputs"] = entry(got["forward_end"], dev)["inputs_bytes"]
        # the allocator around one boundary's measurement
        torch.cuda.synchronize()
        a0, r0 = torch.cuda.memory_allocated(0), torch.cuda.memory_reserved(0)
        entries, _ = mon._bd.measure(0)
        a1, r1 = torch.cuda.memory_allocated(0), torch.cuda.memory_reserved(0)
        s = torchmem.stats(0)
        r["allocator"] = {"a0": a0, "r0": r0, "same": a0 == a1 and r0 == r1, "stats": s}
        r["entry"] = [e for e in entries if e["device"] == dev][0]
        r["profiler"] = vs_profiler(tag, mon, model, x, loss_of, opt)
    finally:
        mon.close()
        for p in model.parameters():
            p.grad = None
        del model, opt
        torch.cuda.empty_cache()
    return r


def vs_profiler(tag: str, mon: Any, model: nn.Module, x: Any, loss_of: Any, opt: Any) -> dict[str, Any]:
    """A third step under torch.profiler(profile_memory=True): the maxima of each category of its memory timeline
    against ours (the table printed), its per-tensor extras, and the attribution of our INPUT / ACTIVATION."""
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
    for cat in ("INPUT", "ACTIVATION"):
        info(f"{tag} vs torch.profiler {cat}", f"{mib(ours[cat])} vs {mib(theirs[cat])}")
    profiler_attribution(tag, prof, {"ACTIVATION": saved, "INPUT": inputs})
    return {"ours": ours, "theirs": theirs, "extras": extras}


@pytest.fixture(scope="module")
def measured():
    """measured(tag): the numbers of one model's steps, measured once (on first use) for every test of that tag.
    A failure while measuring fails each test of the tag with it."""
    cache: dict[str, Any] = {}
    torch.cuda.init()
    print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)

    def get(tag: str) -> dict[str, Any]:
        need = NEEDS.get(TAGS[tag][0])
        if need and not _has(need):
            pytest.skip(f"{tag}: {need} not installed")
        if tag not in cache:
            try:
                cache[tag] = measure_model(tag)
            except Exception as exc:  # every test of the tag reports it
                cache[tag] = exc
        if isinstance(cache[tag], Exception):
            e = cache[tag]
            pytest.fail(f"{tag} checks: {type(e).__name__}: {e}")
        return cache[tag]

    return get


ALL_TAGS = list(TAGS)


@pytest.mark.parametrize("tag", ALL_TAGS)
def test_parameters(measured, tag: str) -> None:
    r = measured(tag)
    p, want = r["parameters"], r["want_params"]
    assert p == want, f"{tag} parameters: {p} B vs Σ numel·element_size {want} B"


@pytest.mark.parametrize("tag", ALL_TAGS)
def test_gradients(measured, tag: str) -> None:
    r = measured(tag)
    g, want = r["gradients"], r["want_params"]
    assert g == want, f"{tag} gradients: {g} B at the end of backward vs {want} B"


@pytest.mark.parametrize("tag", ALL_TAGS)
def test_optimizer_state(measured, tag: str) -> None:
    r = measured(tag)
    o, want, n = r["optimizer_state"], r["want_params"], r["n_params"]
    step_bytes = 4 * n
    if not TAGS[tag][1]:  # foreach: the step tensors on the CPU
        cpu_o = r["cpu_optimizer_state"]
        assert o == 2 * want and cpu_o == step_bytes, (
            f"{tag} optimizer state: GPU {o} B vs 2 x {want} B; CPU step tensors {cpu_o} B vs 4 x {n}"
        )
    else:
        assert o == 2 * want + step_bytes, (
            f"{tag} optimizer state: {o} B vs 2 x {want} + 4 x {n} B (step tensors on cuda:0)"
        )


@pytest.mark.parametrize("tag", ALL_TAGS)
def test_activations_equal_an_autograd_graph_walk(measured, tag: str) -> None:
    r = measured(tag)
    a = r["activations"]
    assert a == r["graph_saved"], f"{tag} activations: {mib(a)} vs autograd graph walk {mib(r['graph_saved'])}"


@pytest.mark.parametrize("tag", ALL_TAGS)
def test_inputs(measured, tag: str) -> None:
    r = measured(tag)
    i = r["inputs"]
    assert i == r["x_bytes"], f"{tag} inputs: {i} B vs the batch {r['x_bytes']} B"


@pytest.mark.parametrize("tag", ALL_TAGS)
def test_allocated_reserved_cache_equal_torch(measured, tag: str) -> None:
    r = measured(tag)
    al, e = r["allocator"], r["entry"]
    a0, r0 = al["a0"], al["r0"]
    assert al["same"] and e["allocated_bytes"] == a0 and e["reserved_bytes"] == r0 and e["cache_bytes"] == r0 - a0, (
        f"{tag} allocated/reserved/cache: allocated {e['allocated_bytes']} vs torch {a0}, reserved "
        f"{e['reserved_bytes']} vs {r0}, cache {e['cache_bytes']} vs {r0 - a0}"
    )


@pytest.mark.parametrize("tag", ALL_TAGS)
def test_other_is_allocated_less_the_counted_categories(measured, tag: str) -> None:
    e = measured(tag)["entry"]
    counted = sum(
        e[k] or 0
        for k in ("parameters_bytes", "gradients_bytes", "optimizer_state_bytes", "activations_bytes", "inputs_bytes")
    )
    assert e["other_bytes"] == e["allocated_bytes"] - counted and e["other_bytes"] >= 0, (
        f"{tag} other: {mib(e['other_bytes'])} = allocated {mib(e['allocated_bytes'])} - counted {mib(counted)}"
    )


@pytest.mark.parametrize("tag", ALL_TAGS)
def test_non_torch_is_nvml_less_reserved(measured, tag: str) -> None:
    r = measured(tag)
    e, s = r["entry"], r["allocator"]["stats"]
    if s.nvml_process_bytes is None:
        info(f"{tag} non_torch", f"{mib(e['non_torch_bytes'])} (NVML gives no per-process bytes here: device used)")
        pytest.skip("NVML gives no per-process bytes here (not judged, as the script's INFO line)")
    want = s.nvml_process_bytes - s.reserved_bytes
    assert abs(e["non_torch_bytes"] - want) <= 2 * MIB, (
        f"{tag} non_torch: {mib(e['non_torch_bytes'])} vs NVML process {mib(s.nvml_process_bytes)} - reserved = "
        f"{mib(want)}"
    )


@pytest.mark.parametrize("cat", ["PARAMETER", "OPTIMIZER_STATE", "GRADIENT"])
@pytest.mark.parametrize("tag", ALL_TAGS)
def test_vs_torch_profiler(measured, tag: str, cat: str) -> None:
    """Within 1 % of the profiler's highest value of the category over the step; else the difference must be
    exactly the profiler's own tensors of that category that are not one per parameter, less the parameters'
    sizes it has no tensor for (ours are checked exact against Σ numel·element_size above)."""
    pr = measured(tag)["profiler"]
    o, t = pr["ours"][cat], pr["theirs"][cat]
    within = t > 0 and abs(o - t) <= 0.01 * t
    if within or cat not in pr["extras"]:
        assert within, f"{tag} vs torch.profiler {cat}: {mib(o)} vs {mib(t)}"
        return
    extra, missing = pr["extras"][cat]
    explained = abs((t - o) - (extra - missing)) <= 0.01 * t
    assert explained, (
        f"{tag} vs torch.profiler {cat}: {mib(o)} vs {mib(t)}: the profiler's {mib(t - o)} more is "
        f"NOT its tensors not one per parameter ({mib(extra)}) less the parameters' sizes it has no tensor for "
        f"({mib(missing)}) = {mib(extra - missing)}"
    )
    print(
        f"{tag} vs torch.profiler {cat}: {mib(o)} vs {mib(t)}: the profiler's {mib(t - o)} more is exactly its "
        f"tensors not one per parameter ({mib(extra)}) less the parameters' sizes it has no tensor for "
        f"({mib(missing)}) = {mib(extra - missing)}"
    )


# --- the checkpointed, autocast GPT-2 --------------------------------------------------------------------


def test_gpt2_checkpointing_bf16_autocast_same_loss_and_gradients_under_the_monitor() -> None:
    if not _has("transformers"):
        pytest.skip("gpt2 checkpointing: transformers not installed")
    from transformers import GPT2Config, GPT2LMHeadModel

    device = torch.device("cuda", 0)
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
        del model
        torch.cuda.empty_cache()
    (l0, g0), (l1, g1) = results
    same = l0 == l1 and len(g0) == len(g1) and all(torch.equal(a, b) for a, b in zip(g0, g1, strict=False))
    assert same, (
        f"gpt2 checkpointing + bf16 autocast: loss {l0:.6f} vs {l1:.6f} with the Monitor, same gradients: {same}"
    )


# --- cost ------------------------------------------------------------------------------------------------


COST_RUNS = {
    "resnet50": ["--model", "resnet50", "--batch", "64"],
    "gpt2": ["--model", "gpt2", "--batch", "8"],
    "transformer": ["--model", "transformer", "--batch", "64"],  # only when neither torchvision nor transformers
}


@pytest.mark.parametrize("model", list(COST_RUNS))
def test_cost_of_the_default_breakdown(model: str) -> None:
    """bench/breakdown.py: the default breakdown (one step in 10 measured) over a phases-only Monitor, target
    <= 1 % of an untraced step; every step measured and torch.profiler printed (INFO)."""
    if model == "resnet50" and not _has("torchvision"):
        pytest.skip("torchvision not installed")
    if model == "gpt2" and not _has("transformers"):
        pytest.skip("transformers not installed")
    if model == "transformer" and (_has("torchvision") or _has("transformers")):
        pytest.skip("the transformer cost runs only when neither ResNet-50 nor GPT-2 can")
    extra = COST_RUNS[model]
    cmd = [
        sys.executable,
        os.path.join(ROOT, "bench", "breakdown.py"),
        "--device",
        "cuda",
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
    assert proc.returncode == 0, f"cost {model}: bench exit {proc.returncode}: {proc.stderr[-500:]}"
    # the table's rows: a later "breakdown over monitor: ..." line is not one
    rows: dict[str, list[str]] = {}
    for line in proc.stdout.splitlines():
        if line.split():
            rows.setdefault(line.split()[0], line.split())
    base, plain, bd = (float(rows[m][1]) for m in ("untraced", "monitor", "breakdown"))
    over = (bd - plain) / base * 100
    for mode in ("breakdown-every-step", "torch.profiler"):
        if mode in rows:
            t = float(rows[mode][1])
            print(
                f"INFO cost {model} {mode}: {t:.2f} ms per step, {(t - plain) / base * 100:+.2f} % over the "
                "phases-only Monitor",
                flush=True,
            )
    assert over <= 1.0, (
        f"cost {model}: breakdown (default: one step in 10 measured) {bd:.2f} ms vs phases-only Monitor {plain:.2f} ms "
        f"vs untraced {base:.2f} ms per step: {over:+.2f} % of an untraced step (target <= 1 %), "
        f"{time.perf_counter() - t0:.0f} s"
    )
