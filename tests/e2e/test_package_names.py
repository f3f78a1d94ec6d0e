"""No submodule of `torchmem` carries the name of an exported function: importing any submodule (as
`load_profile`, `simulate` or `estimate` do on first use) must never turn `torchmem.profile` & co. into a module.
Runs each check in a fresh interpreter, since the package's attribute cache is per process."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import torchmem


def _exported_callables() -> list[str]:
    return [n for n in torchmem.__all__ if n[0].islower() and not n.startswith("__")]


def test_no_submodule_is_named_like_an_exported_name() -> None:
    submodules = {m.name for m in pkgutil.iter_modules(torchmem.__path__)}
    clashes = sorted(submodules & set(torchmem.__all__))
    assert clashes == [], f"submodules named like exported names: {clashes}"


def test_exported_functions_stay_callable_after_every_submodule_is_imported() -> None:
    names = _exported_callables()
    code = f"""
import importlib, pkgutil, torchmem
for m in pkgutil.iter_modules(torchmem.__path__):
    if m.name in ("__main__", "_jupyter", "pytest_plugin"):
        continue  # the CLI itself; need IPython / pytest: imported by their hosts
    importlib.import_module("torchmem." + m.name)
torchmem.load_profile  # resolves the lazily loaded names after the imports
bad = [n for n in {names!r} if not callable(getattr(torchmem, n))]
print(bad)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_profile_decorator_works_after_load_profile_and_simulate_are_used() -> None:
    code = """
import torchmem, torchmem.simulation, torchmem.recorded_profile
torchmem.load_profile, torchmem.simulate
@torchmem.profile
def f():
    return bytearray(1 << 20)
f()
print("CALLABLE", callable(torchmem.profile), callable(torchmem.simulate), callable(torchmem.load_profile))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "CALLABLE True True True" in out.stdout, out.stdout
