"""`torchmem estimate` on programs without an optimizer (issue 23, item 2): an evaluation loop under
`torch.inference_mode()` and Hugging Face `generate` (greedy, sampling, beam search; dynamic and static KV caches)
are traced to their end (or to `--forward-calls N`) and reported like a training estimate, as an inference
estimate. Each script is small and unchanged, run by the CLI on this CPU-only machine (GPT-2 built from a config:
no network). The numbers are checked against what the shapes say they must be: the KV cache grows by
2 * layers * hidden * bytes per token and sequence (plus the one copy `torch.cat` holds while a layer's cache
grows), beam search holds num_beams times the cache, an evaluation step holds the weights and one layer's input
and output, far below a training step."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

if torch.cuda.is_available():  # pragma: no cover - these tests are about machines without a GPU
    pytest.skip("the estimator tests run on a machine without a GPU", allow_module_level=True)

KIB = 1024
MIB = 1024 * 1024


def _estimate(script: Path, *args: str, cli: tuple[str, ...] = (), timeout: int = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, TORCHMEM_PYTHON=sys.executable, TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-m", "torchmem", "estimate", "--gpu", "H200", "--json", *cli, "--",
         sys.executable, str(script), *args],
        capture_output=True, text=True, cwd=script.parent, env=env, timeout=timeout,
    )  # fmt: skip


def _ok(p: subprocess.CompletedProcess) -> dict:
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


# A tiny GPT-2 (2 layers, hidden 256 = 4 heads of 64) from its config, generating the way the model card says.
GENERATE_SCRIPT = """
import argparse
import torch
from transformers import GPT2Config, GPT2LMHeadModel

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=8)
p.add_argument("--prompt", type=int, default=4)
p.add_argument("--new", type=int, default=48)
p.add_argument("--beams", type=int, default=1)
p.add_argument("--sample", action="store_true")
p.add_argument("--static", action="store_true")
p.add_argument("--eager", action="store_true")
p.add_argument("--calls", type=int, default=1)
a = p.parse_args()

config = GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=1000, n_positions=1024, bos_token_id=0, eos_token_id=1)
model = GPT2LMHeadModel(config).to("cuda").eval()
prompt = torch.randint(2, 1000, (a.batch, a.prompt), device="cuda")
kwargs = dict(max_new_tokens=a.new, num_beams=a.beams, do_sample=a.sample, pad_token_id=0)
if a.static:
    kwargs["cache_implementation"] = "static"
if a.eager:  # a static cache makes `generate` compile the forward on CUDA; this keeps it eager
    kwargs["disable_compile"] = True
for _ in range(a.calls):
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)
print("generated", tuple(out.shape))
"""
LAYERS, HIDDEN, BATCH, PROMPT = 2, 256, 8, 4
# One layer's K (or V) for one more token of every sequence, fp32.
KV_TOKEN_BYTES = BATCH * HIDDEN * 4


@pytest.fixture(scope="module")
def gen_script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("generate") / "generate.py"
    path.write_text(GENERATE_SCRIPT)
    return path


@functools.cache
def _generate(script: Path, *args: str, cli: tuple[str, ...] = ()) -> tuple[dict, str]:
    """One estimate of the generating script, made once per worker (greedy `--new 48` is the baseline of two
    tests); the tests only read it."""
    p = _estimate(script, *args, cli=cli)
    r = _ok(p)
    assert r["kind"] == "inference" and r["steps_traced"] == 0, r
    return r, p.stderr


def test_greedy_generation_runs_to_max_new_tokens_and_the_kv_cache_grows_per_token(gen_script):
    # Before: the estimate never ended (the loop's `unfinished_sequences.max() == 0` read 0: "not finished"),
    # and a program that did end got "ended without an optimizer step ... nothing to estimate".
    short, short_err = _generate(gen_script, "--new", "48")
    long, long_err = _generate(gen_script, "--new", "96")
    # Every sequence runs to max_new_tokens: the program's own print (on stderr with --json) says so.
    assert f"generated ({BATCH}, {PROMPT + 48})" in short_err
    assert f"generated ({BATCH}, {PROMPT + 96})" in long_err
    for r in (short, long):
        assert r["generate_calls"] == 1 and r["forward_calls"] == 0, r
        assert r["fits"] is True and r["peak_reserved_bytes"] >= r["peak_allocated_bytes"] > 0
        assert r["nvml_bytes"] == r["peak_reserved_bytes"] + r["context_bytes"]
        assert any(n.startswith("inference estimate: no optimizer step") for n in r["notes"]), r["notes"]
        assert any("max_new_tokens" in n and "worst case" in n for n in r["notes"]), r["notes"]
    # The peak is at the last forward: every layer's K and V at full length (2 * layers tensors; the cache holds
    # prompt + new - 1 tokens, the last token is never fed back).
    full = KV_TOKEN_BYTES * (PROMPT + 96 - 1)
    at_peak = [t for t in long["largest_at_peak"] if t["what"] == "aten.cat.default" and t["size_bytes"] == full]
    assert len(at_peak) == 2 * LAYERS, long["largest_at_peak"]
    # 48 more tokens: the cache's 2 * layers * hidden * 4 bytes per token and sequence, plus the growth of the
    # old K/V `torch.cat` still holds while it makes the last layer's new one (live at the peak too);
    # what is left is the growing token ids (8 bytes per token and sequence) and the allocator's 512-byte rounding.
    grown = long["peak_allocated_bytes"] - short["peak_allocated_bytes"]
    expected = (2 * LAYERS + 1) * KV_TOKEN_BYTES * 48
    assert 0 <= grown - expected <= 16 * KIB, (grown, expected)
    assert 2 * LAYERS * KV_TOKEN_BYTES * 48 == 1536 * KIB  # the cache alone: 32 KiB per token for 8 sequences


def test_static_cache_holds_max_length_from_the_start(gen_script):
    # Eager: with a static cache, transformers' `generate` compiles the model's forward on CUDA, and the compiled
    # estimate (Inductor's plan, its autotuning buffers) pushes cache tensors out of the 12 largest at the peak.
    short, _ = _generate(gen_script, "--new", "48", "--static", "--eager")
    long, err = _generate(gen_script, "--new", "96", "--static", "--eager")
    assert f"generated ({BATCH}, {PROMPT + 96})" in err
    # StaticCache allocates (batch, heads, max_length, head_dim) per layer for K and V once, and writes in place.
    full = KV_TOKEN_BYTES * (PROMPT + 96 - 1)
    static = [t for t in long["largest_at_peak"] if t["size_bytes"] == full]
    assert len(static) == 2 * LAYERS and all(t["what"] == "aten.zeros.default" for t in static), static
    grown = long["peak_allocated_bytes"] - short["peak_allocated_bytes"]
    expected = 2 * LAYERS * KV_TOKEN_BYTES * 48
    assert 0 <= grown - expected <= 8 * KIB, (grown, expected)


def test_beam_search_and_sampling_run_to_max_new_tokens(gen_script):
    # Before the fix beam search stopped after its first token: its `not any(...)` read 0 and said "finished".
    greedy, _ = _generate(gen_script, "--new", "48")
    beams, _ = _generate(gen_script, "--new", "48", "--beams", "4")
    sample, err = _generate(gen_script, "--new", "48", "--sample")
    assert f"generated ({BATCH}, {PROMPT + 48})" in err
    # Sampling holds what greedy search holds (the same cache; the sampled token replaces the argmax).
    assert abs(sample["peak_allocated_bytes"] - greedy["peak_allocated_bytes"]) <= 64 * KIB
    # Beam search holds 4 caches per prompt at full length: at least 3 more than greedy search.
    extra = 2 * LAYERS * KV_TOKEN_BYTES * (PROMPT + 48) * 3
    assert beams["peak_allocated_bytes"] >= greedy["peak_allocated_bytes"] + extra, (beams, greedy, extra)
    assert beams["peak_reserved_bytes"] >= greedy["peak_reserved_bytes"]


def test_forward_calls_bounds_a_generating_program(gen_script):
    p = _estimate(gen_script, "--new", "8", "--calls", "3", cli=("--forward-calls", "1"))
    r = _ok(p)
    assert r["generate_calls"] == 1 and r["kind"] == "inference", r
    assert "generated" not in p.stderr  # stopped after the first generate call, before the program's print
    assert any("--forward-calls bound" in n for n in r["notes"]), r["notes"]
    bad = _estimate(gen_script, cli=("--forward-calls", "0"))
    assert bad.returncode != 0 and "--forward-calls must be at least 1" in bad.stderr, bad.stderr


# An evaluation loop the way people write it: a DataLoader with pinned memory, `inference_mode`, accuracy read
# with `.item()`; `--train` makes the same model train with SGD instead.
EVAL_SCRIPT = """
import argparse
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=64)
p.add_argument("--batches", type=int, default=4)
p.add_argument("--train", action="store_true")
a = p.parse_args()

