"""The Monitor's breakdown through a real child process (moved from tests/unit/test_breakdown.py, issue 27 item 5):
boundary markers on the recorder's real pipe, `torchmem run` finding the model and optimizer by itself, and the
automatic watch (standing down for the program's own Monitor, and the breakdown of a program that never mentions
torchmem)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torchmem
from children import run_with_recorder_pipe

MIB = 1 << 20
CUDA = torch.cuda.is_available()


def test_boundary_markers_carry_the_breakdown_to_the_recorder():
    proc, lines = run_with_recorder_pipe(
        """
        import torch, torchmem
        from torch import nn
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        opt = torch.optim.AdamW(model.parameters())
        mon = torchmem.Monitor(model, opt, verbose=False, activations="modules")
        with mon.step():
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
        """
    )
    assert proc.returncode == 0, proc.stderr
    markers = [m for m in lines if m["type"] == "marker"]
    with_bd = [(m["kind"], m["edge"], m["name"]) for m in markers if "breakdown" in m]
    assert with_bd == [
        ("step", "start", "step"),
        ("phase", "end", "forward"),
        ("phase", "end", "backward"),
        ("phase", "end", "optimizer step"),
    ]
    params = (8 * 16 + 16 + 16 * 2 + 2) * 4
    for m in markers:
        if "breakdown" in m:
            (cpu,) = m["breakdown"]
            assert cpu["device"] == "cpu" and cpu["parameters_bytes"] == params and cpu["rss_bytes"] > 0
            assert cpu["allocated_bytes"] is None and cpu["other_bytes"] is None  # CPU: not measured
            assert "memory" in m and m["t_ns"] > 0
    fwd = [m for m in markers if m["name"] == "forward" and m["edge"] == "end"][0]
    assert fwd["activations_by_module"] == {"1": 4 * 16 * 4}
    assert [m for m in markers if m["name"] == "optimizer step" and m["edge"] == "end"][0]["breakdown"][0][
        "optimizer_state_bytes"
    ] == 2 * params + 4 * 4


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_torchmem_run_finds_the_model_and_optimizer_by_itself(tmp_path):
    """Under `torchmem run`, a program that never mentions torchmem gets the breakdown: the optimizer is
    learnt when it is built, the model at its first forward. Same exit code, same output, no warning."""
    prog = tmp_path / "train.py"
    prog.write_text(
        textwrap.dedent(
            """
            import sys, warnings
            warnings.simplefilter("error")
            import torch
            from torch import nn
            model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
            opt = torch.optim.AdamW(model.parameters())
            for _ in range(3):
                model(torch.randn(4, 8)).sum().backward()
                opt.step()
                opt.zero_grad()
            print("trained", sum(p.numel() for p in model.parameters()))
            sys.exit(3)
            """
        )
    )
    plain = subprocess.run([sys.executable, str(prog)], capture_output=True, text=True, timeout=120)
    assert plain.returncode == 3 and plain.stdout == "trained 178\n"
    prof = tmp_path / "run.tmem"
    run = subprocess.run(
        [
            os.path.join(os.path.dirname(sys.executable), "torchmem"),
            "run",
            "-q",
            "-o",
            str(prof),
            "--",
            sys.executable,
            str(prog),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 3, run.stderr
    assert run.stdout == plain.stdout
    assert "Warning" not in run.stderr and "torchmem: " not in run.stderr.replace("torchmem: profile", ""), run.stderr
    data = torchmem.load_profile(prof)
    markers = [m for m in data.markers if m.get("name") in ("forward", "backward", "optimizer step")]
    assert len(markers) == 18, [(m["name"], m["edge"]) for m in markers]
    _ = json  # (the profile's marker breakdowns are the Rust side's to store)


@pytest.mark.parametrize("order", ["monitor first", "forward first"])
def test_auto_watch_stands_down_for_the_programs_own_monitor(order):
    """Under `torchmem run` a program with a Monitor of its own gets each phase once: the automatic watch stands
    down when the program's Monitor is made, whether before the first forward or after the watch began."""
    early = "mon = torchmem.Monitor(model, opt, verbose=False)" if order == "monitor first" else ""
    late = "" if order == "monitor first" else "mon = torchmem.Monitor(model, opt, verbose=False)"
    proc, lines = run_with_recorder_pipe(
        f"""
        import torchmem._bootstrap as b; b.start()
        import torch, torchmem
        from torch import nn
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        {early}
        model(torch.randn(4, 8)).sum().backward()  # before the program's own loop: the watch may take it
        opt.step()
        opt.zero_grad()
        {late}
        for i in range(3):
            with mon.step():
                model(torch.randn(4, 8)).sum().backward()
                opt.step()
                opt.zero_grad()
        """
    )
    assert proc.returncode == 0, proc.stderr
    ends = [m["t_ns"] for m in lines if m["type"] == "marker" and m["name"] == "forward" and m["edge"] == "end"]
    assert len(ends) == 4, ends  # the first forward once (by whichever watched it), then three steps, once each


def test_auto_watch_sends_the_breakdown_of_a_program_that_never_mentions_torchmem():
    """What `torchmem run`'s sitecustomize does (`_bootstrap.start()`), on a real pipe: the optimizer built
    before the first forward, a loss module called outside the model, several steps."""
    proc, lines = run_with_recorder_pipe(
        """
        import torchmem._bootstrap as b; b.start()
        import sys
        import torch
        from torch import nn
        assert not any(type(f).__name__ == "_TorchImportFinder" for f in sys.meta_path)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        loss_fn = nn.MSELoss()
        for _ in range(2):
            loss_fn(model(torch.randn(4, 8)), torch.zeros(4, 2)).backward()
            opt.step()
            opt.zero_grad()
        print(torch.optim.Optimizer.__init__.__name__)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "" and proc.stdout == "__init__\n"
    with_bd = [m for m in lines if m["type"] == "marker" and "breakdown" in m]
    names = [(m["name"], m["edge"]) for m in with_bd]
    assert names == [("forward", "start"), ("forward", "end"), ("backward", "end"), ("optimizer step", "end")] * 2
    params = (8 * 16 + 16 + 16 * 2 + 2) * 4
    last = with_bd[-1]["breakdown"][0]
    assert last["parameters_bytes"] == params and last["optimizer_state_bytes"] == params
    assert with_bd[1]["breakdown"][0]["activations_bytes"] == 4 * 16 * 4  # ReLU's output
