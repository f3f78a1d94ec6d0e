"""`torchmem estimate` of user-style corpus scripts (issue 23, "Accuracy") against their H200 truth
(tests/fixtures/corpus-h200, recorded by `scripts/gpu_corpus_truth.py` in a fresh process per script). One cheap
script per family: the HF Trainer, generation, a recommender, batch inference. The scripts run unchanged; the
tolerances are the ones docs/estimator.md §4.2's table shows for them (the corpus is held out: the estimator was
never tuned on it)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRUTH = ROOT / "tests/fixtures/corpus-h200/corpus-truth.json.gz"
CORPUS = ROOT / "bench/estimate/corpus"
TORCHMEM = Path(sys.executable).with_name("torchmem")

# script: largest |error| in % allowed on peak allocated, peak reserved, NVML: issue 23's goal (3 %) until the
# truth's table (docs/estimator.md §4.2) shows each script's own figure
CASES = {
    "hf_bert_text_classification.py": (3.0, 3.0, 3.0),
    "llama_sampling_generate.py": (3.0, 3.0, 3.0),
    "dlrm_recommender.py": (3.0, 3.0, 3.0),
    "bert_embed_eval_fp16.py": (3.0, 3.0, 3.0),
}


def _estimate(script: Path) -> dict:
    p = subprocess.run(
        [str(TORCHMEM), "estimate", "--gpu", "H200", "--json", "--", sys.executable, str(script)],
        capture_output=True, text=True, cwd=str(CORPUS), env=os.environ.copy(), timeout=900,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout)


@pytest.mark.skipif(not TRUTH.exists(), reason="the corpus's H200 truth is not recorded yet")
@pytest.mark.parametrize("script", sorted(CASES))
def test_corpus_script_against_the_h200(script):
    truth = json.load(gzip.open(TRUTH))["scripts"][script]
    assert truth["status"] == "ok", truth
    est = _estimate(CORPUS / script)
    tol_alloc, tol_reserved, tol_nvml = CASES[script]
    for key, est_key, tol in (
        ("allocated_bytes.all.peak", "peak_allocated_bytes", tol_alloc),
        ("reserved_bytes.all.peak", "peak_reserved_bytes", tol_reserved),
        ("nvml_process_bytes", "nvml_bytes", tol_nvml),
    ):
        err = (est[est_key] - truth[key]) / truth[key] * 100
        assert abs(err) <= tol, f"{script}: {est_key} {est[est_key]} vs the H200's {truth[key]}: {err:+.2f} %"
    # the true peak lies inside the interval (never a false "fits")
    assert est["peak_reserved_upper_bytes"] >= truth["reserved_bytes.all.peak"]
    assert est["nvml_upper_bytes"] >= truth["nvml_process_bytes"]


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
