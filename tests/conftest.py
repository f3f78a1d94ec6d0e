"""Test order: the estimator's in-process tests run first. The autograd engine sets up its device threads once,
at the first backward of a process; after a CPU backward (test_breakdown, test_monitor, ...) it has none for
CUDA, and the estimator's emulated CUDA device cannot make backward run in that process any more (the
estimator says so; `torchmem estimate script.py` always runs in a fresh process)."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    in_process = ("test_estimate.py", "test_estimate_usecase.py")
    first = [it for it in items if any(it.nodeid.startswith(f"tests/{f}") or f"{f}::" in it.nodeid for f in in_process)]
    if first:
        rest = [it for it in items if it not in first]
        items[:] = first + rest
