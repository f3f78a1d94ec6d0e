"""Tests of the Monitor's memory breakdown (`python/torchmem/_breakdown.py`) with real torch on the CPU:
parameters, gradients and optimizer state counted by storage against their formulas (tied weights once,
AdamW 2x + its step tensors, SGD momentum 1x, foreach and fused, zero_grad both ways, autocast bf16,
gradient checkpointing); activations against an independent count of what autograd saved (a walk of the
autograd graph, and the program's own saved-tensors hooks); and that the saved-tensors hook changes nothing
in the program (no reference cycle with gc off, same gradients, in-place-after-save errors, checkpointing,
save_on_cpu, no_grad, a forward that raises, torch.compile)."""

from __future__ import annotations

import gc

import pytest
import torch
import torchmem
from autograd_graph import graph_saved_bytes, keys_of
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

CATEGORIES = ("parameters_bytes", "gradients_bytes", "optimizer_state_bytes", "activations_bytes", "inputs_bytes")


def nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def cpu_entry(marker: dict) -> dict:
    (entry,) = [e for e in marker["breakdown"] if e["device"] == "cpu"]
    return entry


def boundaries(mon) -> dict[str, dict]:
    """The last step's boundary markers' CPU breakdown entries, by boundary name."""
    return {b["boundary"]: {**cpu_entry(b), "_raw": b} for b in mon.breakdown()["boundaries"]}


class TiedLM(nn.Module):
    """An embedding tied to the output layer (GPT-2 style): one storage, two parameters' names."""

    def __init__(self, vocab: int = 100, dim: int = 32) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.body = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.LayerNorm(dim))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight
        self.scale = nn.Parameter(torch.ones(dim))  # a direct parameter: "(root)"

    def forward(self, ids):
        return self.head(self.body(self.wte(ids)) * self.scale)


