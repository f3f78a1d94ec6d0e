# Placed first on PYTHONPATH by `torchmem run`: loads torchmem's in-process part into the profiled program
# with no change to its code, then hands over to any sitecustomize the environment already had.
import importlib.util as _tm_util
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

# Chain to the next sitecustomize on sys.path, if there is one.
_tm_here = _tm_os.path.dirname(_tm_os.path.abspath(__file__))
for _tm_dir in _tm_sys.path:
    if not _tm_dir or _tm_os.path.abspath(_tm_dir) == _tm_here:
        continue
    _tm_path = _tm_os.path.join(_tm_dir, "sitecustomize.py")
    if _tm_os.path.isfile(_tm_path):
        _tm_spec = _tm_util.spec_from_file_location("_torchmem_next_sitecustomize", _tm_path)
        if _tm_spec and _tm_spec.loader:
            _tm_spec.loader.exec_module(_tm_util.module_from_spec(_tm_spec))
        break
