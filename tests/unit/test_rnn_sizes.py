"""cuDNN RNN sizes of the estimator (`torchmem.estimator._rnn`) against recorded requests (`scripts/gpu_rnn_truth.py`,
torch 2.11, cuDNN 9.19): tests/fixtures/rnn-h200 (466 configurations on the H200) and tests/fixtures/rnn-h100-dense
(288 more, `--dense`, on an H100: same sm90, SM count and cuDNN; a quarter of them eval-mode modules)."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "bench" / "estimate"))

import gpu_rnn_truth  # noqa: E402
import rnn_compare  # noqa: E402
from torchmem.estimator import _rnn  # noqa: E402

TRUTH = ROOT / "tests/fixtures/rnn-h200/rnn-truth.json.gz"
DENSE = ROOT / "tests/fixtures/rnn-h100-dense/rnn-truth-dense.json.gz"


@pytest.fixture(scope="module")
def grid() -> list[dict]:
    return [r for path in (TRUTH, DENSE) for r in json.load(gzip.open(path))["grid"] if "events" in r]


def _forward(r: dict) -> list:
    return rnn_compare.split(r["events"], gpu_rnn_truth.MARK_BYTES)["forward"]


def test_every_config_was_recorded(grid):
    assert len(gpu_rnn_truth.grid(False)) == 466 and len(gpu_rnn_truth.dense_grid()) == 288
    assert len(grid) == 466 + 288


def test_reserve_space_formula_is_exact_on_every_recorded_config(grid):
    """The reserve space is the request right after the workspace in a training forward: our formula gives the
    same allocator block (512-byte rounding) for every mode, size, layer count, direction, projection, dtype,
    packed input, dropout and autocast configuration recorded."""
    wrong = []
    for r in grid:
        if r["config"].get("eval"):
            continue  # inference: no reserve space
        events = [s for a, s in _forward(r) if a == "alloc"]
        ws = _rnn.training_workspace(_forward(r))
        recorded = events[events.index(ws) + 1]
        predicted = (_rnn.reserve_bytes(_rnn.grid_shape(r["config"])) + 511) // 512 * 512
        if predicted != recorded:
            wrong.append((r["config"], recorded, predicted))
    assert not wrong, wrong[:3]


def test_catalogue_holds_every_recorded_workspace(grid):
    cat = _rnn.WorkspaceCatalogue.load()
    missing = [r["config"] for r in grid if cat.exact.get(_rnn.grid_shape(r["config"]).key()) is None]
    assert not missing, missing[:3]
    for r in grid:
        point, upper, how = cat.lookup(_rnn.grid_shape(r["config"]))
        assert how == "exact" and point == upper == _rnn.training_workspace(_forward(r))


def test_unrecorded_shapes_are_bounded_leave_one_out(grid):
    """Each recorded shape taken out of the catalogue in turn: the scaled point may miss, but the interval's upper
    bound is never below what the H200 asked for (no false "fits" from an unrecorded RNN shape)."""
    data = json.load(gzip.open(_rnn.CATALOGUE_PATH))
    below, errors = [], []
    for r in grid:
        shape = _rnn.grid_shape(r["config"])
        held_out = {k: v for k, v in data["workspace_bytes"].items() if k != shape.key()}
        cat = _rnn.WorkspaceCatalogue({"workspace_bytes": held_out})
        point, upper, how = cat.lookup(shape)
        truth = _rnn.training_workspace(_forward(r))
        assert how == "scaled"
        errors.append(abs(point - truth) / truth)
        if upper < truth:
            below.append((r["config"], truth, upper))
    assert not below, below[:3]
    errors.sort()
    n = len(errors)
    print(f"leave-one-out workspace point error: median {errors[n // 2]:.1%}, p75 {errors[3 * n // 4]:.1%}, "
          f"p90 {errors[9 * n // 10]:.1%}, max {errors[-1]:.1%}")  # fmt: skip


def test_shape_key_round_trips():
    s = _rnn.RnnShape(mode=2, input_size=100, hidden_size=300, proj_size=0, num_layers=2, bidirectional=True,
                      seq_length=37, mini_batch=13, rows=481, packed=False, dtype_bytes=4, dropout=True)  # fmt: skip
    assert _rnn._shape_from_key(s.key()) == s
