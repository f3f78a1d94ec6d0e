"""`torchmem info`'s wall time (issue 28, newcomer probe UGLY 7): it used to import torch in a child Python to
print torch's version (as slow as `import torch`); it now reads `torch/version.py` without importing torch.
Side by side, interleaved, in one run:

    .venv/bin/python bench/info_speed.py [--n 11]

- `torchmem info` as it is now;
- the child the old `info` ran (`import torch` and print its version): the old `info` paid this plus the rest;
- the child the new `info` runs (`python/torchmem/_torch_version.py`);
- `python -c pass`, the floor of any Python start.

Prints each one's median and min–max in ms, and the ratio of `torchmem info` to `import torch`."""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
OLD_CHILD = (
    "import json\ntry:\n    import torch\n    print(json.dumps([torch.__version__, torch.version.cuda]))\n"
    "except ImportError as e:\n    print(json.dumps(['', str(e)]))\n"
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=11)
    n = ap.parse_args().n
    env = dict(os.environ, TORCHMEM_PYTHON=sys.executable)
    py = sys.executable
    commands = {
        "torchmem info (now)": [str(VENV_BIN / "torchmem"), "info"],
        "old info's child: import torch": [py, "-c", OLD_CHILD],
        "new info's child: _torch_version.py": [py, str(ROOT / "python" / "torchmem" / "_torch_version.py")],
        "python -c pass": [py, "-c", "pass"],
    }
    times: dict[str, list[float]] = {k: [] for k in commands}
    for _ in range(n):  # interleaved, so load on the machine hits every command alike
        for name, cmd in commands.items():
            t0 = time.perf_counter()
            subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, env=env)
            times[name].append((time.perf_counter() - t0) * 1e3)
    print(f"median of {n} (min-max), ms")
    for name, t in times.items():
        print(f"  {name:<40} {statistics.median(t):8.1f}  ({min(t):.1f}-{max(t):.1f})")
    info = statistics.median(times["torchmem info (now)"])
    torch_ms = statistics.median(times["old info's child: import torch"])
    print(f"torchmem info / import torch: {info / torch_ms:.3f}")


if __name__ == "__main__":
    main()
