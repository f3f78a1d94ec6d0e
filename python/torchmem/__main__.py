"""`python -m torchmem ...`: runs the `torchmem` command, the native binary of the `torchmem-cli` wheel (as `python -m
ruff` runs ruff's), with this Python as the one that runs the user's scripts (`TORCHMEM_PYTHON`).

The binary is found where pip put it: the folder of `sys.executable` (a venv's `bin/`), this interpreter's scripts
folder, the user scheme's, then PATH. The extension (`torchmem._native`) does not contain the command line, so a
profiled process never loads it."""

from __future__ import annotations

import os
import sys


def find_torchmem_bin() -> str:
    """The path of the `torchmem` binary the `torchmem-cli` wheel installed; FileNotFoundError when there is none."""
    name = "torchmem"
    # sys.executable's folder first: a venv's bin/ is its scripts folder, and this needs no sysconfig import.
    folders = [os.path.dirname(sys.executable)]
    for folder in folders:
        path = os.path.join(folder, name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    import shutil
    import sysconfig

    folders = [sysconfig.get_path("scripts")]
    user_scheme = f"{os.name}_user"
    if user_scheme in sysconfig.get_scheme_names():
        folders.append(sysconfig.get_path("scripts", scheme=user_scheme))
    for folder in folders:
        path = os.path.join(folder, name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    folders.insert(0, os.path.dirname(sys.executable))
    found = shutil.which(name)
    if found:
        return found
    raise FileNotFoundError(
        f"the `torchmem` command is not installed for {sys.executable} (looked in {', '.join(folders)} and PATH). "
        "It comes with the `torchmem-cli` package: `pip install torchmem-cli` (or, in a checkout, `scripts/dev-env.sh`)"
    )


def main() -> None:
    try:
        path = find_torchmem_bin()
    except FileNotFoundError as e:
        sys.stderr.write(f"torchmem: error: {e}\n")
        sys.exit(1)
    if sys.executable:
        os.environ.setdefault("TORCHMEM_PYTHON", sys.executable)
    os.execv(path, [path, *sys.argv[1:]])


if __name__ == "__main__":
    main()
