"""Builds the estimator's cuDNN convolution catalogue (`python/torchmem/estimator/data/cudnn-conv-h200.json.gz`)
from the H200 recording of `scripts/gpu_op_workspaces.py` (`tests/fixtures/op-workspaces-h200/`). Runs on any
machine (no GPU, no torch).

Usage: ``python scripts/build_conv_catalogue.py [RECORDING.json[.gz] ... OUT.json.gz]`` (default: every
recording in the fixture folder, into the package).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("_workspaces", ROOT / "python/torchmem/estimator/_workspaces.py")
_ws = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_ws)


def main() -> None:
    fixtures = ROOT / "tests/fixtures/op-workspaces-h200"
    sources = [Path(a) for a in sys.argv[1:-1]] if len(sys.argv) > 2 else sorted(fixtures.glob("*.json.gz"))
    dst = Path(sys.argv[-1]) if len(sys.argv) > 2 else _ws.CATALOGUE_PATH
    recordings = []
    for src in sources:
        opener = gzip.open if src.suffix == ".gz" else open
        with opener(src, "rt") as f:
            recordings.append(json.load(f))
    catalogue = _ws.build_catalogue(*recordings)
    dst.parent.mkdir(parents=True, exist_ok=True)
    with gzip.GzipFile(dst, "wb", compresslevel=9, mtime=0) as f:
        f.write(json.dumps(catalogue, sort_keys=True, separators=(",", ":")).encode())
    n = sum(len(v) for v in catalogue["convolutions"].values())
    print(
        f"{dst}: {len(catalogue['convolutions'])} convolution keys, {n} (key, batch) templates"
        f" from {len(sources)} recordings"
    )


if __name__ == "__main__":
    main()
