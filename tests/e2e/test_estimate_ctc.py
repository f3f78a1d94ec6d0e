"""The CTC loss under `torchmem estimate` (issue 23): torch has no shape-only kernel for it, so the estimate emulates
CUDA's `_ctc_loss` and its backward (`python/torchmem/estimator/_ctc.py`). Real `torchmem estimate` runs of a small
CTC training script; the H100 truth of the corpus's Wav2Vec2 CTC fine-tune is scored in docs/estimator.md."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest
from cli import torchmem

# T frames, B sequences, C labels; the targets S labels long. log_alpha and log_beta are (B, T, 2S + 1) float32.
SCRIPT = """
import argparse
import torch
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--targets", default="padded")  # padded | concat (lengths on the GPU) | host (lengths a list)
p.add_argument("--width", type=int, default=100)
p.add_argument("--int32", action="store_true")
p.add_argument("--cudnn-off", action="store_true")
p.add_argument("--device", default="cuda")
a = p.parse_args()
dev = a.device
T, B, C, S = 2000, 16, 32, a.width
torch.manual_seed(0)
model = torch.nn.Linear(64, C).to(dev)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(T, B, 64, device=dev)
dtype = torch.int32 if a.int32 else torch.long
for step in range(2):
    lp = model(x).log_softmax(2)
    if a.targets == "padded":
        targets = torch.randint(1, C, (B, S), device=dev, dtype=dtype)
    else:
        targets = torch.randint(1, C, (B * S,), device=dev, dtype=dtype)
    if a.targets == "host":
        il, tl = [T] * B, [S] * B
    else:
        il = torch.full((B,), T, device=dev, dtype=dtype)
        tl = torch.full((B,), S, device=dev, dtype=dtype)
    with torch.backends.cudnn.flags(enabled=not a.cudnn_off):
        loss = F.ctc_loss(lp, targets, il, tl, zero_infinity=True)
        per_seq = F.ctc_loss(lp.detach(), targets, il, tl, reduction="none")
        total = F.ctc_loss(lp.detach(), targets, il, tl, reduction="sum")
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
print("shapes", tuple(loss.shape), tuple(per_seq.shape), tuple(total.shape))
"""
T, B, S = 2000, 16, 100
ALPHA_BYTES = B * T * (2 * S + 1) * 4  # log_alpha, and log_beta in backward: 25,728,000 bytes


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ctc") / "ctc_train.py"
    path.write_text(SCRIPT)
    return path


@functools.cache
def _estimate(script: Path, *args: str) -> subprocess.CompletedProcess:
    """One estimate per worker and arguments (the padded run is the baseline of three tests)."""
    return torchmem("estimate", "--gpu", "H200", "--json", "--", sys.executable, str(script), *args,
                    cwd=script.parent, timeout=240)  # fmt: skip


def _ok(script: Path, *args: str) -> tuple[dict, str]:
    p = _estimate(script, *args)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout), p.stderr


def _ctc_reasons(r: dict) -> list[dict]:
    return [u for u in r.get("uncertainty", []) if u["kind"] == "ctc_target_length"]


def test_padded_targets_train_with_alpha_and_beta_at_the_peak(script):
    r, err = _ok(script)
    # The program ran to its end, and its three reductions have the shapes torch gives on the CPU.
    real = subprocess.run([sys.executable, str(script), "--device", "cpu"], capture_output=True, text=True, check=True)
    assert real.stdout.strip() == "shapes () (16,) ()", real.stdout
    assert real.stdout.strip() in err, err[-2000:]
    assert r["steps_traced"] >= 1 and r["fits"] is True, r
    # The peak is in the loss's backward: log_alpha (kept by the graph since forward) and log_beta, both
    # (B, T, 2S + 1) float32, and the large-problem path's alpha + beta at the blanks (B, T, S + 1), with the two
    # cuBLAS workspaces the largest live there. No zeros are made for log_alpha's gradient (it has none).
    at_peak = [(t["size_bytes"], t["phase"], t["what"]) for t in r["largest_at_peak"]]
    alpha_beta = [a for a in at_peak if a[0] == ALPHA_BYTES]
    assert [(p, w) for _, p, w in alpha_beta] == [
        ("forward", "aten.new_empty.default"),
        ("backward", "aten.empty_like.default"),
    ], at_peak
    assert (B * T * (S + 1) * 4, "backward", "aten.add.Tensor") in at_peak, at_peak
    assert not _ctc_reasons(r), "padded targets: the width bounds the longest target"


def test_the_peak_grows_with_the_target_length_as_cudas_buffers_do(script):
    wide, _ = _ok(script)
    narrow, _ = _ok(script, "--width", "50")
    # 50 labels fewer: log_alpha and log_beta lose 2 x 50 of their 2S + 1 columns each, and the large-problem path's
    # alpha + beta at the blank positions (B, T, S + 1) 50 columns: 5 x 50 columns of B x T float32.
    # What is left is the targets' own 50 x 16 int64 fewer, in 512-byte blocks (under 16 KiB).
    columns = B * T * 4
    grown = wide["peak_allocated_bytes"] - narrow["peak_allocated_bytes"]
    assert 0 <= grown - 5 * 50 * columns <= 16 * 1024, (grown, 5 * 50 * columns)


def test_concatenated_targets_of_unknown_lengths_widen_the_interval(script):
    padded, _ = _ok(script)
    concat, _ = _ok(script, "--targets", "concat")
    host, _ = _ok(script, "--targets", "host")
    # Lengths computed on the GPU have no value here: the point takes them equal (N / B = S, as a padded batch
    # flattened by a mask gives), which is the padded run's peak (to a few 512-byte blocks of small tensors); the
    # upper bound takes one target of all N labels.
    assert abs(concat["peak_allocated_bytes"] - padded["peak_allocated_bytes"]) <= 4096, (concat, padded)
    reasons = _ctc_reasons(concat)  # one per call site (the training loss, and the two reductions after it)
    assert reasons and all("assumed equal: 100 labels, at most 1600" in u["what"] for u in reasons), reasons
    assert concat["peak_reserved_upper_bytes"] > concat["peak_reserved_bytes"] + 2 * B * T * 4 * 2 * (1600 - S)
    # Lengths given as a list are known: the same peak, and nothing uncertain about it.
    assert abs(host["peak_allocated_bytes"] - padded["peak_allocated_bytes"]) <= 4096, (host, padded)
    assert not _ctc_reasons(host)


def test_cudnns_ctc_is_refused_by_name_and_runs_with_cudnn_off(script):
    p = _estimate(script, "--targets", "concat", "--int32")
    assert p.returncode != 0
    assert "cuDNN's CTC loss" in p.stderr and "ctc_train.py" in p.stderr, p.stderr[-2000:]
    assert "int64 targets and lengths" in p.stderr
    r, _ = _ok(script, "--targets", "concat", "--int32", "--cudnn-off")
    assert r["fits"] is True
