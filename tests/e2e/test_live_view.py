"""The live view in a real terminal: `torchmem top` and `torchmem run --live` inside tmux (a 120x40 pane on a
private tmux server), read back with `tmux capture-pane -p`, while a real `torchmem run -- python prog.py`
(real torch, 200 MiB held inside a `torchmem.track("alloc200")` phase) runs. Checks what a user sees: the
program's pid, command, an RSS that matches /proc, the phase; `q` leaving the terminal as it was (cooked
mode, echo on); the plain table without a terminal and a finished profile's replay; the inline panel under
the program's output; and that `--live` changes nothing the program can see (stdout bytes, exit code, a
signal delivered once). The machine may be a loaded 2-core VM: every wait polls with a generous deadline."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    shutil.which("tmux") is None,
    reason="tmux is not installed: the live view's terminal tests need it (apt-get install tmux)",
)

# The console script, as users run it (TORCHMEM_TEST_BIN: another build of the command, e.g. target/debug).
TM = os.environ.get("TORCHMEM_TEST_BIN") or str(Path(sys.executable).parent / "torchmem")
MIB = 1 << 20
# torch's import alone can take 10 s on a loaded machine: the program's start gets a long deadline, the
# screen then gets 30 s to show what the program does.
START_S = 120.0
SCREEN_S = 30.0

# Holds 200 MiB (filled, so resident) inside the phase "alloc200" until `stop` appears, printing numbered
# lines; SIGTERM is logged and ends it with 115; else it exits with 7.
PROGRAM = textwrap.dedent(
    """
    import os, signal, sys, time
    from pathlib import Path
    import torch
    import torchmem

    here = Path(sys.argv[1])
    def on_term(sig, frame):
        with open(here / "signals", "a") as f:
            f.write("TERM\\n")
        sys.exit(115)
    signal.signal(signal.SIGTERM, on_term)
    for i in range(4):
        print(f"program-line-{i}", flush=True)
    with torchmem.track("alloc200"):
        held = torch.ones(200 * 1024 * 1024 // 4)
        (here / "pid").write_text(str(os.getpid()))
        deadline = time.monotonic() + 300
        while not (here / "stop").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    del held
    print("program-done", flush=True)
    sys.exit(7)
    """
)


def wait_for(what: str, check, timeout_s: float, interval_s: float = 0.25):
    """Polls `check()` until it returns something truthy; fails naming `what` and the last value."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval_s)
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}; last seen:\n{last!r}")


