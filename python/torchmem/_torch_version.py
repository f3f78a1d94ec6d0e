"""torch's version and CUDA build read from its `torch/version.py`, without importing torch (importing it takes
seconds). The one source of `torchmem info`'s torch line (the CLI runs this file's text in the user's Python)
and of `device_info()`'s `torch_version`: the full string `torch.__version__` gives (`2.x.y+cu132`), which the
installed metadata may lack (a wheel from a local index says `2.x.y`)."""

from __future__ import annotations

import ast
import importlib.util
import json
import os


def _missing(path: str | None, error: str) -> dict:
    return {"torch_version": None, "torch_cuda_version": None, "torch_path": path, "error": error}


def read() -> dict:
    """{'torch_version': '2.x.y+cuXYZ', 'torch_cuda_version': '13.2' or None, 'torch_path': ..., 'error': None},
    or the `error` saying why there is no torch to read."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError) as e:
        spec, err = None, str(e)
    else:
        err = "No module named 'torch'"
    if spec is None or not spec.submodule_search_locations:
        return _missing(None, err)
    path = os.path.join(list(spec.submodule_search_locations)[0], "version.py")
    values: dict = {}
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in tree.body:
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AnnAssign):
                targets = [node.target]
            else:
                continue
            for t in targets:
                if isinstance(t, ast.Name) and t.id in ("__version__", "cuda") and node.value is not None:
                    try:
                        values[t.id] = ast.literal_eval(node.value)
                    except ValueError:
                        pass
    except (OSError, SyntaxError) as e:
        return _missing(path, f"cannot read {path}: {e}")
    version = values.get("__version__")
    if not isinstance(version, str):
        return _missing(path, f"no __version__ in {path}")
    cuda = values.get("cuda")
    return {
        "torch_version": version,
        "torch_cuda_version": cuda if isinstance(cuda, str) else None,
        "torch_path": path,
        "error": None,
    }


if __name__ == "__main__":
    print(json.dumps(read()))
