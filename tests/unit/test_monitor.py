"""Tests of `torchmem.Monitor` with real torch training loops on the CPU: phases found by hooks, epochs and
steps, exact per-phase peaks, the growth warning, the journey, and markers sent to the recorder's pipe."""

from __future__ import annotations

import json
import mmap
import warnings

import pytest
import torch
import torchmem
from torch import nn
from torchmem.monitor import MemoryGrowthWarning

MIB = 1 << 20


class TupleOut(nn.Module):
    """Returns (logits, hidden): the backward hook must find a tensor inside a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 10)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.b(h), h


class DictOut(nn.Module):
    """Returns a dict, as Hugging Face models do."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

    def forward(self, x):
        return {"logits": self.net(x)}


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 8 * 8, 10)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x.view(-1, 1, 8, 8))).flatten(1))


def logits_of(out):
    if isinstance(out, tuple):
        return out[0]
    if isinstance(out, dict):
        return out["logits"]
    return out


MODELS = {
    "mlp": lambda: nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)),
    "tuple": TupleOut,
    "dict": DictOut,
    "cnn": SmallCNN,
}


def train(mon, model, opt, epochs=2, steps=3, leak=None):
    loss_fn = nn.CrossEntropyLoss()
    for _ in range(epochs):
        with mon.epoch():
            for _ in range(steps):
                with mon.step():
                    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
                    loss = loss_fn(logits_of(model(x)), y)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    if leak is not None:
                        leak.append(loss)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_hooks_record_forward_backward_optimizer_in_order(kind):
    torch.manual_seed(0)
    model = MODELS[kind]()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = torchmem.Monitor(model, opt, verbose=False)
    train(mon, model, opt, epochs=2, steps=3)
    mon.close()
    phases = [(m["name"], m["edge"]) for m in mon.markers if m["kind"] == "phase"]
    one_step = [
        ("forward", "start"),
        ("forward", "end"),
        ("backward", "start"),
        ("backward", "end"),
        ("optimizer step", "start"),
        ("optimizer step", "end"),
    ]
    assert phases == one_step * 6, phases
    data = mon.to_dict()
    assert [p["name"] for p in data["phases"]] == ["forward", "backward", "optimizer step"]
    assert all(p["count"] == 6 for p in data["phases"])
    assert len(data["epochs"]) == 2 and data["steps"] == 6
    json.dumps(data)
    # Every phase nests inside its step, every step inside its epoch.
    kinds = [m["kind"] for m in mon.markers if m["kind"] in ("epoch", "step")]
    assert kinds[:2] == ["epoch", "step"] and kinds[-2:] == ["step", "epoch"]


def test_long_runs_keep_first_markers_and_exact_aggregates():
    """A Monitor over many steps keeps the markers of the first `keep_markers` occurrences only, and its
    summary (phase rows, step count, journey peak) equals the one computed from every marker."""
    torch.manual_seed(0)
    model = MODELS["mlp"]()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    full = torchmem.Monitor(model, opt, verbose=False, warn=False, keep_markers=None)
    few = torchmem.Monitor(verbose=False, warn=False, keep_markers=2)  # sees the same markers (no own hooks)
    train(full, model, opt, epochs=2, steps=12)
    with full.step():  # asked in the middle of a step: the open step counts in both
        model(torch.randn(4, 64)).sum()
        mid_full, mid_few = full.to_dict(), few.to_dict()
    assert mid_few["steps"] == mid_full["steps"] == 25
    assert mid_few["phases"] == mid_full["phases"]
    assert [j for j in mid_few["journey"] if j["name"] == "Peak"] == [
        j for j in mid_full["journey"] if j["name"] == "Peak"
    ]
    full.close()
    few.close()
    phase_markers = [m for m in few.markers if m["kind"] == "phase"]
    assert len(phase_markers) == 3 * 2 * 2, "2 occurrences of forward, backward and optimizer step, start+end"
    assert len([m for m in few.markers if m["kind"] == "step"]) == 2 * 2
    assert len([m for m in few.markers if m["kind"] == "epoch"]) == 4, "epochs are always kept"
    assert len(full.markers) > 4 * len(few.markers)
    a, b = full.to_dict(), few.to_dict()
    assert b["steps"] == a["steps"] == 25
    assert b["phases"] == a["phases"], (a["phases"], b["phases"])
    assert [p["count"] for p in b["phases"]] == [25, 24, 24], "the last step ran forward only"
    assert b["epochs"] == a["epochs"]
    assert [e["steps"] for e in b["epochs"]] == [12, 12], "steps per epoch count the folded ones too"
    peak = lambda d: [s for s in d["journey"] if s["name"] == "Peak"]  # noqa: E731
    assert peak(a) == peak(b)

    # The phase, epoch and per-boundary Breakdown tables are exact over every step (the boundaries of steps not
    # kept are folded); the composition at the peak reads the kept steps (it says so), so it is left out here.
    def exact_part(text: str) -> str:
        head, _, rest = text.partition("Breakdown\n")
        table = rest.split("\n\n", 1)[0]
        return head + "\n".join(ln for ln in table.splitlines() if "were folded into exact aggregates" not in ln)

    assert "Breakdown\n" in full.summary()
    assert exact_part(few.summary()) == exact_part(full.summary())