class Tmux:
    """A private tmux server (its own socket) with one 120x40 session running a plain bash."""

    def __init__(self, tmp: Path, env: dict):
        self.sock = str(tmp / "tmux.sock")
        self.env = env
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items() if k.startswith("TORCHMEM"))
        shell = f"env {exports} PS1='shell$ ' bash --norc --noprofile"
        self.tmux("new-session", "-d", "-s", "t", "-x", "120", "-y", "40", shell)
        wait_for("the shell prompt", lambda: "shell$" in self.capture(), 20)

    def tmux(self, *args: str) -> str:
        return subprocess.run(
            ["tmux", "-S", self.sock, *args], check=True, capture_output=True, text=True, env=self.env, timeout=30
        ).stdout

    def send(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", "t", *keys)

    def type(self, line: str) -> None:
        self.tmux("send-keys", "-t", "t", "-l", line)
        self.send("Enter")

    def capture(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "t")

    def close(self) -> None:
        subprocess.run(["tmux", "-S", self.sock, "kill-server"], capture_output=True, timeout=30)


@pytest.fixture
def env(tmp_path):
    live = tmp_path / "live"
    return dict(os.environ, TORCHMEM_PYTHON=sys.executable, TORCHMEM_LIVE_DIR=str(live))


@pytest.fixture
def tmux(tmp_path, env):
    t = Tmux(tmp_path, env)
    yield t
    t.close()


@pytest.fixture
def prog(tmp_path) -> Path:
    p = tmp_path / "prog.py"
    p.write_text(PROGRAM)
    return p


def vm_rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024


def short_bytes(text: str) -> int:
    """The table's `210.3M` / `1.25G` back to bytes."""
    m = re.fullmatch(r"([\d.]+)([BKMGT])", text)
    assert m, f"not a size: {text!r}"
    return int(float(m.group(1)) * {"B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2)])


def start_run(tmp_path: Path, prog: Path, env: dict) -> subprocess.Popen:
    out = open(tmp_path / "run.out", "wb")
    err = open(tmp_path / "run.err", "wb")
    # From its directory, as `prog.py .`: the command fits the table's column.
    return subprocess.Popen(
        [TM, "run", "-o", "p.sqlite", "--", prog.name, "."], stdout=out, stderr=err, env=env, cwd=tmp_path
    )


def finish(tmp_path: Path, proc: subprocess.Popen) -> int:
    (tmp_path / "stop").touch()
    return proc.wait(timeout=120)


def test_top_shows_the_run_its_memory_and_phase_and_q_restores_the_terminal(tmp_path, prog, env, tmux):
    run = start_run(tmp_path, prog, env)
    try:
        pid = int(
            wait_for(
                "the program to hold its 200 MiB",
                lambda: (tmp_path / "pid").exists() and (tmp_path / "pid").read_text(),
                START_S,
            )
        )
        tmux.type(f"cd {tmp_path}; {TM} top --interval 300")

        def row():
            # The first screen with the phase may show a process reading taken just before the 200 MiB were
            # touched (PSS/RSS per process are read every 250 ms, slower on a loaded machine): wait for the
            # row to agree with /proc.
            screen = tmux.capture()
            for line in screen.splitlines():
                cells = line.strip("│ ").split()
                if cells and cells[0] == str(pid) and "alloc200" in cells:
                    shown, real = short_bytes(cells[1]), vm_rss_bytes(pid)
                    if shown >= 200 * MIB and abs(shown - real) <= 0.2 * real + 32 * MIB:
                        return line, screen
                    return None if time.monotonic() < settle_by else (line, real)
            return None

        settle_by = time.monotonic() + SCREEN_S
        line, screen = wait_for(f"a row for pid {pid} in phase alloc200 with the RSS /proc shows", row, SCREEN_S + 5)
        assert isinstance(screen, str), f"RSS shown vs /proc VmRSS: {line!r} vs {screen} bytes"
        assert screen.splitlines()[0].startswith("torchmem top — "), screen
        assert "GPU       no NVIDIA GPU (NVML not found)" in screen or "GPU 0 " in screen, screen
        assert re.search(r"Host RAM  used [\d.]+ GiB of [\d.]+ GiB", screen), screen
        assert line.rstrip("│ ").endswith("python prog.py ."), line
        assert "phase alloc200" in screen, "the run's panel names the phase"
        assert re.search(r"RSS history\s+[▁▂▃▄▅▆▇█]", screen), screen
        assert "q quit" in screen.splitlines()[-1] and "1 pid  2 rss" in screen.splitlines()[-1], screen

        # Sort by PID (key 1): the header marks it.
        tmux.send("1")
        wait_for("the PID column marked as the sort key", lambda: "PID▼" in tmux.capture(), SCREEN_S)

        tmux.send("q")
        wait_for(
            "the shell back after q",
            lambda: "torchmem top — " not in tmux.capture() and tmux.capture().rstrip().endswith("shell$"),
            SCREEN_S,
        )
        tmux.type(
            "echo top-exit-$?; stty -a | tr ' ;' '\\n\\n' | grep -x -e '-*icanon' -e '-*echo'"
            " | paste -sd, | sed 's/^/tty=/'"
        )
        screen = wait_for(
            "the exit code and stty", lambda: re.search(r"^tty=\S+$", tmux.capture(), re.M) and tmux.capture(), SCREEN_S
        )
        assert "top-exit-0" in screen, screen
        assert re.search(r"^tty=icanon,echo$", screen, re.M), (
            f"the terminal is back in cooked mode with echo:\n{screen}"
        )
    finally:
        code = finish(tmp_path, run)
    assert code == 7


def test_top_without_a_terminal_prints_a_table_and_replays_a_finished_profile(tmp_path, prog, env):
    run = start_run(tmp_path, prog, env)
    try:
        pid = int(
            wait_for(
                "the program to hold its 200 MiB",
                lambda: (tmp_path / "pid").exists() and (tmp_path / "pid").read_text(),
                START_S,
            )
        )

        def table():
            out = subprocess.run([TM, "top", "--once"], env=env, capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            return "alloc200" in out.stdout and out.stdout

        text = wait_for("the phase in `top --once`", table, SCREEN_S)
        assert "\x1b" not in text, "plain text, no escape sequences"
        row = next(line for line in text.splitlines() if line.startswith(f"{pid} "))
        assert short_bytes(row.split()[1]) >= 200 * MIB, row
        # The live run's profile is followed (not replayed) while it records.
        out = subprocess.run(
            [TM, "top", "--once", str(tmp_path / "p.sqlite")], env=env, capture_output=True, text=True, timeout=60
        )
        assert f"following {tmp_path / 'p.sqlite'}" in out.stdout and f"{pid} " in out.stdout, out.stdout + out.stderr
        # Not a terminal and no --once: a table every interval, ended by SIGINT with exit 0.
        p = subprocess.Popen([TM, "top", "--interval", "200"], env=env, stdout=subprocess.PIPE, text=True)
        time.sleep(3)
        p.send_signal(signal.SIGINT)
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0
        assert out.startswith("torchmem top: stdout is not a terminal, so a plain table every 0.2 s"), out[:200]
        assert out.count("torchmem top — ") >= 2, out
    finally:
        code = finish(tmp_path, run)
    assert code == 7
    assert not list((tmp_path / "live").glob("*.json")), "the run unregistered itself"
    out = subprocess.run([TM, "top", "--once"], env=env, capture_output=True, text=True, timeout=60)
    assert "No program is running under torchmem" in out.stdout, out.stdout
    out = subprocess.run(
        [TM, "top", "--once", str(tmp_path / "p.sqlite")], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert f"replay of {tmp_path / 'p.sqlite'}" in out.stdout, out.stdout
    assert "finished, exit code 7" in out.stdout, out.stdout
    peak = re.search(r"RSS [\d.]+ MiB \(peak ([\d.]+) MiB\)", out.stdout)
    assert peak and float(peak.group(1)) >= 200, out.stdout
    bad = subprocess.run(
        [TM, "top", "--once", str(tmp_path / "missing.sqlite")], env=env, capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 1 and "no such profile" in bad.stderr, bad.stderr


def bare_run(tmp_path: Path, prog: Path, env: dict) -> tuple[int, bytes]:
    """The program without torchmem, stopped the same way: its exit code and stdout bytes."""
    here = tmp_path / "bare"
    here.mkdir()
    p = subprocess.Popen([sys.executable, str(prog), "."], stdout=subprocess.PIPE, env=env, cwd=here)
    wait_for("the bare program's phase", lambda: (here / "pid").exists(), START_S)
    (here / "stop").touch()
    out, _ = p.communicate(timeout=120)
    return p.returncode, out


def test_run_live_draws_under_the_programs_output_and_changes_nothing_it_sees(tmp_path, prog, env, tmux):
    bare_code, bare_out = bare_run(tmp_path, prog, env)
    assert bare_code == 7
    tmux.type(f"cd {tmp_path}; {TM} run --live -o p.sqlite -- prog.py .; echo EXIT=$?")
    wait_for("the program to hold its 200 MiB", lambda: (tmp_path / "pid").exists(), START_S)

    def panel():
        lines = tmux.capture().splitlines()
        idx = [i for i, line in enumerate(lines) if line.startswith(" torchmem ") and "prog.py ." in line]
        return idx and "phase alloc200" in "\n".join(lines[idx[0] :]) and (idx[0], lines)

    top_row, lines = wait_for("the live panel with the phase", panel, SCREEN_S)
    screen = "\n".join(lines)
    assert top_row == 40 - 4, f"the panel takes the bottom 4 rows:\n{screen}"
    assert re.match(r"RSS [\d.]+ MiB \(peak [\d.]+ MiB\)", lines[top_row + 1]), screen
    assert "PyTorch" in lines[top_row + 2] and "1 process" in lines[top_row + 3], screen
    last_output = max(i for i, line in enumerate(lines) if line.startswith("program-line-"))
    assert last_output < top_row, f"the program's output stays above the panel:\n{screen}"
    assert [line for line in lines if line.startswith("program-line-")] == [f"program-line-{i}" for i in range(4)]
    (tmp_path / "stop").touch()
    screen = wait_for("the run's end", lambda: re.search(r"^EXIT=\d+", tmux.capture(), re.M) and tmux.capture(), 120)
    assert re.search(r"^EXIT=7$", screen, re.M), screen
    assert "phase alloc200" not in screen, f"the panel is gone at the end:\n{screen}"
    assert "== torchmem summary ==" in screen

    # Stdout bytes: the same as bare, with the panel on (stderr is the pane, stdout a file).
    out_file = tmp_path / "live.out"
    for f in ("pid", "stop"):
        (tmp_path / f).unlink()
    tmux.type("clear")
    tmux.type(f"{TM} run --live -f -o p.sqlite -- prog.py . > {out_file}; echo EXIT2=$?")
    wait_for("the program to hold its 200 MiB", lambda: (tmp_path / "pid").exists(), START_S)
    wait_for("the live panel", lambda: "phase alloc200" in tmux.capture(), SCREEN_S)
    # A SIGTERM to torchmem reaches the program once, as it would bare.
    pid = int((tmp_path / "pid").read_text())
    recorder = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    os.kill(recorder, signal.SIGTERM)
    screen = wait_for(
        "the second run's end", lambda: re.search(r"^EXIT2=\d+", tmux.capture(), re.M) and tmux.capture(), 120
    )
    assert re.search(r"^EXIT2=115$", screen, re.M), screen
    assert (tmp_path / "signals").read_text() == "TERM\n", "delivered exactly once"
    assert out_file.read_bytes() == b"".join(f"program-line-{i}\n".encode() for i in range(4)), out_file.read_bytes()
    assert bare_out == b"".join(f"program-line-{i}\n".encode() for i in range(4)) + b"program-done\n"


def test_run_live_is_off_with_a_note_when_stderr_is_not_a_terminal(tmp_path, prog, env):
    p = subprocess.Popen(
        [TM, "run", "--live", "-o", "p.sqlite", "--", prog.name, "."],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=tmp_path,
    )
    wait_for("the program to hold its 200 MiB", lambda: (tmp_path / "pid").exists(), START_S)
    (tmp_path / "stop").touch()
    out, err = p.communicate(timeout=120)
    assert p.returncode == 7
    assert out == b"".join(f"program-line-{i}\n".encode() for i in range(4)) + b"program-done\n"
    notes = [line for line in err.decode().splitlines() if "--live" in line]
    assert notes == ["torchmem: --live is off: stderr is not a terminal (`torchmem top` shows this run)"], err.decode()
    assert "\x1b[" not in err.decode(), "no escape sequences into a pipe"


def test_torchmem_live_0_registers_nothing_and_top_sees_no_run(tmp_path, prog, env):
    """`TORCHMEM_LIVE=0`: no state file in the live directory while the run records (no `top` entry), and the
    run and its profile are as without it."""
    env = dict(env, TORCHMEM_LIVE="0")
    run = start_run(tmp_path, prog, env)
    try:
        wait_for(
            "the program to hold its 200 MiB",
            lambda: (tmp_path / "pid").exists() and (tmp_path / "pid").read_text(),
            START_S,
        )
        assert not list((tmp_path / "live").glob("*.json")), "registered although TORCHMEM_LIVE=0"
        out = subprocess.run([TM, "top", "--once"], env=env, capture_output=True, text=True, timeout=60)
        assert "No program is running under torchmem" in out.stdout, out.stdout
    finally:
        code = finish(tmp_path, run)
    assert code == 7
    out = subprocess.run([TM, "report", str(tmp_path / "p.sqlite")], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and "alloc200" in out.stdout, out.stdout + out.stderr
