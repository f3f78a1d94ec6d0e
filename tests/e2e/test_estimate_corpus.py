"""`torchmem estimate` of user-style corpus scripts (issue 23, "Accuracy") against their truth
(tests/fixtures/corpus-h100, recorded by `scripts/gpu_corpus_truth.py` in a fresh process per script on an H100
80GB HBM3: no H200 could be had in session 17; each script is estimated for that GPU). One cheap script per
family: the HF Trainer, generation (GPT-2 greedy; Whisper's own `generate`, whose host-side loop needs host
values), a recommender, batch inference. The scripts run unchanged; the tolerances are each script's measured
error in docs/estimator.md §4.2's table, rounded up (the corpus is held out: the estimator was never tuned on it),
so a regression fails here; they are not the issue's goal (3 %), which the table shows where it is missed."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRUTH = ROOT / "tests/fixtures/corpus-h100/corpus-truth.json.gz"
CORPUS = ROOT / "bench/estimate/corpus"
TORCHMEM = Path(sys.executable).with_name("torchmem")

# script: largest |error| in % allowed on peak allocated, peak reserved, NVML (the §4.2 figure rounded up), and
# whether the true reserved and NVML peaks lie inside the interval (False: a known miss, the bound is the point)
CASES = {
    "hf_bert_text_classification.py": (1.0, 0.5, 0.5, True),  # +0.62 / +0.00 / +0.00 %
    "gpt2_greedy_generate.py": (0.5, 2.5, 5.0, True),  # +0.29 / +2.37 / +4.81 %
    "whisper_greedy_transcribe.py": (0.5, 3.5, 2.5, False),  # +0.03 / -3.14 / +2.34 %
    "dlrm_recommender.py": (0.5, 0.5, 0.5, False),  # +0.00 / -0.41 / -0.40 %
    "bert_embed_eval_fp16.py": (2.5, 4.5, 6.0, True),  # +2.39 / +4.46 / +5.92 %
}


def _truth() -> dict:
    doc = json.load(gzip.open(TRUTH))
    assert doc["versions"]["device"] == "NVIDIA H100 80GB HBM3", doc["versions"]
    return doc["scripts"]


def _estimate(script: Path) -> dict:
    p = subprocess.run(
        [str(TORCHMEM), "estimate", "--gpu", "H100-80GB", "--json", "--", sys.executable, str(script)],
        capture_output=True, text=True, cwd=str(CORPUS), env=os.environ.copy(), timeout=900,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout)


@pytest.mark.parametrize("script", sorted(CASES))
def test_corpus_script_against_the_gpu(script):
    truth = _truth()[script]
    assert truth["status"] == "ok", truth
    est = _estimate(CORPUS / script)
    assert est["gpu_key"] == "H100-80GB"
    tol_alloc, tol_reserved, tol_nvml, inside = CASES[script]
    for key, est_key, tol in (
        ("allocated_bytes.all.peak", "peak_allocated_bytes", tol_alloc),
        ("reserved_bytes.all.peak", "peak_reserved_bytes", tol_reserved),
        ("nvml_process_bytes", "nvml_bytes", tol_nvml),
    ):
        err = (est[est_key] - truth[key]) / truth[key] * 100
        assert abs(err) <= tol, f"{script}: {est_key} {est[est_key]} vs the H100's {truth[key]}: {err:+.2f} %"
    # the true peak inside the interval (never a false "fits"); a known miss must stay one until it is fixed
    held = (est["peak_reserved_upper_bytes"] >= truth["reserved_bytes.all.peak"]
            and est["nvml_upper_bytes"] >= truth["nvml_process_bytes"])  # fmt: skip
    assert held == inside, (script, est["peak_reserved_upper_bytes"], truth["reserved_bytes.all.peak"])


EMA_SCRIPT = """
import copy, sys
import torch, torch.nn as nn
model = nn.Sequential(nn.Conv2d(3, 64, 3), nn.BatchNorm2d(64), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                      nn.Linear(64, 10))
keep = []
if sys.argv[1] == "ema":
    keep.append(copy.deepcopy(model).cuda())  # BatchNorm's num_batches_tracked is torch.tensor(0): a constant
    keep.append(copy.deepcopy(torch.tensor(0.0)).cuda())  # torchmetrics' add_state (Lightning's self.log)
model.cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
for _ in range(3):
    model(torch.randn(32, 3, 64, 64, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def test_deepcopy_of_a_module_with_batchnorm_before_cuda(tmp_path):
    """`copy.deepcopy` of a CPU module whose BatchNorm holds a constant (`num_batches_tracked`), and of a logged
    `torch.tensor(0.0)`: the corpus's timm EMA and Lightning scripts stopped there ("Attempted to set the storage
    of a tensor on device "meta" ..."); the copies are on the GPU at the peak, each block rounded to 512 B."""
    script = tmp_path / "ema.py"
    script.write_text(EMA_SCRIPT)
    peaks = {}
    for mode in ("ema", "plain"):
        p = subprocess.run([str(TORCHMEM), "estimate", "--json", "--", sys.executable, str(script), mode],
                           capture_output=True, text=True, timeout=600)  # fmt: skip
        assert p.returncode == 0, p.stderr[-2000:]
        peaks[mode] = json.loads(p.stdout)["peak_allocated_bytes"]
    import torch.nn as nn

    model = nn.Sequential(nn.Conv2d(3, 64, 3), nn.BatchNorm2d(64), nn.Linear(64, 10))
    tensors = [*model.parameters(), *model.buffers()]
    copies = sum(-(-t.numel() * t.element_size() // 512) * 512 for t in tensors) + 512
    assert peaks["ema"] - peaks["plain"] == copies, (peaks, copies)
