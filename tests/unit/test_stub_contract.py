"""`python/torchmem/_native.pyi` is the contract of the Rust extension: every name the extension exports is
in the stub and every name in the stub exists, with the same parameter names for functions."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torchmem._native as native

STUB = Path(__file__).resolve().parents[2] / "python" / "torchmem" / "_native.pyi"
TREE = ast.parse(STUB.read_text())
STUB_FUNCS = {n.name: n for n in TREE.body if isinstance(n, ast.FunctionDef)}
STUB_CLASSES = {n.name for n in TREE.body if isinstance(n, ast.ClassDef)}
# Module constants (`NAME: type`), apart from the dunder ones.
STUB_CONSTANTS = {
    n.target.id for n in TREE.body if isinstance(n, ast.AnnAssign) and not n.target.id.startswith("__")
}


def test_stub_and_extension_name_the_same_things() -> None:
    exported = {k for k in dir(native) if not k.startswith("__")}
    stub = set(STUB_FUNCS) | STUB_CLASSES | STUB_CONSTANTS
    assert exported - stub == set(), "exported but missing from _native.pyi"
    assert stub - exported == set(), "in _native.pyi but not exported"


@pytest.mark.parametrize("name", sorted(STUB_FUNCS))
def test_parameters_match(name: str) -> None:
    try:
        real = inspect.signature(getattr(native, name))
    except (TypeError, ValueError):
        pytest.skip(f"{name} has no introspectable signature")
    stub_args = STUB_FUNCS[name].args
    stub_names = [a.arg for a in stub_args.posonlyargs + stub_args.args + stub_args.kwonlyargs]
    assert list(real.parameters) == stub_names, f"{name}: extension {list(real.parameters)} vs stub {stub_names}"


STUB_CLASS_DEFS = {n.name: n for n in TREE.body if isinstance(n, ast.ClassDef)}


def _stub_members(cls: ast.ClassDef) -> set[str]:
    """The public names a stub class declares: annotated attributes, methods and properties."""
    names = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    names |= {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    return {n for n in names if not n.startswith("_")}


def _stub_init(cls: ast.ClassDef) -> ast.FunctionDef | None:
    return next((f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)


@pytest.mark.parametrize("name", sorted(STUB_CLASS_DEFS))
def test_class_members_match(name: str) -> None:
    # The class's own members (an exception's are Exception's, which the stub leaves out).
    own = {k for k in vars(getattr(native, name)) if not k.startswith("_")}
    assert own == _stub_members(STUB_CLASS_DEFS[name]), f"{name}: extension {sorted(own)} vs stub"


@pytest.mark.parametrize("name", sorted(n for n, c in STUB_CLASS_DEFS.items() if _stub_init(c)))
def test_constructor_parameters_match(name: str) -> None:
    try:
        real = inspect.signature(getattr(native, name))
    except (TypeError, ValueError):
        pytest.skip(f"{name} has no introspectable signature")
    args = _stub_init(STUB_CLASS_DEFS[name]).args  # type: ignore[union-attr]
    stub_names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs][1:]  # without self
    assert list(real.parameters) == stub_names, f"{name}: extension {list(real.parameters)} vs stub {stub_names}"
