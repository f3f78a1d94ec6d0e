"""`torchmem estimate` of cuDNN RNN programs (issue 23 item 3), against requests and peaks recorded on the H200
(tests/fixtures/rnn-h200, `scripts/gpu_rnn_truth.py`, torch 2.11, cuDNN 9.19)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "bench" / "estimate"))

import gpu_rnn_truth  # noqa: E402
import rnn_compare  # noqa: E402

TRUTH = ROOT / "tests/fixtures/rnn-h200/rnn-truth.json.gz"
CORPUS = ROOT / "bench/estimate/corpus"
TORCHMEM = Path(sys.executable).with_name("torchmem")


def _recorded(**match) -> dict:
    doc = json.load(gzip.open(TRUTH))
    for r in doc["grid"]:
        if all(r["config"].get(k) == v for k, v in match.items()):
            return r
    raise LookupError(match)


# one per kind of call: each mode, packed input, batch_first, projections, half precision, autocast
CASES = {
    "lstm": dict(mode="LSTM", input=512, hidden=1024, layers=2, bidirectional=True, batch=64, seq=128,
                 dtype="float32", packed=False, batch_first=False, autocast="", dropout=0.0, proj=0),
    "gru-packed-fp16": dict(mode="GRU", input=128, hidden=256, layers=2, bidirectional=False, batch=64, seq=128,
                            dtype="float16", packed=True, autocast="", proj=0),
    "rnn-batch-first": dict(mode="RNN_TANH", input=512, hidden=1024, layers=1, bidirectional=True, batch=32,
                            seq=64, dtype="float32", batch_first=True, autocast=""),
    "lstm-proj": dict(mode="LSTM", input=256, hidden=768, layers=2, bidirectional=True, batch=64, seq=128,
                      proj=256),
    "lstm-bf16": dict(mode="LSTM", dtype="bfloat16", bidirectional=False),
    "gru-packed-autocast-bf16": dict(mode="GRU", autocast="bfloat16", packed=True),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_requests_match_the_h200(case):
    """The module's move to the GPU, packing, the training forward, the frees and the inference forward request
    exactly what the H200 requested (sizes in order); the backward's live-bytes peak is the H200's."""
    r = _recorded(**CASES[case])
    real = rnn_compare.split(r["events"], gpu_rnn_truth.MARK_BYTES)
    est = rnn_compare.split(rnn_compare.emulated(r["config"]), gpu_rnn_truth.MARK_BYTES)
    for phase in ("to_cuda", "input", "packed", "forward", "freed", "eval_start", "eval_freed"):
        assert est[phase] == real[phase], (phase, real[phase], est[phase])
    assert rnn_compare.live_peak(est) == rnn_compare.live_peak(real)


def _estimate(script: Path) -> dict:
    p = subprocess.run(
        [str(TORCHMEM), "estimate", "--gpu", "H200", "--json", "--", sys.executable, str(script)],
        capture_output=True, text=True, cwd=str(CORPUS), env=os.environ.copy(), timeout=600,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout)


@pytest.mark.parametrize("script", ["lstm_lm.py", "gru_classifier_packed.py"])
def test_corpus_script_peak_within_the_interval(script):
    """Held-out user scripts (never used to fit the RNN model): estimated unchanged; the H200's peaks lie inside
    the interval (the point may be low where a shape is not in the catalogue, never the upper bound)."""
    truth = json.load(gzip.open(TRUTH))["scripts"][script]
    est = _estimate(CORPUS / script)
    assert est["peak_allocated_bytes"] >= 0.99 * truth["allocated_bytes.all.peak"]
    assert est["peak_reserved_upper_bytes"] >= truth["reserved_bytes.all.peak"]
    assert est["nvml_upper_bytes"] >= truth["nvml_process_bytes"]
    if script == "lstm_lm.py":  # all shapes known but the workspace: allocated is exact
        assert abs(est["peak_allocated_bytes"] / truth["allocated_bytes.all.peak"] - 1) < 0.01
        # its workspace (2 layers with dropout, not recorded) from the same stack recorded without dropout plus
        # one hidden-size row per row and inner layer (_rnn.py): the reserved peak was 16 % low by nearest-shape
        # scaling; exact since (the rule was read off the catalogue, this script held out)
        assert abs(est["peak_reserved_bytes"] / truth["reserved_bytes.all.peak"] - 1) < 0.005
        kinds = {u["kind"] for u in est["uncertainty"]}
        assert "cudnn_rnn_workspace" in kinds, est["uncertainty"]
    else:  # the lengths come from torch.randint on the CPU: no values here, full length taken and said
        assert any("pack_padded_sequence" in n for n in est["notes"]), est["notes"]


def test_bare_program_name_runs_from_a_folder_named_like_it(tmp_path):
    """`torchmem estimate -- python script.py` from a checkout with a `python/` folder runs Python (PATH), not
    the folder (it used to stop: "python is a directory")."""
    (tmp_path / "python").mkdir()
    (tmp_path / "s.py").write_text("print('ran')\n")
    p = subprocess.run([str(TORCHMEM), "run", "-o", str(tmp_path / "p.sqlite"), "--", "python", "s.py"],
                       capture_output=True, text=True, cwd=str(tmp_path), timeout=120,
                       env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "ran" in p.stdout