class SavesOutputs(nn.Module):
    """exp and sigmoid save their own outputs: the case where a pack hook can build a reference cycle."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(256, 256)

    def forward(self, x):
        return torch.sigmoid(torch.exp(self.lin(x) * 0.01))


class InplaceAfterSave(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.exp(self.lin(x))
        h.add_(1)  # exp saved h: backward must refuse
        return h


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.a = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))
        self.b = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 10))

    def forward(self, x):
        h = checkpoint(self.a, x, use_reentrant=self.reentrant)
        return self.b(torch.relu(h))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 10))


# --- parameters, gradients, optimizer state ----------------------------------------------------------------


def test_parameters_count_tied_weights_once_and_by_top_level_module():
    model = TiedLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = torchmem.Monitor(model, opt, verbose=False)
    with mon.step():
        model(torch.randint(0, 100, (4, 16))).sum().backward()
        opt.step()
    b = boundaries(mon)
    unique = {id(p): p for p in model.parameters()}.values()  # parameters() yields the tied weight once
    want = nbytes(unique)
    assert want < nbytes([model.wte.weight, model.head.weight, *model.body.parameters(), model.scale])
    for name in ("step start", "end of forward", "end of backward", "end of optimizer step"):
        assert b[name]["parameters_bytes"] == want, name
    per = b["step start"]["by_module"]["parameters"]
    assert per == {
        "wte": 100 * 32 * 4,
        "body": nbytes(model.body.parameters()),
        "(root)": 32 * 4,
    }, per  # "head" holds only the tied weight, counted under "wte", where it first appears
    assert sum(per.values()) == want
    assert b["end of backward"]["gradients_bytes"] == want  # the tied weight's gradient is one tensor too
    assert b["end of backward"]["by_module"]["gradients"] == per


@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradients_after_backward_and_zero_grad(set_to_none):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = torchmem.Monitor(model, opt, verbose=False)
    want = nbytes(model.parameters())
    for _ in range(2):
        with mon.step():
            model(torch.randn(8, 64)).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
    b = boundaries(mon)
    assert b["end of forward"]["gradients_bytes"] == (0 if set_to_none else want)
    assert b["end of backward"]["gradients_bytes"] == want
    assert b["end of optimizer step"]["gradients_bytes"] == want
    assert b["step start"]["gradients_bytes"] == (0 if set_to_none else want)
    assert sum(b["end of backward"]["by_module"]["gradients"].values()) == want


def _adamw_variants():
    out = [pytest.param({"foreach": False}, id="for-loop"), pytest.param({"foreach": True}, id="foreach")]
    try:
        torch.optim.AdamW([nn.Parameter(torch.ones(2))], fused=True).step()
        out.append(pytest.param({"fused": True}, id="fused"))
    except (RuntimeError, TypeError) as exc:  # a torch without CPU fused AdamW
        out.append(pytest.param({"fused": True}, id="fused", marks=pytest.mark.skip(reason=str(exc))))
    return out


@pytest.mark.parametrize("kw", _adamw_variants())
def test_adamw_state_is_two_fp32_copies_plus_one_step_tensor_per_parameter(kw):
    model = mlp()
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}], lr=1e-3, **kw)
    mon = torchmem.Monitor(model, opt, verbose=False)
    for _ in range(2):
        with mon.step():
            model(torch.randn(8, 64)).sum().backward()
            opt.step()
            opt.zero_grad()
    b = boundaries(mon)
    steps = [opt.state[p]["step"] for p in params]
    assert all(s.numel() == 1 and s.dtype == torch.float32 for s in steps)
    step_bytes = 4 * len(params)  # one float32 scalar tensor per parameter, each its own storage
    want = 2 * nbytes(params) + step_bytes
    assert b["end of optimizer step"]["optimizer_state_bytes"] == want
    assert b["step start"]["optimizer_state_bytes"] == want  # read at the last optimizer step, unchanged
    assert b["end of optimizer step"]["by_param_group"] == [
        2 * nbytes(params[:2]) + 4 * 2,
        2 * nbytes(params[2:]) + 4 * (len(params) - 2),
    ]


@pytest.mark.parametrize("foreach", [False, True])
def test_sgd_momentum_is_one_copy(foreach):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=foreach)
    mon = torchmem.Monitor(model, opt, verbose=False)
    with mon.step():
        model(torch.randn(8, 64)).sum().backward()
        opt.step()
    b = boundaries(mon)
    assert b["end of forward"]["optimizer_state_bytes"] == 0  # no momentum buffers before the first step
    assert b["end of optimizer step"]["optimizer_state_bytes"] == nbytes(model.parameters())


def test_load_state_dict_is_seen_without_a_step():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    saved = opt.state_dict()
    opt2 = torch.optim.AdamW(model.parameters())
    mon = torchmem.Monitor(model, opt2, verbose=False)
    with mon.step():
        pass
    assert boundaries(mon)["step start"]["optimizer_state_bytes"] == 0
    opt2.load_state_dict(saved)
    with mon.step():
        pass
    assert boundaries(mon)["step start"]["optimizer_state_bytes"] == 2 * nbytes(model.parameters()) + 4 * 6


# --- activations ----------------------------------------------------------------------------------------


def one_step(mon, model, x, opt=None, *, keep=None):
    with mon.step():
        out = model(x)
        if keep is not None:
            keep.append(out)
        out.float().sum().backward()
        if opt is not None:
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(mlp, id="mlp"),
        pytest.param(SavesOutputs, id="saves-outputs"),
        pytest.param(lambda: Checkpointed(True), id="checkpoint-reentrant"),
        pytest.param(lambda: Checkpointed(False), id="checkpoint-non-reentrant"),
    ],
)
def test_activations_equal_an_independent_count_of_what_autograd_saved(make):
    torch.manual_seed(0)
    model = make()
    width = 256 if isinstance(model, SavesOutputs) else 64
    mon = torchmem.Monitor(model, verbose=False)
    x = torch.randn(32, width)
    outs = []
    with mon.step():
        out = model(x)
        outs.append(out)
    end_forward = [m for m in mon.markers if m["kind"] == "phase" and m["name"] == "forward"][-1]
    got = cpu_entry(end_forward)["activations_bytes"]
    if isinstance(model, Checkpointed):
        # The checkpointed half saves nothing (reading its saved tensors would recompute it); the other
        # half saves relu's output (b.0's input, same storage) and tanh's output (b.2's input).
        want = 32 * 64 * 4 + 32 * 256 * 4
        if model.reentrant:
            assert graph_saved_bytes(out, keys_of([*model.parameters(), x])) == want
    else:
        want = graph_saved_bytes(out, keys_of([*model.parameters(), x]))
    assert got == want and got > 0, (got, want)
    assert cpu_entry(end_forward)["inputs_bytes"] == x.numel() * 4
    out.sum().backward()


def test_activations_equal_the_programs_own_saved_tensor_hooks_count():
    """The program's own hooks (outside the model's forward) keep working and see every saved tensor; the
    unique storages they saw, minus parameters and the input, are the activations torchmem reports."""
    torch.manual_seed(0)
    model = mlp()
    mon = torchmem.Monitor(model, verbose=False)
    x = torch.randn(16, 64)
    seen: dict = {}

    def pack(t):
        seen[(t.get_device(), t.untyped_storage().data_ptr())] = t.untyped_storage().nbytes()
        return t

    with mon.step():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(x)
        end_forward = [m for m in mon.markers if m["kind"] == "phase" and m["name"] == "forward"][-1]
        out.sum().backward()
    exclude = keys_of([*model.parameters(), x])
    want = sum(n for k, n in seen.items() if k not in exclude)
    assert want > 0 and cpu_entry(end_forward)["activations_bytes"] == want


def test_autocast_bf16_counts_the_casts_as_activations():
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    mon = torchmem.Monitor(model, opt, verbose=False)
    x = torch.randn(16, 64)
    with mon.step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        fwd = cpu_entry([m for m in mon.markers if m["kind"] == "phase" and m["name"] == "forward"][-1])
        want = graph_saved_bytes(out, keys_of([*model.parameters(), x]))
        out.float().sum().backward()
        opt.step()
    assert out.dtype == torch.bfloat16
    assert fwd["activations_bytes"] == want > 0
    assert fwd["parameters_bytes"] == nbytes(model.parameters())  # the fp32 masters; bf16 copies are saved
    assert boundaries(mon)["end of optimizer step"]["optimizer_state_bytes"] == 2 * nbytes(model.parameters()) + 4 * 6


def test_activations_freed_by_backward_and_kept_by_a_leak():
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = torchmem.Monitor(model, opt, verbose=False, breakdown_every=1)  # steps 4 and 5 measured too
    for _ in range(2):
        one_step(mon, model, torch.randn(16, 64), opt)
    b = boundaries(mon)
    assert b["end of forward"]["activations_bytes"] > 0
    assert b["end of backward"]["activations_bytes"] == 0
    assert b["step start"]["activations_bytes"] == 0
    # `total_loss += loss` keeps every step's graph, and its saved tensors, alive.
    total_loss = 0
    per_step = []
    for _ in range(3):
        with mon.step():
            loss = model(torch.randn(16, 64)).sum()
            total_loss = total_loss + loss
            # backward through this step's loss only, keeping the graph, as a leaking loop would
            loss.backward(retain_graph=True)
            opt.step()
            opt.zero_grad()
        per_step.append(boundaries(mon)["end of optimizer step"]["activations_bytes"])
    assert per_step[0] > 0 and per_step[0] < per_step[1] < per_step[2], per_step
    del total_loss, loss
    with mon.step():
        pass
    assert boundaries(mon)["step start"]["activations_bytes"] == 0


def test_activations_by_module_innermost_sorted_and_summing_to_the_total():
    torch.manual_seed(0)
    model = TiedLM()
    mon = torchmem.Monitor(model, verbose=False, activations="modules")
    ids = torch.randint(0, 100, (8, 64))
    with mon.step():
        out = model(ids)
        out.sum().backward()
    fwd = [m for m in mon.markers if m["kind"] == "phase" and m["name"] == "forward"][-1]
    by = fwd["activations_by_module"]
    assert list(by.values()) == sorted(by.values(), reverse=True)
    assert sum(by.values()) == cpu_entry(fwd)["activations_bytes"] > 0
    assert set(by) <= {"wte", "body.0", "body.1", "body.2", "head", "(root)"}, by
    # The GELU saves its input (body.0's output) first; LayerNorm saves its input and statistics.
    assert by["body.1"] == 8 * 64 * 32 * 4
    assert "(root)" in by  # `* self.scale` runs in the root's own forward
    # The default ("total") installs no per-module hooks and sends no by-module key.
    mon.close()
    mon2 = torchmem.Monitor(model, verbose=False)
    with mon2.step():
        model(ids).sum().backward()
    assert all("activations_by_module" not in m for m in mon2.markers)


# --- the hook changes nothing in the program -----------------------------------------------------------


def test_no_reference_cycle_keeps_saved_outputs_alive_with_gc_disabled():
    model = SavesOutputs()
    mon = torchmem.Monitor(model, verbose=False)
    was = gc.isenabled()
    gc.disable()
    try:
        refs = []
        for _ in range(3):
            with mon.step():
                x = torch.randn(64, 256)
                out = model(x)
                refs.append(StorageWeakRef(out.untyped_storage()))  # sigmoid saved its own output
                refs.append(StorageWeakRef(out.grad_fn.next_functions[0][0]._saved_result.untyped_storage()))
                out.sum().backward()
                del out
        assert all(r.expired() for r in refs), "a saved output outlived its graph without the garbage collector"
        assert boundaries(mon)["end of backward"]["activations_bytes"] == 0
    finally:
        if was:
            gc.enable()


@pytest.mark.parametrize("make", [mlp, SavesOutputs, TiedLM, lambda: Checkpointed(True), lambda: Checkpointed(False)])
def test_same_gradients_with_and_without_the_monitor(make):
    def run(monitored: bool):
        torch.manual_seed(1)
        model = make()
        x = torch.randint(0, 100, (4, 16)) if isinstance(model, TiedLM) else torch.randn(8, model_width(model))
        mon = torchmem.Monitor(model, verbose=False, activations="modules") if monitored else None
        if mon is not None:
            with mon.step():
                model(x).sum().backward()
            mon.close()
        else:
            model(x).sum().backward()
        return [None if p.grad is None else p.grad.clone() for p in model.parameters()]

    for a, b in zip(run(False), run(True), strict=False):
        assert (a is None and b is None) or torch.equal(a, b)


def model_width(model) -> int:
    return 256 if isinstance(model, SavesOutputs) else 64


def test_in_place_after_save_still_raises():
    model = InplaceAfterSave()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(torch.randn(2, 8)).sum().backward()  # PyTorch's own check, no torchmem
    mon = torchmem.Monitor(model, verbose=False)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        with mon.step():
            model(torch.randn(2, 8)).sum().backward()
    # The next step runs normally after the error.
    mon.close()


def test_programs_save_on_cpu_outside_and_inside_the_forward_keep_working():
    calls = []

    class InnerOffload(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)

        def forward(self, x):
            with torch.autograd.graph.save_on_cpu():
                h = torch.tanh(self.a(x))
            return self.b(h)

    for make in (mlp, InnerOffload):
        torch.manual_seed(2)
        model = make()
        width = 64 if make is mlp else 32
        x = torch.randn(8, width)
        torch.manual_seed(2)
        ref_grads = None
        plain = make()
        plain(x).sum().backward()
        ref_grads = [p.grad for p in plain.parameters()]
        mon = torchmem.Monitor(model, verbose=False)

        def pack(t):
            calls.append(t.shape)
            return ("mine", t)

        def unpack(packed):
            assert packed[0] == "mine"
            return packed[1]

        with mon.step():
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                out = model(x)
            out.sum().backward()
        for a, b in zip(ref_grads, [p.grad for p in model.parameters()], strict=False):
            assert torch.equal(a, b)
        assert calls, "the program's own pack hook was not called under torchmem's"
        calls.clear()
        mon.close()


def test_nothing_installed_under_no_grad_or_inference_mode():
    seen = []

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            seen.append(torch._C._autograd._top_saved_tensors_default_hooks(False))
            return self.lin(x)

    model = Probe()
    mon = torchmem.Monitor(model, verbose=False)
    with torch.no_grad():
        model(torch.randn(2, 4))
    with torch.inference_mode():
        model(torch.randn(2, 4))
    assert seen == [None, None]
    model(torch.randn(2, 4)).sum().backward()
    assert seen[-1] is not None  # with grad on, torchmem's hooks are there during forward
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None  # and gone after it
    fwd = [m for m in mon.markers if m["kind"] == "phase" and m["name"] == "forward" and m["edge"] == "end"]
    assert cpu_entry(fwd[0])["activations_bytes"] == 0 and cpu_entry(fwd[0])["inputs_bytes"] == 2 * 4 * 4


def test_a_forward_that_raises_leaves_no_hooks_behind():
    class Fails(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, fail=False):
            h = torch.exp(self.lin(x))
            if fail:
                raise ValueError("boom")
            return h

    model = Fails()
    mon = torchmem.Monitor(model, verbose=False)
    with pytest.raises(ValueError, match="boom"):
        model(torch.randn(2, 4), fail=True)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    with mon.step():
        model(torch.randn(2, 4)).sum().backward()
    names = [(m["name"], m["edge"]) for m in mon.markers if m["kind"] == "phase"]
    assert names[:2] == [("forward", "start"), ("forward", "end")]  # the failed forward ended too
    assert names[-4:] == [("forward", "start"), ("forward", "end"), ("backward", "start"), ("backward", "end")]


def test_compiled_model_has_no_activation_tracking():
    model = mlp()
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = torchmem.Monitor(compiled, opt, verbose=False)
    with mon.step():
        compiled(torch.randn(4, 64)).sum().backward()
        opt.step()
    d = mon.breakdown()
    assert d["activations_tracked"] is False
    for b in d["boundaries"]:
        assert cpu_entry(b)["activations_bytes"] is None
        assert cpu_entry(b)["parameters_bytes"] == nbytes(model.parameters())


def test_breakdown_off_and_bad_activations_argument():
    model = mlp()
    mon = torchmem.Monitor(model, verbose=False, breakdown=False)
    one_step(mon, model, torch.randn(2, 64))
    assert all("breakdown" not in m for m in mon.markers) and mon.breakdown() is None
    assert torchmem.Monitor(verbose=False).breakdown() is None  # no model: off by default
    with pytest.raises(ValueError, match="activations='layers'.*'total'.*'modules'.*None"):
        torchmem.Monitor(model, verbose=False, activations="layers")
    mon = torchmem.Monitor(model, verbose=False, activations=None)
    one_step(mon, model, torch.randn(2, 64))
    assert all(cpu_entry(b)["activations_bytes"] is None for b in mon.breakdown()["boundaries"])


@pytest.mark.parametrize("every", [None, 1, 4])
def test_measured_steps_are_the_first_three_then_one_in_breakdown_every(every):
    """Steps 1-3, then every `breakdown_every`-th (10 by default) carry the breakdown at all 4 boundaries and
    have the saved-tensors hook on their forward; the other steps carry none and install no hook (what they
    would have cost). Optimizer state that appears on a step not measured shows at the next measured one."""
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)  # no state until momentum is turned on below
    kw = {} if every is None else {"breakdown_every": every}
    mon = torchmem.Monitor(model, opt, verbose=False, keep_markers=None, **kw)
    hooked: list[bool] = []
    model.register_forward_pre_hook(
        lambda m, a: hooked.append(torch._C._autograd._top_saved_tensors_default_hooks(False) is not None)
    )
    for step in range(1, 23):
        if step == 5:
            opt.param_groups[0]["momentum"] = 0.9  # momentum buffers appear at step 5's optimizer step
        one_step(mon, model, torch.randn(4, 64), opt)
    n = every or 10
    want = [s for s in range(1, 23) if s <= 3 or s % n == 0]
    starts = [m for m in mon.markers if m["kind"] == "step" and m["edge"] == "start"]
    measured = [i + 1 for i, m in enumerate(starts) if "breakdown" in m]
    assert measured == want
    with_bd = [m for m in mon.markers if "breakdown" in m]
    assert len(with_bd) == 4 * len(want)  # each measured step: its 4 boundaries, no other marker
    assert [i + 1 for i, h in enumerate(hooked) if h] == want  # the hook only on measured steps' forwards
    assert mon.breakdown()["step"] == want[-1] - 1  # the last measured step (indices count from 0)
    first_after = min(s for s in want if s > 5)
    opt_bytes = [cpu_entry(m)["optimizer_state_bytes"] for m in with_bd if m["name"] == "optimizer step"]
    assert opt_bytes[want.index(first_after)] == nbytes(model.parameters())  # SGD momentum: 1 copy
    assert all(b == 0 for b in opt_bytes[: want.index(first_after)] if want[opt_bytes.index(b)] < 5)
    mon.close()


def test_bad_breakdown_every_names_the_value_and_what_is_expected():
    for bad in (0, -1, 2.5, True, "10"):
        with pytest.raises(ValueError, match=r"breakdown_every=.*whole number of steps >= 1"):
            torchmem.Monitor(mlp(), verbose=False, breakdown_every=bad)


def test_peak_composition_names_the_phase_of_the_peak():
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    mon = torchmem.Monitor(model, opt, verbose=False)
    one_step(mon, model, torch.randn(64, 64), opt)
    peak = mon.breakdown()["peak"]
    assert peak["phase"] in ("forward", "backward", "optimizer step", None)
    # The boundary nearest where a peak in that phase happens (forward's end, backward's start, the optimizer
    # step's end once its state exists).
    read_at = {"forward": "end of forward", "backward": "end of forward", "optimizer step": "end of optimizer step"}
    assert peak["boundary"] == read_at.get(peak["phase"], "step start")
    (cpu,) = peak["devices"]
    b = boundaries(mon)[peak["boundary"]]
    assert all(cpu[k] == b[k] for k in CATEGORIES)
    assert cpu["other_bytes"] is None and cpu["cache_bytes"] is None and cpu["peak_rss_bytes"] > 0
    # to_dict(): the Rust analysis's breakdown over the run when the extension has it (with the last step
    # under "last_step"), else the last step's as breakdown() gives it.
    d = mon.to_dict()["breakdown"]
    if "recorded" in d:  # the extension's analysis has the breakdown: summary() renders its tables
        assert d["recorded"] is True and d["last_step"] == mon.breakdown()
        text = mon.summary()
        assert all(b in text for b in ("step start", "end of forward", "end of backward", "end of optimizer step"))
    else:
        assert d == mon.breakdown()


# --- the recorder and torchmem.watch ---------------------------------------------------------------------


def test_watch_records_phases_and_breakdown_without_loop_markers():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    w = torchmem.watch(model, opt)
    for _ in range(2):
        model(torch.randn(8, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
    kinds = {m["kind"] for m in w.markers}
    assert "step" not in kinds and "epoch" not in kinds
    ends = [m for m in w.markers if m["kind"] == "phase" and m["edge"] == "end"]
    assert [m["name"] for m in ends] == ["forward", "backward", "optimizer step"] * 2
    assert cpu_entry(ends[-1])["optimizer_state_bytes"] == 2 * nbytes(model.parameters()) + 4 * 6
    assert cpu_entry(ends[0])["activations_bytes"] > 0
    w.close()


def test_parameter_changes_show_up_without_walking_every_boundary():
    """Storages are re-read when a data pointer moves (`p.data = ...`); the parameter list is walked again
    when the optimizer's parameter count changes (`add_param_group`) and every REWALK_STEPS steps."""
    from torchmem import _breakdown

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = torchmem.Monitor(model, opt, verbose=False, breakdown_every=1)
    for _ in range(3):
        one_step(mon, model, torch.randn(2, 64), opt)
    base = nbytes(model.parameters())
    assert boundaries(mon)["step start"]["parameters_bytes"] == base
    model[0].bias.data = torch.zeros(128 * 4)  # a bigger storage under the same Parameter
    with mon.step():
        pass
    assert boundaries(mon)["step start"]["parameters_bytes"] == base + 128 * 3 * 4
    extra = nn.Linear(64, 64)
    model.add_module("extra", extra)  # not in the optimizer: seen at the next walk
    opt.add_param_group({"params": list(extra.parameters())})  # the count changed: walked at once
    with mon.step():
        pass
    b = boundaries(mon)["step start"]
    assert b["parameters_bytes"] == base + 128 * 3 * 4 + nbytes(extra.parameters())
    assert b["by_module"]["parameters"]["extra"] == nbytes(extra.parameters())
    late = nn.Linear(8, 8)
    model.add_module("late", late)  # neither in the optimizer: found by the periodic walk
    steps = 0
    while boundaries(mon)["step start"]["by_module"]["parameters"].get("late") is None:
        with mon.step():
            pass
        steps += 1
        assert steps <= _breakdown.REWALK_STEPS
    assert boundaries(mon)["step start"]["by_module"]["parameters"]["late"] == nbytes(late.parameters())
