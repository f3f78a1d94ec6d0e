"""The exception hierarchy of `_native.pyi` (crates/torchmem-py/src/errors.rs): each bad input raises its
documented class, bad input is a `ValueError` (so `except ValueError` keeps working), I/O failures are the
matching `OSError` subclass, and the classes are importable and picklable from `torchmem`."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torchmem
from torchmem import _native
from torchmem import snapshot as tm_snapshot

SNAP = Path(__file__).resolve().parents[1] / "fixtures" / "snapshots"


def a_snapshot() -> Path:
    return next(p for p in sorted(SNAP.iterdir()) if p.suffix in (".pickle", ".pkl"))


CASES = [
    ("marker not a Marker", lambda tmp: _native.MarkerLog().push({"kind": "step"}), torchmem.InputError),
    ("journey format", lambda tmp: _native.MarkerLog().journey(None, "svg"), torchmem.InputError),
    ("sampler interval", lambda tmp: _native.start_allocator_sampler(-1.0), torchmem.InputError),
    ("explain_oom not an OOM", lambda tmp: _native.explain_oom("hello"), torchmem.OomParseError),
    ("emit_marker kind", lambda tmp: _native.emit_marker(0, "nope", "start", "x", None, {}, None), torchmem.InputError),
    ("emit_marker edge", lambda tmp: _native.emit_marker(0, "step", "nope", "x", None, {}, None), torchmem.InputError),
    ("line_start hook", lambda tmp: _native.line_start("nope", None, None), torchmem.InputError),
    ("line_render_text payload", lambda tmp: _native.line_render_text("{"), torchmem.InputError),
    ("simulate no input", lambda tmp: _native.simulate(), torchmem.InputError),
    ("simulate missing", lambda tmp: _native.simulate(path=str(tmp / "none.pickle")), FileNotFoundError),
    (
        "simulate bad conf",
        lambda tmp: _native.simulate(path=str(a_snapshot()), alloc_conf="nonsense:1"),
        torchmem.InputError,
    ),
    ("snapshot bytes", lambda tmp: _native.snapshot_summary_bytes(b"\x80\x04garbage"), torchmem.SnapshotError),
    ("snapshot file", lambda tmp: _native.snapshot_text(str(tmp / "x.sqlite"), 1), torchmem.SnapshotError),
    ("snapshot missing", lambda tmp: _native.snapshot_text(str(tmp / "none.pickle"), 1), FileNotFoundError),
    ("snapshot summary missing", lambda tmp: tm_snapshot.summary(tmp / "none.pickle"), FileNotFoundError),
    (
        "snapshot HTML of a missing file",
        lambda tmp: _native.snapshot_html(str(tmp / "none.pickle"), str(tmp / "r.html")),
        FileNotFoundError,
    ),
    ("profile missing", lambda tmp: _native.open_profile(str(tmp / "none.sqlite")), FileNotFoundError),
    ("profile directory", lambda tmp: _native.open_profile(str(tmp)), IsADirectoryError),
    ("profile not a profile", lambda tmp: _native.open_profile(str(tmp / "x.sqlite")), torchmem.ProfileError),
    (
        "HTML into a missing directory",
        lambda tmp: _native.snapshot_html(str(a_snapshot()), str(tmp / "no" / "such" / "r.html")),
        FileNotFoundError,
    ),
    (
        "HTML onto a directory",
        lambda tmp: _native.snapshot_html(str(a_snapshot()), str(tmp)),
        IsADirectoryError,
    ),
]


@pytest.mark.parametrize("call,cls", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_each_bad_input_raises_its_documented_class(call, cls, tmp_path: Path) -> None:
    (tmp_path / "x.sqlite").write_text("plain text, not SQLite nor a snapshot\n")
    with pytest.raises(cls) as info:
        call(tmp_path)
    e = info.value
    assert type(e) is cls, f"{type(e).__mro__} is not exactly {cls}"
    if issubclass(cls, torchmem.TorchmemError):
        assert isinstance(e, ValueError), "bad input must stay a ValueError"
    else:
        assert isinstance(e, OSError) and not isinstance(e, torchmem.TorchmemError)
    assert str(e), "an error without a message"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_html_write_permission_denied_is_permission_error(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    with pytest.raises(PermissionError) as info:
        _native.snapshot_html(str(a_snapshot()), str(ro / "r.html"))
    assert info.value.filename == str(ro / "r.html")


def test_hierarchy() -> None:
    assert torchmem.TorchmemError.__bases__ == (Exception,)
    for cls in (torchmem.InputError, torchmem.ProfileError, torchmem.SnapshotError):
        assert cls.__bases__ == (torchmem.TorchmemError, ValueError), cls
    assert torchmem.OomParseError.__bases__ == (torchmem.InputError,)
    for cls in (torchmem.InputError, torchmem.OomParseError, torchmem.ProfileError, torchmem.SnapshotError):
        assert cls.__module__ == "torchmem" and cls.__doc__
        e = pickle.loads(pickle.dumps(cls("m")))
        assert type(e) is cls and str(e) == "m"
