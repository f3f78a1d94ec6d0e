"""Builds the estimator's cuDNN RNN workspace catalogue from the H200 truth (`scripts/gpu_rnn_truth.py`):

    .venv/bin/python scripts/build_rnn_catalogue.py [TRUTH.json.gz ...]   (default: SOURCES)

writes `python/torchmem/estimator/data/cudnn-rnn-h200.json.gz`: per recorded call shape (`_rnn.catalogue_key`)
the workspace cuDNN asked for (training, or inference for an eval-mode module; the block size the allocator's
history records). The reserve space
needs no catalogue: `_rnn.cudnn_rnn_sizes` has its exact formula (checked against every recorded config by
tests/unit/test_rnn_sizes.py).
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The H200 grid, and a denser grid (with eval-mode modules) recorded on an H100: the same sm90, 132 SMs and
# cuDNN 9.19 as the H200
SOURCES = [
    ROOT / "tests/fixtures/rnn-h200/rnn-truth.json.gz",
    ROOT / "tests/fixtures/rnn-h100-dense/rnn-truth-dense.json.gz",
]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "bench" / "estimate"))
sys.path.insert(0, str(ROOT / "scripts"))


def main() -> int:
    import gpu_rnn_truth
    import rnn_compare
    from torchmem.estimator._rnn import CATALOGUE_PATH, grid_shape, training_workspace

    sources = [Path(a) for a in sys.argv[1:]] or SOURCES
    entries: dict[str, int] = {}
    recorded = []
    for src in sources:
        doc = json.load(gzip.open(src))
        recorded.append({"file": src.name, "device": doc["device"], "torch": doc["torch"], "cudnn": doc["cudnn"]})
        for r in doc["grid"]:
            if "events" not in r:
                continue
            ws = training_workspace(rnn_compare.split(r["events"], gpu_rnn_truth.MARK_BYTES)["forward"])
            if ws is not None:
                entries[grid_shape(r["config"]).key()] = ws
    out = {"recorded": recorded, "workspace_bytes": entries}
    CATALOGUE_PATH.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(CATALOGUE_PATH, "wt") as f:
        json.dump(out, f, sort_keys=True)
    print(f"{len(entries)} shapes -> {CATALOGUE_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