model = nn.Sequential(
    nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
    nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(),
    nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
).to("cuda")
data = TensorDataset(torch.randn(a.batch * a.batches, 3, 64, 64), torch.randint(0, 10, (a.batch * a.batches,)))
loader = DataLoader(data, batch_size=a.batch, pin_memory=True)
if a.train:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x.cuda(non_blocking=True)), y.cuda())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
else:
    model.eval()
    correct = 0
    with torch.inference_mode():
        for x, y in loader:
            pred = model(x.cuda(non_blocking=True)).argmax(1)
            correct += (pred == y.cuda()).sum().item()
    print("accuracy", correct / len(data))
"""


@pytest.fixture(scope="module")
def eval_script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("evaluate") / "evaluate.py"
    path.write_text(EVAL_SCRIPT)
    return path


def _weights_bytes() -> int:
    from torch import nn

    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
    )  # fmt: skip
    return sum((t.nbytes + 511) // 512 * 512 for t in [*model.parameters(), *model.buffers()])


def test_an_inference_mode_eval_loop_holds_weights_and_one_layer(eval_script):
    # Before: `.item()` under inference_mode failed ("the program reads a tensor value"), and an eval-only program
    # ended with "ended without an optimizer step"; under inference_mode the composite operators (conv2d,
    # linear) reached the tracer whole, so no cuBLAS workspace or cuDNN lookup was counted.
    p = _estimate(eval_script, "--batch", "64", "--batches", "4")
    ev = _ok(p)
    assert "accuracy" in p.stderr
    assert ev["kind"] == "inference" and ev["forward_calls"] == 4 and ev["generate_calls"] == 0, ev
    # Weights + the batch (3 MiB) + the largest layer's input and output together (conv1's output and batch
    # norm's, 32 MiB each) + cuBLAS's and cuBLASLt's workspaces (the Linear: 32 + 1 MiB on Hopper).
    expected = _weights_bytes() + 3 * MIB + 2 * 32 * MIB + 33 * MIB
    assert 0 <= ev["peak_allocated_bytes"] - expected <= 16 * KIB, (ev["peak_allocated_bytes"], expected)
    assert ev["convolution_workspaces"]["calls"]["unknown"] + ev["convolution_workspaces"]["calls"]["exact"] > 0
    # The same model trained (unchanged behaviour: stopped after --steps optimizer steps) holds the activations
    # for backward, gradients and momentum.
    tr = _ok(_estimate(eval_script, "--batch", "64", "--batches", "4", "--train", cli=("--steps", "2")))
    assert tr["kind"] == "training" and tr["steps_traced"] == 2, tr
    assert tr["peak_allocated_bytes"] > ev["peak_allocated_bytes"] + 96 * MIB


def test_forward_calls_bounds_an_eval_loop(eval_script):
    r = _ok(_estimate(eval_script, "--batch", "8", "--batches", "6", cli=("--forward-calls", "2")))
    assert r["forward_calls"] == 2 and r["kind"] == "inference", r


def test_fit_finds_the_largest_eval_batch(eval_script):
    p = _estimate(
        eval_script, "--batch", "{batch}", "--batches", "1",
        cli=("--device-memory", "1536MiB", "--fit", "batch=128..1024:64"),
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    fit = json.loads(p.stdout)["fit"]
    good, bad = fit["largest_fitting"], fit["first_not_fitting"]
    assert good is not None and bad == good + 64, fit
    # "Fits" is the upper bound's (docs/estimator.md §5.1: this CNN's convolutions are not in the catalogue).
    assert fit["at_largest_fitting"]["nvml_upper_bytes"] <= 1536 * MIB
    over = fit["at_first_not_fitting"]
    assert over["oom"] is not None or over["nvml_upper_bytes"] > 1536 * MIB, over
    # Activations are about 1 MiB a sample (conv1's and batch norm's outputs, 512 KiB each): hundreds fit by the
    # point estimate; fewer by the upper bound (cuDNN's workspaces for these shapes at the catalogue's worst case).
    assert 256 <= fit["point_largest_fitting"] < 1024, fit
    assert 128 <= good <= fit["point_largest_fitting"], fit


def test_backward_without_an_optimizer_is_estimated_and_said(tmp_path):
    script = tmp_path / "manual_sgd.py"
    script.write_text(
        "import torch\n"
        "w = torch.randn(256, 256, device='cuda', requires_grad=True)\n"
        "for _ in range(2):\n"
        "    loss = (torch.randn(64, 256, device='cuda') @ w).square().mean()\n"
        "    loss.backward()\n"
        "    with torch.no_grad():\n"
        "        w -= 0.1 * w.grad\n"
        "        w.grad = None\n"
    )
    r = _ok(_estimate(script))
    assert r["kind"] == "backward without optimizer step", r
    assert any("2 backward pass(es) ran" in n for n in r["notes"]), r["notes"]


def test_a_program_that_never_uses_cuda_is_still_refused(tmp_path):
    script = tmp_path / "cpu_only.py"
    script.write_text("import torch\nprint(torch.ones(3).sum())\n")
    p = _estimate(script)
    assert p.returncode == 1 and "without putting anything on the GPU" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and "panicked" not in p.stderr


def test_cuda_calls_of_sampling_code_are_emulated_or_named(tmp_path):
    # Before: each of these raised "CUDA driver version is insufficient" from the real CUDA runtime.
    script = tmp_path / "sampling.py"
    script.write_text(
        "import sys\n"
        "import torch\n"
        "g = torch.Generator(device='cuda').manual_seed(0)\n"
        "assert isinstance(g, torch.Generator)\n"
        "with torch.cuda.device(0):\n"
        "    noise = torch.randn(1024, 1024, device='cuda', generator=g)\n"
        "with torch.cuda.device_of(noise):\n"
        "    probs = torch.softmax(noise, -1)\n"
        "picked = torch.multinomial(probs, 4, generator=g)\n"
        "assert torch.cuda.is_current_stream_capturing() is False\n"
        "if sys.argv[1:] == ['blas']:\n"
        "    torch.cuda.current_blas_handle()\n"
    )
    r = _ok(_estimate(script))
    assert r["kind"] == "inference" and r["peak_allocated_bytes"] >= 2 * 4 * MIB, r
    p = _estimate(script, "blas")
    assert p.returncode != 0, p.stderr
    assert "torch.cuda.current_blas_handle() needs a real CUDA device" in p.stderr and "sampling.py:12" in p.stderr


def test_the_python_api_estimates_an_inference_step():
    import torchmem
    from torch import nn

    state: dict = {}

    def step():
        if not state:
            state["model"] = nn.Linear(1024, 1024).cuda().eval()
        with torch.inference_mode():
            state["model"](torch.randn(256, 1024, device="cuda"))

    est = torchmem.estimate(step, gpu="H200", steps=2)
    assert est.kind == "inference" and est.forward_calls == 2 and est.steps == 0, est
    # Weights (4 MiB + 4 KiB of bias), the input and the output (1 MiB each) and the Linear's cuBLAS and cuBLASLt
    # workspaces (32 + 1 MiB on Hopper): under inference_mode the Linear reaches the tracer as `aten.linear`,
    # which missed the workspaces (6 MiB) before it was decomposed as CUDA does.
    assert abs(est.peak_allocated_bytes - (4 * MIB + 4 * KIB + 2 * MIB + 33 * MIB)) <= 8 * KIB, est
    assert "inference (no optimizer step), 2 forward call(s)" in str(est)
