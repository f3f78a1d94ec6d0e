# Placed first on PYTHONPATH by `torchmem run` (`session`): loads torchmem's in-process part into the profiled
# program with no change to its code; `launch::sitecustomize` appends the hand-over to any sitecustomize the
# environment already had.
import os as _tm_os
import sys as _tm_sys

try:
    import torchmem._bootstrap as _tm_bootstrap

    _tm_bootstrap.start()
except ImportError as _tm_err:
    if _tm_os.environ.get("TORCHMEM_WARNED") != "1":
        _tm_os.environ["TORCHMEM_WARNED"] = "1"
        _tm_sys.stderr.write(
            f"torchmem: this Python ({_tm_sys.executable}) cannot import torchmem ({_tm_err}); recording memory "
            "from outside only (no allocator timeline or phases). Install torchmem into it to get them.\n"
        )
