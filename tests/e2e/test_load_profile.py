"""`torchmem.load_profile`: a profile recorded by a real `torchmem run` reads back in Python with the same
summary as `torchmem report --format json`, its tables as rows and DataFrames; missing, non-profile, corrupt
and truncated files raise the documented classes with the CLI's message."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torchmem
from cli import ENV

SCRIPT = """
import time
import torchmem
mon = torchmem.Monitor(verbose=False)
keep = []
for e in range(2):
    with mon.epoch():
        for s in range(2):
            with mon.step():
                with torchmem.track("load"):
                    keep.append(bytearray(b"\\x01" * (16 << 20)))
                    time.sleep(0.03)
"""


def torchmem_cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "torchmem", *args], capture_output=True, text=True, env=ENV, timeout=300
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"torchmem {' '.join(args)} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("prof")
    script = d / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    prof = d / "train.sqlite"
    torchmem_cli("run", "-q", "-o", str(prof), str(script))
    return prof


@pytest.fixture(scope="module")
def sleeper(tmp_path_factory: pytest.TempPathFactory) -> Path:
    prof = tmp_path_factory.mktemp("sleep") / "sleep.sqlite"
    torchmem_cli("run", "-q", "-o", str(prof), "--", sys.executable, "-c", "import time; time.sleep(0.3)")
    return prof


@pytest.mark.parametrize("which", ["recorded", "sleeper"])
def test_summary_equals_the_cli_json_report(which: str, request: pytest.FixtureRequest) -> None:
    prof = request.getfixturevalue(which)
    cli = json.loads(torchmem_cli("report", "--format", "json", str(prof)).stdout)
    assert torchmem.load_profile(str(prof)).summary() == cli
    assert torchmem.load_profile(prof).summary() == cli  # a pathlib.Path works too


def test_tables_come_out_as_rows_and_dataframes(recorded: Path) -> None:
    p = torchmem.load_profile(recorded)
    assert p.path == str(recorded)
    assert p.meta["command"][-1].endswith("train.py")
    cpu = p.cpu_samples
    assert len(cpu) == p.summary()["samples"] > 0
    assert set(cpu[0]) >= {"t_ns", "rss_bytes", "pss_bytes", "process_count"}
    assert max(r["rss_bytes"] for r in cpu) == p.summary()["peak"]["cpu_rss_bytes"]
    assert [r["index"] for r in p.epochs] == [0, 1]
    assert [r["name"] for r in p.phases] == ["load"]
    assert p.phases[0]["count"] == 4
    kinds = {(m["kind"], m["edge"]) for m in p.markers}
    assert {("epoch", "start"), ("step", "end"), ("phase", "start")} <= kinds
    assert any(r["pid"] for r in p.processes)
    # The same rows through every door.
    for name in p.tables():
        cols, rows = p._data.table(name)
        assert p.rows(name) == [dict(zip(cols, r, strict=False)) for r in rows]
    df = p.to_pandas("cpu_samples")
    assert list(df.columns) == p.columns("cpu_samples")
    assert len(df) == len(cpu) and int(df["rss_bytes"].max()) == p.summary()["peak"]["cpu_rss_bytes"]
    assert p.to_pandas("epochs")["index"].tolist() == [0, 1]


def test_unknown_table_is_an_input_error(sleeper: Path) -> None:
    with pytest.raises(torchmem.InputError, match='no table "nope".*cpu_samples'):
        torchmem.load_profile(sleeper).rows("nope")


def cli_error(path: Path) -> str:
    proc = torchmem_cli("report", "--format", "json", str(path), check=False)
    assert proc.returncode != 0
    return proc.stderr


def corrupt(src: Path, dst: Path) -> None:
    data = bytearray(src.read_bytes())
    data[100:4096] = b"\xa5" * (4096 - 100)  # the header's tail and the schema page
    dst.write_bytes(bytes(data))


def truncated(src: Path, dst: Path) -> None:
    data = src.read_bytes()
    dst.write_bytes(data[: len(data) // 3])


def not_profile(src: Path, dst: Path) -> None:
    dst.write_text("name,rss\nx,1\n")


def other_sqlite(src: Path, dst: Path) -> None:
    import sqlite3

    con = sqlite3.connect(dst)
    con.execute("create table t (x)")
    con.commit()
    con.close()


@pytest.mark.parametrize("make", [corrupt, truncated, not_profile, other_sqlite])
def test_bad_files_raise_profile_error_with_the_cli_message(make, sleeper: Path, tmp_path: Path) -> None:
    bad = tmp_path / f"{make.__name__}.sqlite"
    make(sleeper, bad)
    with pytest.raises(torchmem.ProfileError) as info:
        torchmem.load_profile(bad)
    assert isinstance(info.value, ValueError) and isinstance(info.value, torchmem.TorchmemError)
    assert str(info.value) in cli_error(bad)
    assert "is not a torchmem profile" in str(info.value)


def test_missing_file_and_directory_raise_os_errors(tmp_path: Path) -> None:
    missing = tmp_path / "none.sqlite"
    with pytest.raises(FileNotFoundError) as info:
        torchmem.load_profile(missing)
    assert info.value.errno == 2
    assert info.value.strerror in cli_error(missing)
    with pytest.raises(IsADirectoryError, match="is a directory, not a profile file"):
        torchmem.load_profile(tmp_path)


def test_profile_still_loads_after_copy(sleeper: Path, tmp_path: Path) -> None:
    # A copy (what users mail around) reads the same; only the path differs.
    copy = tmp_path / "copy.sqlite"
    shutil.copy(sleeper, copy)
    a, b = torchmem.load_profile(sleeper).summary(), torchmem.load_profile(copy).summary()
    assert a.pop("profile") != b.pop("profile") and a == b
