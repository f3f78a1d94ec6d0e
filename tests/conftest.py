"""The layers of the suite (DEVELOPERS.md, "Tests"): every test gets the marker of its folder, so `-m unit`,
`-m e2e`, `-m frameworks` and `-m gpu` pick a layer (`pytest tests/unit` does the same by path). The shared
helpers live in tests/support, on pytest's pythonpath (pyproject.toml).

No test depends on the order (the suite runs under pytest-xdist, `-n auto`). One process-wide fact needed care:
the autograd engine sets up its device threads once, at the first backward of a process; after a CPU backward it
has none for CUDA, and the estimator's emulated CUDA device cannot make backward run in that process any more
(the estimator says so; `torchmem estimate script.py` always runs in a fresh process). Every test process that
will run in-process estimator tests (IN_PROCESS_ESTIMATES) therefore installs the estimator's backward fix before
its first test, whatever it runs first: the same one tiny fake-CUDA backward that the first in-process estimate
does (`torchmem.estimator._device.install_backward_fix`, idempotent). Before, the suite got the same state by
running test_estimate.py and test_estimate_usecase.py first; now no order is needed."""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
LAYERS = ("unit", "e2e", "frameworks", "gpu")


def layer_of(item: pytest.Item) -> str | None:
    try:
        rel = Path(str(item.path)).resolve().relative_to(TESTS)
    except ValueError:
        return None
    return rel.parts[0] if len(rel.parts) > 1 and rel.parts[0] in LAYERS else None


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    for it in items:
        layer = layer_of(it)
        if layer is not None:
            it.add_marker(getattr(pytest.mark, layer))
    if any(Path(str(it.path)).name.startswith(IN_PROCESS_ESTIMATES) for it in items):
        _ready_autograd_for_the_emulated_device()


# The files whose tests trace on the emulated device in the test process (torchmem.estimate(), Session).
IN_PROCESS_ESTIMATES = ("test_estimate", "test_conv_workspaces")


def _ready_autograd_for_the_emulated_device() -> None:
    """The estimator's backward fix, installed before any test of this process runs a backward (see above).
    Without torch or with a real GPU (where those tests skip) there is nothing to do; a failure to install is
    left to the estimator tests, which then fail with the estimator's own message."""
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available():
        return
    try:
        from torchmem.estimator import _device, _session

        _device.install_backward_fix(_session._new_mode)
    except Exception:  # noqa: BLE001 - reported by the estimator tests themselves
        pass
