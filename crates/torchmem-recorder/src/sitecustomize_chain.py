# The end of every sitecustomize.py torchmem places first on PYTHONPATH (`launch::sitecustomize`): hands over
# to the next sitecustomize on sys.path (the environment's own, which ours shadows), if there is one.
import importlib.util as _tm_util
import os as _tm_os
import sys as _tm_sys

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
