"""Tests of torchmem's pytest plugin (torchmem.pytest_plugin, loaded through its `pytest11` entry point): real
test files run by pytester with real allocations (torch CPU tensors), in process, under pytest-xdist, and a
check that loading the plugin imports neither torch nor torchmem's extension."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import textwrap

import pytest
import torch
import torchmem.api  # noqa: F401
import torchmem.monitor  # noqa: F401
import torchmem.snapshot  # noqa: F401
from torchmem.pytest_plugin import parse_size

# pytester's in-process runs drop from sys.modules what was first imported inside them: torchmem's modules are
# loaded above so that every later test of this session shares one torchmem.api (its peak windows and marker
# sinks are module state; a second copy would split a Monitor from the phases it should see).

pytest_plugins = ["pytester"]

CUDA = torch.cuda.is_available()

TESTS = """
import pytest, torch

KEEP = []


def make_big():
    return torch.ones(16 << 20)


@pytest.mark.limit_memory("32 MiB", device="cpu")
def test_over():
    x = make_big()
    del x


@pytest.mark.limit_memory("256 MiB", device="cpu", kind="rss")
def test_under():
    x = make_big()
    del x


@pytest.mark.limit_leaks("16 MiB", device="cpu")
def test_leaks():
    KEEP.append(make_big())


@pytest.mark.limit_leaks("16 MiB", device="cpu")
def test_frees():
    x = make_big()
    del x
"""


def test_entry_point_is_registered():
    eps = importlib.metadata.entry_points(group="pytest11")
    assert {ep.name: ep.value for ep in eps}.get("torchmem") == "torchmem.pytest_plugin"


def test_loading_the_plugin_imports_neither_torch_nor_the_extension(pytester):
    code = (
        "import sys, torchmem.pytest_plugin\n"
        "bad = [m for m in ('torch', 'torchmem._native', 'numpy') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    # A whole pytest run of a torch-free project with the plugin auto-loaded: still no torch.
    pytester.makepyfile(
        test_plain="""
        import sys
        def test_no_torch():
            assert "torch" not in sys.modules
            assert "torchmem._native" not in sys.modules
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_limits_fail_with_peak_limit_and_sites(pytester):
    pytester.makepyfile(test_mem=TESTS)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=2)
    out = result.stdout.str()
    reports = {
        r.nodeid.split("::")[1]: r for r in result.reprec.getreports("pytest_runtest_logreport") if r.when == "call"
    }
    over = reports["test_over"]
    assert over.failed
    text = str(over.longrepr)
    assert "torchmem limit_memory: peak rss" in text and "exceeds the limit of 32.00 MiB" in text
    section = dict(over.sections)["torchmem"]
    # The 64 MiB tensor is charged to the line that made it, with the test's line as its caller.
    first_site = section.splitlines()[1]
    assert "test_mem.py:" in first_site and "in make_big  `return torch.ones(16 << 20)`" in first_site, section
    assert "in test_over  `x = make_big()`" in section.splitlines()[2]
    grown_mib = float(first_site.split()[0].lstrip("+"))
    assert 48 <= grown_mib <= 80, first_site
    leak = reports["test_leaks"]
    assert leak.failed and "64." in str(leak.longrepr) and "still held" in str(leak.longrepr)
    assert reports["test_under"].passed and reports["test_frees"].passed
    # The status letter, the short summary word and the end-of-run table.
    assert "MEMORY LIMIT test_mem.py::test_over" in out
    assert "torchmem memory limits" in out
    table = out[out.index("torchmem memory limits") :]
    assert "OVER  peak rss on cpu" in table and "test_mem.py::test_under" in table


def test_under_xdist(pytester):
    pytester.makepyfile(test_mem=TESTS)
    result = pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=2)
    out = result.stdout.str()
    assert "MEMORY LIMIT test_mem.py::test_over" in out and "MEMORY LIMIT test_mem.py::test_leaks" in out
    assert "in make_big  `return torch.ones(16 << 20)`" in out  # the section came back from the worker
    table = out[out.index("torchmem memory limits") : out.index("short test summary")]
    assert table.count("test_mem.py::") == 4  # every worker's results reached the controller's table


def test_cuda_marker_without_a_gpu_is_skipped_with_a_reason(pytester):
    pytester.makepyfile(
        test_gpu="""
        import pytest, torch

        @pytest.mark.limit_memory("1 GiB")
        def test_gpu():
            x = torch.ones(1 << 20, device="cuda")

        @pytest.mark.limit_leaks("1 MiB", device="cuda:0")
        def test_gpu_leaks():
            pass
        """
    )
    result = pytester.runpytest("-rs", "-p", "no:cacheprovider")
    if CUDA:
        result.assert_outcomes(passed=2)
    else:
        result.assert_outcomes(skipped=2)
        result.stdout.fnmatch_lines(["*cuda memory limit: no CUDA device (torch.cuda.is_available() is False)*"])


@pytest.mark.parametrize(
    "marker, message",
    [
        ('limit_memory("2 GB", device="cpu", kind="allocated")', "PyTorch keeps no allocated counter for the CPU"),
        ('limit_memory("2 gigs", device="cpu")', 'unknown unit "gigs"'),
        ('limit_memory("2 GiB", device="gpu")', "expected 'cuda', 'cuda:N' or 'cpu'"),
        ('limit_leaks("2 GiB", kind="reserved")', "reserved memory is the allocator's cache, not a leak"),
        ('limit_memory("1 GiB", devcie="cpu")', "unknown argument(s) ['devcie']"),
        ("limit_memory()", "takes one limit"),
    ],
)
def test_bad_markers_are_errors_that_say_the_fix(pytester, marker, message):
    pytester.makepyfile(
        test_bad=f"""
        import pytest

        @pytest.mark.{marker}
        def test_it():
            pass
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    assert message in result.stdout.str()


def test_markers_are_registered_for_strict_markers(pytester):
    pytester.makepyfile(
        test_strict="""
        import pytest

        @pytest.mark.limit_memory("1 GiB", device="cpu")
        def test_it():
            pass
        """
    )
    pytester.runpytest("--strict-markers", "-p", "no:cacheprovider").assert_outcomes(passed=1)


def test_parse_size():
    assert parse_size("2 GiB") == 2 << 30
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("1.5 GiB") == 3 << 29
    assert parse_size("24 MB") == 24_000_000
    assert parse_size("100 B") == 100
    assert parse_size(4096) == 4096
    # One parser with the CLI's `--memory-limit`: "2g" is 2 GiB there and here; a bare "2" is refused.
    assert parse_size("2 G") == parse_size("2g") == 2 << 30
    for bad in ("2", "2 gigs", "two GiB", "-1 GiB", "", True, None, 2.5):
        with pytest.raises(ValueError, match="memory limit"):
            parse_size(bad)


def test_a_test_that_resets_torchs_peak_still_gets_its_true_peak(pytester):
    """torchmem's windows fold the peak before any reset; on the CPU the RSS high-water mark is the kernel's,
    which a test cannot reset through torch: the 64 MiB peak before the test frees it still counts."""
    pytester.makepyfile(
        test_reset=textwrap.dedent(
            """
            import pytest, torch, torchmem

            @pytest.mark.limit_memory("32 MiB", device="cpu")
            def test_reset():
                x = torch.ones(16 << 20)
                del x
                torchmem.reset_peak()
            """
        )
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