def test_closed_monitor_records_nothing_more():
    model = MODELS["mlp"]()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = torchmem.Monitor(model, opt, verbose=False)
    mon.close()
    n = len(mon.markers)
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    assert len(mon.markers) == n


def test_eval_forward_under_no_grad_has_no_backward():
    model = MODELS["mlp"]()
    mon = torchmem.Monitor(model, verbose=False)
    with torch.no_grad():
        model(torch.randn(4, 64))
    names = [m["name"] for m in mon.markers if m["kind"] == "phase"]
    assert names == ["forward", "forward"]


class Spiky(nn.Module):
    """Its forward makes and frees a 96 MiB temporary: only an exact peak window sees it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        # 96 MiB of fresh anonymous pages (never reused from glibc's heap), freed before forward returns.
        tmp = mmap.mmap(-1, 96 * MIB)
        for offset in range(0, 96 * MIB, 4096):
            tmp[offset] = 1
        tmp.close()
        return self.fc(x)


def test_phase_peak_catches_a_temporary_freed_inside_forward():
    model = Spiky()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = torchmem.Monitor(model, opt, verbose=False)
    train(mon, model, opt, epochs=1, steps=2)
    ends = [m for m in mon.markers if m["kind"] == "phase" and m["edge"] == "end"]
    fwd = [m for m in ends if m["name"] == "forward"]
    starts = [m for m in mon.markers if m["kind"] == "phase" and m["edge"] == "start" and m["name"] == "forward"]
    for s, e in zip(starts, fwd, strict=False):
        assert e["memory"]["peak_rss_bytes"] >= s["memory"]["rss_bytes"] + 90 * MIB, (s, e)
        assert e["memory"]["rss_bytes"] < s["memory"]["rss_bytes"] + 48 * MIB
    opt_end = [m for m in ends if m["name"] == "optimizer step"]
    assert all(m["memory"]["peak_rss_bytes"] < fwd[0]["memory"]["peak_rss_bytes"] - 48 * MIB for m in opt_end)
    row = next(p for p in mon.to_dict()["phases"] if p["name"] == "forward")
    assert row["max_peak_rss_bytes"] >= fwd[0]["memory"]["peak_rss_bytes"]
    mon.close()


class Leaky(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 4096)
        self.fc2 = nn.Linear(4096, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


@pytest.mark.parametrize("leak", [True, False])
def test_growth_warning_only_when_memory_grows_every_epoch(leak, capsys):
    torch.manual_seed(0)
    model = Leaky()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = torchmem.Monitor(model, opt)
    loss_fn = nn.CrossEntropyLoss()
    kept = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            with mon.epoch():
                for _ in range(4):
                    with mon.step():
                        x, y = torch.randn(256, 64), torch.randint(0, 10, (256,))
                        loss = loss_fn(model(x), y)
                        loss.backward()
                        opt.step()
                        opt.zero_grad()
                        if leak:
                            # `total_loss += loss` on a loss with its graph alive: ~8 MiB per step kept.
                            kept.append(loss_fn(model(x), y))
    growth = [w for w in caught if issubclass(w.category, MemoryGrowthWarning)]
    err = capsys.readouterr().err
    assert err.count("torchmem: epoch ") == 4, err
    if leak:
        assert len(growth) == 1, [str(w.message) for w in caught]
        msg = str(growth[0].message)
        assert "per epoch" in msg and "CPU RSS" in msg, msg
        assert "WARNING" in mon.summary()
        assert mon.to_dict()["growth"][0]["per_unit_bytes"] >= 8 * MIB
    else:
        assert growth == [], [str(w.message) for w in growth]
        assert "WARNING" not in mon.summary()
    mon.close()


def test_summary_and_journey_text_and_mermaid():
    torchmem.device_info()
    model = MODELS["mlp"]()
    opt = torch.optim.Adam(model.parameters())
    mon = torchmem.Monitor(model, opt, verbose=False)
    train(mon, model, opt, epochs=2, steps=2)
    torchmem.empty_cache()
    text = mon.summary()
    for word in ("forward", "backward", "optimizer step", "RSS"):
        assert word in text, text
    journey = mon.journey()
    order = ["Device checked", "Model initialised", "forward", "backward", "optimizer step", "Peak", "Cache emptied"]
    positions = [journey.index(name) for name in order]
    assert positions == sorted(positions), journey
    mermaid = mon.journey(format="mermaid")
    lines = mermaid.splitlines()
    assert lines[0] == "journey" and lines[1].startswith("    title ")
    tasks = [line for line in lines if line.startswith("      ")]
    assert len(tasks) == len(order)
    assert all(line.count(":") == 2 and line.split(":")[1].strip() in "12345" for line in tasks), tasks
    with pytest.raises(ValueError, match="mermaid"):
        mon.journey(format="svg")
    mon.close()


def test_monitor_without_model_marks_epochs_and_steps():
    mon = torchmem.Monitor(verbose=False)
    with mon.epoch():
        with mon.step():
            x = bytearray(8 * MIB)
    with mon.epoch(index=7):
        pass
    data = mon.to_dict()
    assert [e["index"] for e in data["epochs"]] == [0, 7]
    assert data["phases"] == [] and data["steps"] == 1
    assert data["epochs"][0]["peak_rss_bytes"] >= data["epochs"][0]["rss_bytes"]
    del x


def test_repr_and_in_process_dict_say_only_what_was_measured():
    """Finding #27: a readable repr; "1 step", not "1 steps"; `to_dict()` in-process carries no report-only
    run/sample fields (command, exit code, sample counts, sample peaks, processes) reading as zeros."""
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = torchmem.Monitor(model, opt, verbose=False)
    assert repr(mon) == "<torchmem.Monitor CPU, model and optimizer: 0 epochs, 0 steps, 2 markers kept>"
    with mon.epoch():
        with mon.step():
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
    assert repr(mon).startswith("<torchmem.Monitor CPU, model and optimizer: 1 epoch, 1 step, ")
    assert "\n1 step\n" in mon.summary() and "1 steps" not in mon.summary()
    data = mon.to_dict()
    for key in ("command", "exit_code", "duration_ns", "samples", "torch_samples", "gpu_samples", "peak", "processes"):
        assert key not in data, key
    assert data["steps"] == 1 and len(data["epochs"]) == 1 and data["phases"] and data["journey"]
    assert repr(torchmem.Monitor(verbose=False)).startswith("<torchmem.Monitor CPU, no hooks: 0 epochs")


@pytest.mark.parametrize("extra", [{"origin": {}}, {"device": None}])
def test_marker_log_reads_plain_markers_as_serde_does(extra):
    """The log's fast path (a dict of the six plain keys) and serde (any other dict) give the same records."""
    from torchmem import _native

    plain, full = _native.MarkerLog(2), _native.MarkerLog(2)
    for i in range(5):
        for edge, t, mem in (
            ("start", 10 * i, {"rss_bytes": 100, "allocated_bytes": 5}),
            (
                "end",
                10 * i + 4,
                {
                    "rss_bytes": 130 + i,
                    "allocated_bytes": 7,
                    "reserved_bytes": None,
                    "peak_allocated_bytes": 9 + i,
                },
            ),
        ):
            m = {"t_ns": t, "kind": "phase", "edge": edge, "name": "forward", "index": None, "memory": mem}
            plain.push(m)
            full.push({**m, **extra})
    assert plain.summary() == full.summary()
    assert plain.summary()["phases"][0]["max_peak_allocated_bytes"] == 13
    with pytest.raises(torchmem.InputError, match="model::Marker"):
        plain.push({"t_ns": -1, "kind": "phase", "edge": "start", "name": "x", "index": None, "memory": {}})


def test_a_marker_the_log_cannot_read_warns_once_and_never_breaks_the_loop():
    mon = torchmem.Monitor(verbose=False, warn=False)
    bad = {"t_ns": -5, "kind": "phase", "edge": "start", "name": "x", "index": None, "memory": {}}
    with pytest.warns(RuntimeWarning, match="could not be recorded") as seen:
        mon._take(bad)
        mon._take(bad)
    assert len([w for w in seen if "could not be recorded" in str(w.message)]) == 1
    with mon.step():
        pass
    assert mon.to_dict()["steps"] == 1
    mon.close()
