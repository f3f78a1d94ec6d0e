"""The layers of the suite (DEVELOPERS.md, "Tests"): every test gets the marker of its folder, so `-m unit`,
`-m e2e`, `-m frameworks` and `-m gpu` pick a layer (`pytest tests/unit` does the same by path). The shared
helpers live in tests/support, on pytest's pythonpath (pyproject.toml).

Test order: the estimator's in-process tests run first. The autograd engine sets up its device threads once,
at the first backward of a process; after a CPU backward (test_breakdown, test_monitor, ...) it has none for
CUDA, and the estimator's emulated CUDA device cannot make backward run in that process any more (the
estimator says so; `torchmem estimate script.py` always runs in a fresh process)."""

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
    in_process = ("test_estimate.py", "test_estimate_usecase.py")
    first = [it for it in items if any(f"{f}::" in it.nodeid for f in in_process)]
    if first:
        rest = [it for it in items if it not in first]
        items[:] = first + rest
