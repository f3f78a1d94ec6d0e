"""`torchmem explain-oom` through the real command line (`python -m torchmem`, the console script's path):
one fixture per PyTorch wording (torch <= 2.0, 2.0 with a memory fraction, 2.1, >= 2.2, containers, XPU,
MPS, CPU) under tests/fixtures/oom/, logs with several messages (DDP ranks, a 1.x message then a 2.x one),
non-UTF-8 input on stdin, in a file and as an argument, a log file's path, and version-aware advice."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "oom"
GIB = 1 << 30
MIB = 1 << 20


def cli(*args: str | bytes, stdin: bytes | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [os.fsencode(sys.executable), b"-m", b"torchmem", *(os.fsencode(a) for a in args)],
        capture_output=True,
        input=stdin,
        timeout=120,
        cwd=cwd,
    )


def explain_json(name: str) -> Any:
    r = cli("explain-oom", "-", "--json", stdin=(FIX / name).read_bytes())
    assert r.returncode == 0, r.stderr.decode()
    return json.loads(r.stdout)


def size(text: str) -> int:
    num, unit = text.split()
    return round(float(num) * {"MiB": MIB, "GiB": GIB, "MB": MIB, "GB": GIB}[unit])


# (fixture, backend, wording, verdict, requested, total, free, allocated, reserved-unallocated)
CASES = [
    ("m22.txt", "cuda", "torch_ge2_2", "fragmentation", "2.00 GiB", "79.15 GiB", "1.50 GiB", "70.00 GiB", "7.13 GiB"),
    ("m21.txt", "cuda", "torch2_1", "fragmentation", "2.00 GiB", "79.15 GiB", "1.50 GiB", "71.00 GiB", "6.00 GiB"),
    ("m1x.txt", "cuda", "torch_le2_0", "fragmentation", "20.00 MiB", "10.76 GiB", "11.12 MiB", "9.66 GiB", None),
    ("m_allowed.txt", "cuda", "torch_le2_0", "capacity", "1.00 GiB", "8.00 GiB", "7.00 GiB", "7.50 GiB", None),
    ("m_xpu.txt", "xpu", "xpu", "undetermined", "2.00 GiB", "64.00 GiB", None, "60.00 GiB", "1.50 GiB"),
    ("m_mps.txt", "mps", "mps", "mps_limit", "256.00 MB", "18.13 GB", None, "18.04 GB", None),
    ("m_cpu.txt", "cpu", "cpu", "host_memory", None, None, None, None, None),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_each_wording_is_parsed_and_explained(case: tuple[Any, ...]) -> None:
    name, backend, wording, verdict, req, total, free, allocated, unallocated = case
    d = explain_json(name)
    n = d["numbers"]
    assert (n["backend"], n["wording"], d["verdict"]) == (backend, wording, verdict), d["explanation"]
    if req is not None:
        assert n["requested_bytes"] == size(req)
    if total is not None:
        assert n["total_bytes"] == size(total)
    # Unknown stays unknown (null), never a fake 0.
    assert n["free_bytes"] == (size(free) if free else None)
    assert n["allocated_bytes"] == (size(allocated) if allocated else None)
    if unallocated is not None:
        assert n["reserved_unallocated_bytes"] == size(unallocated)
    text = cli("explain-oom", str(FIX / name)).stdout.decode()
    assert f"Diagnosis: {verdict}" in text
    if free is None and backend not in ("cpu", "mps"):
        assert "unknown" in text


def test_old_wording_reserved_and_cpu_request() -> None:
    n = explain_json("m1x.txt")["numbers"]
    assert n["reserved_unallocated_bytes"] == size("9.73 GiB") - size("9.66 GiB")
    assert explain_json("m_cpu.txt")["numbers"]["requested_bytes"] == 1 << 40


def test_unknown_free_is_shown_as_unknown_never_zero() -> None:
    text = cli("explain-oom", "-", stdin=(FIX / "m_xpu.txt").read_bytes()).stdout.decode()
    assert "free 0 B" not in text
    assert re.search(r"device free +unknown", text), text
    assert "free memory is unknown" in text


def test_advice_fits_the_torch_version_of_the_wording() -> None:
    old = explain_json("m1x.txt")
    new = explain_json("m22.txt")
    assert "expandable_segments" in new["next_steps"][0]
    # expandable_segments arrived in torch 2.1: never step 1 for a <= 2.0 message.
    assert all("expandable_segments:True (before" not in s for s in old["next_steps"])
    assert old["verdict"] == "fragmentation"
    assert "max_split_size_mb" in old["next_steps"][0] and "expandable_segments" not in old["next_steps"][0]
    assert any("torch ≥ 2.1" in s for s in old["next_steps"])
    allowed = explain_json("m_allowed.txt")
    assert any("memory fraction" in s for s in allowed["notes"])
    assert any("set_per_process_memory_fraction" in s for s in allowed["next_steps"])


def test_container_form_finds_this_process_and_counts_the_others() -> None:
    d = explain_json("m_container.txt")
    n = d["numbers"]
    assert n["this_process_pid"] == 2222
    assert n["process_bytes"] == size("36.60 GiB")
    assert sorted(p[0] for p in n["other_processes"]) == [1111, 3333]
    assert d["verdict"] == "other_processes"
    assert abs(d["other_processes_bytes"] - size("40.05 GiB")) < 16
    text = cli("explain-oom", str(FIX / "m_container.txt")).stdout.decode()
    for pid in ("1111", "2222", "3333"):
        assert f"pid {pid}" in text
    assert "this process" in text and "other process" in text
    # The same numbers with a "this process" line give the same others.
    mix = explain_json("m_mix.txt")
    assert mix["verdict"] == "other_processes" and mix["numbers"]["other_processes"] == [[1111, 40 * GIB]]


def test_container_form_that_cannot_tell_says_so_and_still_counts_the_others() -> None:
    # 40.00 and 36.60 GiB are both >= the reserved 36 GiB: either could be this process.
    d = explain_json("m_other.txt")
    assert d["numbers"]["this_process_pid"] is None
    assert any("cannot tell" in s for s in d["notes"])
    assert d["other_processes_at_least"] is True and d["other_processes_bytes"] == size("36.60 GiB")
    assert d["verdict"] == "other_processes", d["explanation"]
    assert not any("Reduce the batch size" in s for s in d["next_steps"])
    text = cli("explain-oom", "-", stdin=(FIX / "m_other.txt").read_bytes()).stdout.decode()
    assert "pid 1111" in text and "pid 2222" in text and "cannot tell" in text


def test_impossible_numbers_get_a_note() -> None:
    d = explain_json("m_impossible.txt")
    assert any("impossible" in s and "free" in s for s in d["notes"])


def test_two_messages_are_split_and_never_mixed() -> None:
    log = (FIX / "m1x.txt").read_bytes() + b"retry with a new version\n" + (FIX / "m22.txt").read_bytes()
    r = cli("explain-oom", "-", "--json", stdin=log)
    assert r.returncode == 0, r.stderr.decode()
    a, b = json.loads(r.stdout)
    assert (a["message_index"], b["message_index"]) == (1, 2)
    assert (a["numbers"]["requested_bytes"], a["numbers"]["total_bytes"]) == (20 * MIB, size("10.76 GiB"))
    assert (b["numbers"]["requested_bytes"], b["numbers"]["total_bytes"]) == (2 * GIB, size("79.15 GiB"))
    text = cli("explain-oom", "-", stdin=log).stdout.decode()
    assert "2 out-of-memory messages" in text and "Message 2 of 2" in text
    first, second = text.split("=== Message 2 of 2")
    assert "20.00 MiB" in first and "79.15 GiB" not in first
    assert "10.76 GiB" not in second


def test_ddp_log_explains_every_rank() -> None:
    r = cli("explain-oom", "-", "--json", stdin=(FIX / "ddp.txt").read_bytes())
    msgs = json.loads(r.stdout)
    assert [(m["rank"], m["numbers"]["device"]) for m in msgs] == [(1, 1), (0, 0)]
    # rank 1's message is wrapped over two prefixed lines: its free memory is still read.
    assert msgs[0]["numbers"]["free_bytes"] == 3 * GIB
    assert msgs[0]["verdict"] == "capacity" and msgs[1]["verdict"] == "fragmentation"
    text = cli("explain-oom", str(FIX / "ddp.txt")).stdout.decode()
    assert "Message 1 of 2 (line 5, rank 1)" in text and "Message 2 of 2 (line 10, rank 0)" in text


def test_non_utf8_input_on_stdin_in_a_file_and_as_an_argument() -> None:
    raw = (FIX / "log_latin1.txt").read_bytes()
    assert b"\xe9" in raw
    via_stdin = cli("explain-oom", "-", "--json", stdin=raw)
    assert via_stdin.returncode == 0, via_stdin.stderr.decode()
    via_file = cli("explain-oom", str(FIX / "log_latin1.txt"), "--json")
    assert via_file.returncode == 0, via_file.stderr.decode()
    via_arg = cli("explain-oom", raw, "--json")
    assert via_arg.returncode == 0, via_arg.stderr.decode()
    assert b"Traceback" not in via_arg.stderr
    for r in (via_stdin, via_file, via_arg):
        assert json.loads(r.stdout)["numbers"]["requested_bytes"] == 2 * GIB


def test_a_log_path_is_read_and_a_missing_one_is_named(tmp_path: Path) -> None:
    log = tmp_path / "train.log"
    log.write_bytes(b"step 1\nstep 2\n" + (FIX / "m22.txt").read_bytes())
    r = cli("explain-oom", "train.log", cwd=tmp_path)
    assert r.returncode == 0, r.stderr.decode()
    assert "Diagnosis: fragmentation" in r.stdout.decode()
    missing = cli("explain-oom", "nosuch.log", cwd=tmp_path)
    assert missing.returncode == 1 and b"nosuch.log: no such file" in missing.stderr
    nothing = cli("explain-oom", "-", stdin=b"epoch 1 loss 0.3\n")
    assert nothing.returncode == 1 and b"does not look like a PyTorch out-of-memory message" in nothing.stderr


def test_non_utf8_file_name_gives_a_normal_error_for_every_subcommand(tmp_path: Path) -> None:
    name = b"caf\xe9.sqlite"
    for sub in ("report", "plot"):
        r = cli(sub, name, cwd=tmp_path)
        assert r.returncode == 1, r.stderr
        assert b"Traceback" not in r.stderr and b"no such" in r.stderr and b"caf" in r.stderr
    r = cli("snapshot", b"caf\xe9.pickle", cwd=tmp_path)
    assert r.returncode == 1 and b"Traceback" not in r.stderr and b"no such" in r.stderr
