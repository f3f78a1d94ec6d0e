"""What the breakdown's labels say, on real torch on the CPU: a category that was not measured is None/"-",
never 0 (a Monitor given no optimizer); "at the peak (step N, phase)" names the step the peak really was in
and the step and boundary its categories were measured at, when the peak's step was not a measured one
(`breakdown_every`); and the wrong-argument errors of `Monitor`, `watch` and `track` name the expected types
and the fix."""

from __future__ import annotations

import time

import pytest
import torch
import torchmem

MIB = 1 << 20


def boundary_rows(mon: torchmem.Monitor) -> dict[str, dict]:
    return {r["boundary"]: r["categories"] for r in mon.to_dict()["breakdown"]["boundaries"]}


def test_a_monitor_without_an_optimizer_does_not_measure_its_state_as_zero():
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(model.parameters())  # exists, but the Monitor was not given it
    with torchmem.Monitor(model, verbose=False) as mon:
        for _ in range(2):
            with mon.step():
                model(torch.randn(8, 64)).sum().backward()
                opt.step()
                opt.zero_grad()
    entries = [e for b in mon.breakdown()["boundaries"] for e in b["breakdown"]]
    assert entries and all(e["optimizer_state_bytes"] is None and e["by_param_group"] == [] for e in entries)
    assert all(e["parameters_bytes"] == (64 * 64 + 64) * 4 for e in entries)  # measured: real numbers
    rows = boundary_rows(mon)
    assert all("optimizer_state" not in c and "parameters" in c for c in rows.values())
    peak = mon.to_dict()["breakdown"]["peak"]
    assert "optimizer_state" not in {r["category"] for r in peak["rows"]}
    text = mon.summary()
    assert "optimizer state" not in text, text  # no column of zeros, no 0 B row


def test_the_peak_in_a_step_not_measured_names_its_step_and_the_step_measured():
    """14 steps, measured: 0, 1, 2 and 9 (`breakdown_every=10`). Step 12's forward allocates 256 MiB more than
    any other phase: the peak is step 12's forward. Its categories come from step 9's end of forward (the
    nearest measured step, with the forward's activations), and the text and the JSON say so. The old code
    named "step 9" and the end of its optimizer step ("the boundary that opens the forward phase")."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 512))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step_now = {"i": -1}

    def scratch(module, args, output):
        if step_now["i"] == 12:
            x = torch.ones(64 * MIB)  # 256 MiB, touched, only inside step 12's forward
            time.sleep(0.05)
            del x

    model.register_forward_hook(scratch)
    with torchmem.Monitor(model, opt, verbose=False) as mon:
        for i in range(14):
            step_now["i"] = i
            with mon.step():
                model(torch.randn(64, 512)).square().mean().backward()
                opt.step()
                opt.zero_grad()
    peak = mon.to_dict()["breakdown"]["peak"]
    assert (peak["step"], peak["phase"]) == (12, "forward"), peak
    assert (peak["boundary"], peak["boundary_step"], peak["boundary_source"]) == (
        "end of forward",
        9,
        "nearest measured step",
    )
    timeline = mon.to_dict()["breakdown"]["timeline"]
    (at,) = [p for p in timeline if p["step"] == 9 and p["boundary"] == "end of forward"]
    assert peak["boundary_t_ns"] == at["t_ns"]
    rows = {r["category"]: r["bytes"] for r in peak["rows"]}
    # The forward's saved tensors (ReLU's output, which the second Linear saves too: 512 KiB), not the 0 B of
    # a step start.
    assert rows["activations"] == at["categories"]["activations"] == 64 * 2048 * 4
    assert peak["peak_rss_bytes"] - rows["parameters"] >= 200 * MIB
    text = mon.summary()
    assert "at the peak (step 12, forward, cpu)" in text, text
    assert "measured at step 9's end of forward, the nearest measured step (step 12 was not measured" in text


# --- wrong arguments ---------------------------------------------------------------------------------------


def test_monitor_with_the_arguments_swapped_says_swap_them():
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError) as e:
        torchmem.Monitor(opt, model)
    assert str(e.value) == (
        "Monitor(model, optimizer): got an SGD optimizer as model and a Linear module as optimizer; swap the arguments"
    )
    with pytest.raises(TypeError, match=r"got an SGD optimizer as model; pass the model first: Monitor\(model, opt"):
        torchmem.Monitor(opt)
    with pytest.raises(TypeError, match=r"^watch\(model, optimizer\): got an SGD optimizer as model and a Linear"):
        torchmem.watch(opt, model)


def test_monitor_with_other_objects_names_the_expected_types():
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module \(or None\), got an object$"):
        torchmem.Monitor(object(), object())
    model = torch.nn.Linear(4, 4)
    with pytest.raises(TypeError, match=r"optimizer must be a torch\.optim\.Optimizer \(or None\), got a str$"):
        torchmem.Monitor(model, "adam")
    with pytest.raises(TypeError, match=r"got a type \(pass an instance: torch\.optim\.SGD\(model\.parameters"):
        torchmem.Monitor(model, torch.optim.SGD)
    with pytest.raises(TypeError, match=r"optimizer must be a torch\.optim\.Optimizer .*got a Linear module"):
        torchmem.Monitor(model, torch.nn.Linear(2, 2))


def test_track_without_a_name_says_what_it_needs(recwarn):
    with pytest.raises(TypeError, match=r"name must be a non-empty str naming the phase .* got NoneType None"):
        torchmem.track(None)
    with pytest.raises(TypeError, match=r"got the function 'load' instead of a name; decorate with @torchmem"):

        @torchmem.track
        def load():
            pass

    with pytest.raises(TypeError, match="got str ''"):
        torchmem.track("")
    assert not [w for w in recwarn if "Marker" in str(w.message)]
