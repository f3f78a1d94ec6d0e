"""`torchmem estimate` end to end on this CPU-only machine: backward on the emulated CUDA device, the trace
against the one recorded on an H200 request by request, the CLI on unchanged training scripts (MLP, GPT-2
tiny), the Python API, what no estimate can follow, the GPU catalogue and `--fit`."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "estimator-h200"

torch = pytest.importorskip("torch")

if torch.cuda.is_available():  # pragma: no cover - these tests are about machines without a GPU
    pytest.skip("the estimator tests run on a machine without a GPU", allow_module_level=True)

from estimates import _requests, _torchmem, _trace_workload  # noqa: E402


def test_backward_fails_on_plain_fake_cuda_and_runs_under_the_estimator():
    # The blocker, measured: a plain FakeTensorMode backward on cuda fails without a GPU (fresh process, so no
    # fix of ours is installed) ...
    code = textwrap.dedent(
        """
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode
        with FakeTensorMode():
            w = torch.ones(4, device="cuda", requires_grad=True)
            try:
                (w * 2).sum().backward()
                print("BACKWARD-OK")
            except RuntimeError as e:
                print("BACKWARD-FAILED", str(e)[:80])
        """
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "BACKWARD-FAILED" in p.stdout and "hasPrimaryContext" in p.stdout, p.stdout + p.stderr
    # ... and runs in the estimator's session, with CUDA gradients of the right shape and autocast on CUDA.
    from torchmem.estimator import gpu_spec
    from torchmem.estimator._session import Session

    with Session(gpu_spec("H200")):
        lin = torch.nn.Linear(64, 32).to("cuda")
        x = torch.randn(8, 64, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = lin(x)
        assert y.dtype == torch.bfloat16
        y.float().sum().backward()
        assert lin.weight.grad.device.type == "cuda"
        assert lin.weight.grad.shape == (32, 64)


def test_small_host_tensors_keep_their_values_device_tensors_do_not():
    """Host values: the bookkeeping a program keeps in small CPU tensors (Whisper's `generate` loops
    `while (seek < max_frames).any()` over two CPU tensors of the batch's size) runs as on a GPU, so the model
    runs as often as it would; values of device tensors, of host tensors over `HOST_VALUE_NUMEL` elements, of
    floating-point and of random ones are not known (a read answers 0, as before). Before host values the loop
    never ran: a silent estimate of the weights alone."""
    from torchmem.estimator import gpu_spec
    from torchmem.estimator._session import HOST_VALUE_NUMEL, Session

    with Session(gpu_spec("H200")) as s:
        lin = torch.nn.Linear(64, 64).to("cuda")
        seek = torch.zeros((4,), dtype=torch.long)
        max_frames = torch.ones((4,), dtype=torch.long) * 3000
        windows = 0
        while (seek < max_frames).any() and windows < 10:
            lin(torch.randn(4, 64, device="cuda"))
            seek += torch.tensor([1000, 1000, 1500, 3000]).clamp(max=1000)
            windows += 1
        assert windows == 3 and seek.tolist() == [3000] * 4
        assert torch.arange(2, 11, 3).tolist() == [2, 5, 8] and int(torch.full((3,), 7).sum()) == 21
        assert int(torch.ones(HOST_VALUE_NUMEL, dtype=torch.long).sum()) == HOST_VALUE_NUMEL
        assert int(torch.ones(HOST_VALUE_NUMEL + 1, dtype=torch.long).sum()) == 0  # too large to carry values
        assert float(torch.ones(8).sum()) == 0.0  # floating point: a module's parameters are made so
        bias = torch.nn.Parameter(torch.zeros(8))  # ... and `.to("cuda")` swaps them (no constant may hold one)
        assert torch.nn.Linear(8, 8).cuda().bias.device.type == "cuda" and bias.to("cuda").device.type == "cuda"
        assert int(torch.ones(4, device="cuda").sum()) == 0  # device values are never known
        assert int((torch.randint(1, 5, (4,)) > 0).sum()) == 0  # random: no values
        assert s.forwards.forward_calls == 3


def test_a_boolean_mask_selects_every_element_without_values():
    """`x[mask]`, `masked_select` and `nonzero` size their output by a mask's values: on the emulated device a
    device mask has none, so the estimate takes the largest output (every element selected) and says so, where it
    used to refuse the program (every HF CTC fine-tune: `labels.masked_select(mask)`); a host mask with values
    (`HOST_VALUE_NUMEL`) gives the exact size; the backward of `x[mask]` runs."""
    from torchmem.estimator import gpu_spec
    from torchmem.estimator._session import Session

    with Session(gpu_spec("H200")) as s:
        x = torch.randn(1000, 256, device="cuda", requires_grad=True)
        mask = torch.rand(1000, device="cuda") > 0.5
        assert x[mask].shape == (1000, 256)
        assert x.masked_select(x > 0).shape == (256000,)
        assert torch.nonzero(mask).shape == (1000, 1)
        assert x[torch.tensor([True, False] * 500)].shape == (500, 256)  # host values: exact
        x[mask].sum().backward()
        assert x.grad.shape == (1000, 256)
        notes = " ".join(s.tracer.notes.messages)
    for op in ("aten.index.Tensor", "aten.masked_select.default", "aten.nonzero.default"):
        assert f"{op}: the output size depends on a mask's values" in notes, notes


def test_mlp_trace_equals_the_h200_recording_request_by_request():
    _s, snap = _trace_workload("mlp_sgd_fp32")
    real = pickle.load(gzip.open(FIXTURES / "mlp_sgd_fp32__estimator.pickle.gz"))["device_traces"][0]
    real_reqs = _requests(real, "alloc", "free_requested")
    est_reqs = _requests(snap["device_traces"][0], "alloc", "free_requested")
    # The recording starts with the truth script's own torch.zeros(1) (4 B, freed): not the workload's.
    assert real_reqs[:2] == [("alloc", 4, 0), ("free", 4, 0)]
    shifted = [(a, size, i - 1) for a, size, i in real_reqs[2:]]
    assert est_reqs == shifted
    # Both cuBLAS workspaces are in it (forward thread and the autograd engine's thread) and cuBLASLt's.
    sizes = [e["size"] for e in snap["device_traces"][0] if e["action"] == "alloc"]
    assert sizes.count(32 << 20) >= 2 and (1 << 20) in sizes


def test_gpt2_allocated_peak_equals_the_h200_recording():
    pytest.importorskip("transformers")
    s, snap = _trace_workload("gpt2_adamw_amp_b8")

    def live_peak(trace, free):
        live = peak = 0
        sizes = {}
        for e in trace:
            if e["action"] == "alloc":
                sizes[e["addr"]] = (e["size"] + 511) // 512 * 512
                live += sizes[e["addr"]]
                peak = max(peak, live)
            elif e["action"] == free:
                live -= sizes.pop(e["addr"], 0)
        return peak

    real = pickle.load(gzip.open(FIXTURES / "gpt2_adamw_amp_b8__estimator.pickle.gz"))["device_traces"][0]
    assert live_peak(snap["device_traces"][0], "free_requested") == live_peak(real, "free_requested")
    ops = {e["user_metadata"].split("|")[1] for e in snap["device_traces"][0] if e["action"] == "alloc"}
    # CUDA's SDPA choice on Hopper (cuDNN attention), not the math path a fake trace falls back to.
    assert "aten._scaled_dot_product_cudnn_attention.default" in ops
    assert "aten._safe_softmax.default" not in ops


MLP_SCRIPT = """
import sys
import torch
batch = int(sys.argv[1]) if len(sys.argv) > 1 else 256
device = "cuda" if torch.cuda.is_available() else "cpu"
model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 10)).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(1000):
    x = torch.randn(batch, 1024, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    print("step", step, flush=True)
"""


def test_cli_estimates_an_unchanged_script_and_stops_it(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(MLP_SCRIPT)
    trace = tmp_path / "trace.pickle"
    p = _torchmem(
        "estimate", "--gpu", "A100-40GB", "--steps", "2", "--keep-trace", str(trace), "--json", "--",
        sys.executable, str(script), "128", cwd=tmp_path,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    for key in ("peak_allocated_bytes", "peak_reserved_bytes", "nvml_bytes", "fits", "device_memory_bytes"):
        assert key in r
    assert r["steps_traced"] == 2
    assert "step 0" in p.stderr and "step 1" not in p.stderr  # stopped right after the 2nd optimizer step
    params = (1024 * 4096 + 4096 + 4096 * 10 + 10) * 4
    # weights + grads + two AdamW states, at least; the A100's cuBLAS workspace is 8 MiB + 128 KiB.
    assert r["peak_allocated_bytes"] >= 4 * params
    assert r["peak_reserved_bytes"] >= r["peak_allocated_bytes"]
    assert r["nvml_bytes"] == r["peak_reserved_bytes"] + r["context_bytes"]
    assert r["fits"] is True and r["device_memory_bytes"] < 40 * 2**30
    assert any(t["site"].endswith("(<module>)") and "train.py" in t["site"] for t in r["largest_at_peak"])
    # The trace is an allocator snapshot `torchmem simulate` reads, with the same peaks.
    sim = _torchmem("simulate", str(trace), "--json")
    assert sim.returncode == 0, sim.stderr
    dev = json.loads(sim.stdout)["devices"][0]
    assert dev["peak_allocated_bytes"] == r["peak_allocated_bytes"]
    # Text report: the numbers and the verdict.
    t = _torchmem("estimate", "--trace", str(trace), "--summary", str(trace), "--gpu", "L4")
    assert t.returncode != 0 or "fits" in t.stdout  # a snapshot is no summary JSON: a clear error, not a crash
    assert "Traceback" not in t.stderr


def test_cli_too_small_a_device_does_not_fit(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(MLP_SCRIPT)
    p = _torchmem("estimate", "--device-memory", "900MiB", "--steps", "2", "--", sys.executable, str(script), "4096")
    r_text = p.stdout
    assert p.returncode == 1, p.stderr
    assert "fits: NO" in r_text


def test_gpt2_tiny_script_with_the_python_api():
    transformers = pytest.importorskip("transformers")
    import torchmem

    state: dict = {}

    def step():
        if not state:
            cfg = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, n_positions=128, vocab_size=1000)
            model = transformers.GPT2LMHeadModel(cfg).to("cuda")
            state["opt"] = torch.optim.AdamW(model.parameters(), lr=1e-4)
            state["model"] = model
            state["ids"] = torch.randint(0, 1000, (4, 128), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = state["model"](input_ids=state["ids"], labels=state["ids"]).loss
        loss.backward()
        state["opt"].step()
        state["opt"].zero_grad(set_to_none=True)

    est = torchmem.estimate(step, gpu="H100", steps=3)
    assert est.steps == 3
    assert est.gpu == "NVIDIA H100 80GB HBM3"
    assert 0 < est.peak_allocated_bytes <= est.peak_reserved_bytes < est.nvml_bytes
    assert est.fits and est.margin_bytes > 70 * 2**30
    assert set(est.phases) == {"forward", "backward", "optimizer"}
    assert "peak reserved" in str(est)


def test_data_dependent_and_device_only_calls_are_named(tmp_path):
    # `torch.unique`'s size depends on values with no largest case worth taking (a boolean selection's is every
    # element: test_a_boolean_mask_selects_every_element_without_values)
    bad = tmp_path / "unique.py"
    bad.write_text("import torch\nx = torch.randn(64, device='cuda')\nu = torch.unique(x)\nprint(u.shape)\n")
    p = _torchmem("estimate", "--", sys.executable, str(bad))
    assert p.returncode != 0
    assert "unique" in p.stderr and "unique.py:3" in p.stderr and "depends on tensor values" in p.stderr, p.stderr
    # an operator without a shape-only kernel is named, not "Found no NVIDIA driver" from its real kernel (the CTC
    # loss itself is emulated, tests/e2e/test_estimate_ctc.py; its cuDNN query called directly is not)
    ctc = tmp_path / "ctc.py"
    ctc.write_text(
        "import torch\nlp = torch.randn(50, 4, 20, device='cuda').log_softmax(2)\n"
        "t = torch.randint(1, 20, (40,), device='cuda', dtype=torch.int32)\n"
        "n = torch.full((4,), 50, device='cuda', dtype=torch.int32)\n"
        "m = torch.full((4,), 10, device='cuda', dtype=torch.int32)\nprint(torch._use_cudnn_ctc_loss(lp, t, n, m, 0))\n"
    )
    p = _torchmem("estimate", "--", sys.executable, str(ctc))
    assert p.returncode != 0 and "ctc.py:6" in p.stderr, p.stderr
    assert "_use_cudnn_ctc_loss" in p.stderr and "has no fake (shape-only) kernel" in p.stderr, p.stderr
    assert "NVIDIA driver" not in p.stderr.splitlines()[-1], p.stderr
    graphs = tmp_path / "graphs.py"
    graphs.write_text("import torch\ng = torch.cuda.CUDAGraph()\n")
    p = _torchmem("estimate", "--", sys.executable, str(graphs))
    assert p.returncode != 0 and "torch.cuda.CUDAGraph" in p.stderr, p.stderr
    # A program without an optimizer step is an inference estimate (tests/test_estimate_inference.py); one that
    # never puts anything on the GPU has nothing to estimate.
    nostep = tmp_path / "nostep.py"
    nostep.write_text("import torch\nprint(torch.ones(3, device='cuda').sum().shape)\n")
    p = _torchmem("estimate", "--", sys.executable, str(nostep))
    assert p.returncode == 0 and "inference (no optimizer step)" in p.stdout, p.stderr
    nocuda = tmp_path / "nocuda.py"
    nocuda.write_text("import torch\nprint(torch.ones(3).sum().shape)\n")
    p = _torchmem("estimate", "--", sys.executable, str(nocuda))
    assert p.returncode != 0 and "without putting anything on the GPU" in p.stderr, p.stderr


def test_an_error_raised_while_handling_a_refusal_does_not_mask_it(tmp_path):
    """Lightning's teardown after an error inside `fit` moves the model to the CPU, which fails too ("Couldn't swap
    BatchNorm2d.weight"), and used to be the only error said; the refusal raised first is the answer, on its own
    line, the later error after it."""
    script = tmp_path / "teardown.py"
    script.write_text(
        "import torch\nx = torch.randn(64, device='cuda')\ntry:\n    u = torch.unique(x)\nfinally:\n"
        '    raise RuntimeError("_apply(): Couldn\'t swap BatchNorm2d.weight")\n'
    )
    p = _torchmem("estimate", "--", sys.executable, str(script))
    assert p.returncode != 0
    last = [ln for ln in p.stderr.splitlines() if ln.startswith("torchmem")][-1]
    assert "aten._unique2.default, whose output shape depends on tensor values" in last, p.stderr
    assert "(then, while the program handled it: RuntimeError: _apply(): Couldn't swap" in last, last
    assert last.endswith("teardown.py:4)"), last


def test_catalogue_and_bad_input():
    p = _torchmem("estimate", "--list-gpus", "--json")
    cat = {g["key"]: g for g in json.loads(p.stdout)}
    assert cat["H200"]["cuda_total_bytes"] == 150_109_880_320 and cat["H200"]["context"] is not None
    assert cat["A100-40GB"]["major"] == 8 and cat["T4"]["major"] == 7
    p = _torchmem("estimate", "--gpu", "TPUv5", "--", "python", "x.py")
    assert p.returncode != 0 and "unknown GPU" in p.stderr and "H200" in p.stderr
    p = _torchmem("estimate", "--alloc-conf", "bogus_option:1", "--", "python", "x.py")
    assert p.returncode != 0 and "--alloc-conf" in p.stderr
    p = _torchmem("estimate")
    assert p.returncode != 0 and "give the training program" in p.stderr


def test_fit_finds_the_largest_batch(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(MLP_SCRIPT.replace("range(1000)", "range(2)"))
    p = _torchmem(
        "estimate", "--device-memory", "1000MiB", "--steps", "1", "--fit", "batch=1024..16384:1024", "--json", "--",
        sys.executable, str(script), "{batch}", timeout=600,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    fit = r["fit"]
    best = fit["largest_fitting"]
    assert fit["parameter"] == "batch" and fit["first_not_fitting"] == min(
        t["value"] for t in r["tried"] if not t["fits"]
    )
    assert (
        fit["at_largest_fitting"]["nvml_bytes"] <= r["device_memory_bytes"] < fit["at_first_not_fitting"]["nvml_bytes"]
        or fit["at_first_not_fitting"]["oom"]
    )
    tried = {t["value"]: t["fits"] for t in r["tried"]}
    assert tried[best] is True
    assert any(v > best and not ok for v, ok in tried.items())
    assert all(ok for v, ok in tried.items() if v <= best)
    assert all(v % 1024 == 0 for v in tried)


def test_torch_compile_is_estimated_and_said_so():
    import torchmem

    state: dict = {}

    def step():
        if not state:
            state["m"] = torch.compile(torch.nn.Linear(256, 256).to("cuda"))
            state["opt"] = torch.optim.SGD(state["m"].parameters(), lr=0.1)
        state["m"](torch.randn(32, 256, device="cuda")).sum().backward()
        state["opt"].step()
        state["opt"].zero_grad()

    est = torchmem.estimate(step, gpu="T4", steps=2)
    assert est.steps == 2 and est.fits
    # Inductor's plan is executed on the emulated device (issue 23 item 4; tests/e2e/test_estimate_compile.py).
    assert any(n.startswith("torch.compile: Inductor's plan was executed") for n in est.notes), est.notes
    assert any(u["kind"] == "torch.compile" for u in est.uncertainty)
    # T4 (sm75): the pre-Hopper cuBLAS workspace (8 MiB + 128 KiB) per thread, not Hopper's 32 MiB.
    assert est.peak_allocated_bytes < 2 * (32 << 20)


def test_dataloader_workers_load_in_the_main_process():
    import torchmem
    from torch.utils.data import DataLoader, TensorDataset

    state: dict = {}

    def step():
        if not state:
            ds = TensorDataset(torch.randn(256, 64), torch.randint(0, 4, (256,)))
            state["it"] = iter(DataLoader(ds, batch_size=32, num_workers=2, persistent_workers=True))
            state["m"] = torch.nn.Linear(64, 4).to("cuda")
            state["opt"] = torch.optim.AdamW(state["m"].parameters())
        x, y = next(state["it"])
        torch.nn.functional.cross_entropy(state["m"](x.cuda()), y.cuda()).backward()
        state["opt"].step()
        state["opt"].zero_grad()

    est = torchmem.estimate(step, gpu="L4", steps=2)
    assert est.steps == 2
    assert any("DataLoader workers" in n for n in est.notes)


@pytest.mark.parametrize("how", ["module", "console script"])
def test_cli_estimates_a_module_and_a_console_script(tmp_path, how):
    """`torchmem estimate -m MODULE …` and an installed console script (an executable with a Python shebang,
    found on PATH) are traced like `python train.py`: the same program, the same peaks."""
    pkg = tmp_path / "trainpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(MLP_SCRIPT)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    cli = bin_dir / "train-mlp"
    cli.write_text(f"#!{sys.executable}\n" + MLP_SCRIPT)
    cli.chmod(0o755)
    script = tmp_path / "train.py"
    script.write_text(MLP_SCRIPT)
    env_path = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    common = ("estimate", "--gpu", "A100-40GB", "--steps", "2", "--json")
    as_script = _torchmem(*common, "--", sys.executable, str(script), "128", cwd=tmp_path)
    assert as_script.returncode == 0, as_script.stderr
    if how == "module":
        p = _torchmem(*common, "-m", "trainpkg", "128", cwd=tmp_path)
    else:
        p = _torchmem(*common, "--", "train-mlp", "128", cwd=tmp_path, path=env_path)
    assert p.returncode == 0, p.stderr
    r, want = json.loads(p.stdout), json.loads(as_script.stdout)
    assert r["steps_traced"] == 2 and "step 1" not in p.stderr
    for key in ("peak_allocated_bytes", "peak_reserved_bytes", "nvml_bytes", "fits"):
        assert r[key] == want[key], key
