"""GPU tests (issue 27 item 5): the former scripts/gpu_check*.py harnesses, one test per check.

Every test under tests/gpu gets the `gpu` marker; run them on a CUDA machine with `pytest -m gpu tests/gpu`
(scripts/gpu_check_all.sh does it on the device). Without a CUDA device they collect and skip with the reason.
Module-level code of these tests must not need CUDA: torch.cuda is first touched inside fixtures and tests.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
# shared helpers (leak_cases, ...) live in tests/support (moved there by issue 27 item 5) or, before the move, tests/
for _d in (TESTS / "support", TESTS):
    if _d.is_dir() and str(_d) not in sys.path:
        sys.path.insert(0, str(_d))
if str(ROOT / "scripts") not in sys.path:
    sys.path.insert(0, str(ROOT / "scripts"))

_HERE = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (tests/gpu; run with `pytest -m gpu tests/gpu`)")


def _cuda_reason() -> str | None:
    try:
        import torch
    except Exception as e:  # pragma: no cover - torch is a test dependency
        return f"torch not importable: {e}"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (torch.cuda.is_available() is False)"
    return None


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    mine = [it for it in items if _HERE in Path(str(it.path)).resolve().parents]
    if not mine:
        return
    reason = _cuda_reason()
    for it in mine:
        it.add_marker(pytest.mark.gpu)
        if reason is not None:
            it.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def torchmem_cli() -> str:
    """The `torchmem` console script (from the installed wheel), as the scripts found it."""
    exe = shutil.which("torchmem") or str(Path(sys.executable).parent / "torchmem")
    if not os.path.exists(exe):
        pytest.fail("torchmem not on PATH (install the wheel)")
    return exe


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT
