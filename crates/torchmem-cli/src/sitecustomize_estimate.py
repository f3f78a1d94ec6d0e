# Placed first on PYTHONPATH by `torchmem estimate`: runs the program on an emulated CUDA device and traces it
# (torchmem.estimator._runner); `launch::sitecustomize` appends the hand-over to the next sitecustomize on
# sys.path.
import os as _tm_os
import sys as _tm_sys

try:
    import torchmem.estimator._runner as _tm_runner
except ImportError as _tm_err:
    # One message for `torchmem estimate` to print, then a quiet exit: sys.exit here would make Python print
    # "Fatal Python error: init_import_site" and a traceback.
    _tm_name = (getattr(_tm_err, "name", None) or "").split(".")[0]
    _tm_what = "torch" if _tm_name == "torch" else "torchmem"
    _tm_msg = (
        f"this Python ({_tm_sys.executable}) cannot import {_tm_what} ({_tm_err}), and the estimate runs the "
        f"program with torchmem and torch. Install {_tm_what} into it (`{_tm_sys.executable} -m pip install "
        f"{_tm_what}`), or run the program with a Python that has both"
    )
    try:
        import json as _tm_json

        with open(_tm_json.loads(_tm_os.environ["TORCHMEM_ESTIMATE"])["startup_error"], "w") as _tm_f:
            _tm_f.write(_tm_msg)
    except Exception:
        _tm_sys.stderr.write(f"torchmem estimate: {_tm_msg}\n")
    _tm_sys.stderr.flush()
    _tm_os._exit(3)
_tm_runner.start_from_env()
