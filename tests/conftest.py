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


# The slow group (`-m slow`, run by test.sh after the other layers): the long truth replays (traces and fit
# searches against the H200's recordings) and the long runs, each 25-80 s on the 2-core CI VM. Named here, in one
# place, as "file::test" (every parameter of a test); a name that no longer matches a test of a collected file is
# an error, so the list cannot go stale silently.
SLOW = (
    "e2e/test_conv_workspaces.py::test_resnet18_trace_equals_the_h200_recording_request_by_request",
    "e2e/test_conv_workspaces.py::test_gpt2_backward_requests_equal_the_h200_recording",
    "e2e/test_conv_workspaces.py::test_request_identical_traces_simulate_to_the_h200_reserved_peak",
    "e2e/test_conv_workspaces.py::test_resnet50_at_the_h200s_fit_edge",
    "e2e/test_distributed_truth.py::test_every_class_of_a_job_matches_the_h100_truth",
    "e2e/test_estimate_compile.py::test_the_h100_truth_of_compiled_nanogpt",
    "e2e/test_estimate_corpus.py::test_corpus_script_against_the_gpu",
    "e2e/test_estimate_corpus.py::test_deepcopy_of_a_module_with_batchnorm_before_cuda",
    "e2e/test_estimate.py::test_fit_finds_the_largest_batch",
    "e2e/test_estimate_distributed.py::test_uneven_shards_make_rank_classes_each_traced",
    "e2e/test_estimate_distributed.py::test_pipeline_stages_are_classes_and_gpipe_holds_more_microbatches_than_1f1b",
    "e2e/test_estimate_inference.py::test_fit_finds_the_largest_eval_batch",
    "e2e/test_long_run.py::test_a_long_fast_run_keeps_few_markers_and_exact_totals",
    "e2e/test_monitor_long.py::test_monitor_memory_stays_flat_over_many_steps",
)


def _slow_key(item: pytest.Item) -> str | None:
    try:
        rel = Path(str(item.path)).resolve().relative_to(TESTS)
    except ValueError:
        return None
    return f"{rel.as_posix()}::{getattr(item, 'originalname', item.name)}"


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    seen_files, seen_slow = set(), set()
    for it in items:
        layer = layer_of(it)
        if layer is not None:
            it.add_marker(getattr(pytest.mark, layer))
        key = _slow_key(it)
        if key is not None:
            seen_files.add(key.split("::")[0])
            if key in SLOW:
                it.add_marker(pytest.mark.slow)
                seen_slow.add(key)
    stale = [k for k in SLOW if k.split("::")[0] in seen_files and k not in seen_slow]
    whole_files = not any("::" in a for a in config.args) and not config.getoption("keyword")
    if stale and whole_files and not config.getoption("deselect"):
        raise pytest.UsageError(f"tests/conftest.py SLOW names tests that do not exist: {stale}")
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
