"""No data lost, no file clobbered: what `torchmem run` (and `snapshot --html`) do with the files around them.
Real runs of the wheel's `torchmem` on real files: an existing file that is not a profile is never replaced, an
existing profile only with --force, two runs never share a file (unique default names, a lock on a live
profile), a finished profile is one self-contained SQLite file that reads from a read-only mount, a live or
killed run's profile says what it is, a failed start or a kill leaves no stray files, output-path errors name
their cause once, and the live status line never mixes with the program's output on a real pty."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import shutil
import sqlite3
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONSOLE = str(Path(sys.executable).parent / "torchmem")


def env(tmp_path: Path, **extra: str) -> dict[str, str]:
    # A private TMPDIR per test: every stray file torchmem could leave is visible there.
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    return {**os.environ, "TORCHMEM_PYTHON": sys.executable, "TMPDIR": str(tmp), **extra}


def tm(tmp_path: Path, *args: str, cwd: Path | None = None, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CONSOLE, *args], capture_output=True, text=True, env=env(tmp_path, **extra), cwd=cwd or tmp_path, timeout=300
    )


def script(tmp_path: Path, name: str, body: str) -> Path:
    p = tmp_path / name
    p.write_text(body)
    return p


ALLOC = "import sys, time\nx = bytearray(b'\\x01' * (int(sys.argv[1]) << 20))\ntime.sleep(float(sys.argv[2]))\n"


def report(tmp_path: Path, prof: Path) -> dict:
    r = tm(tmp_path, "report", "-f", "json", str(prof))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def strays(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "tmp").iterdir())


def test_an_existing_file_that_is_not_a_profile_is_never_replaced(tmp_path) -> None:
    victim = script(tmp_path, "victim.py", "print('the user script')\n")
    r = tm(tmp_path, "run", "-o", "victim.py", "--", "victim.py")
    assert r.returncode == 1 and "victim.py exists and is not a torchmem profile" in r.stderr, r.stderr
    assert victim.read_text() == "print('the user script')\n"
    notes = script(tmp_path, "notes.txt", "my notes\n")
    r = tm(tmp_path, "run", "--force", "-o", "notes.txt", "--", "victim.py")
    assert r.returncode == 1 and "even with --force" in r.stderr, r.stderr
    assert notes.read_text() == "my notes\n"
    assert not list(tmp_path.glob("*-wal")) and not list(tmp_path.glob("*-shm"))


def test_an_existing_profile_is_replaced_only_with_force(tmp_path) -> None:
    s = script(tmp_path, "exit3.py", "import sys\nsys.exit(int(sys.argv[1]))\n")
    assert tm(tmp_path, "run", "-q", "-o", "p.sqlite", "--", str(s), "3").returncode == 3
    r = tm(tmp_path, "run", "-q", "-o", "p.sqlite", "--", str(s), "4")
    assert r.returncode == 1 and "--force" in r.stderr and "already exists" in r.stderr, r.stderr
    assert report(tmp_path, tmp_path / "p.sqlite")["meta"]["exit_code"] == 3
    assert tm(tmp_path, "run", "-q", "--force", "-o", "p.sqlite", "--", str(s), "4").returncode == 4
    assert report(tmp_path, tmp_path / "p.sqlite")["meta"]["exit_code"] == 4
    # An empty file (say from mktemp) holds nothing to lose.
    (tmp_path / "empty.sqlite").write_text("")
    assert tm(tmp_path, "run", "-q", "-o", "empty.sqlite", "--", str(s), "0").returncode == 0
    assert report(tmp_path, tmp_path / "empty.sqlite")["meta"]["exit_code"] == 0


def peak_line(stderr: str) -> str:
    return next(line for line in stderr.splitlines() if line.startswith("peak CPU RSS"))


def test_two_runs_at_once_never_share_a_file(tmp_path) -> None:
    s = script(tmp_path, "slow.py", ALLOC)
    runs = [
        subprocess.Popen(
            [CONSOLE, "run", "--", str(s), str(mb), "1.5"],
            cwd=tmp_path,
            env=env(tmp_path),
            stderr=subprocess.PIPE,
            text=True,
        )
        for mb in (40, 240)
    ]
    errs = [p.communicate(timeout=120)[1] for p in runs]
    assert [p.returncode for p in runs] == [0, 0], errs
    files = sorted(tmp_path.glob("torchmem-slow-*.sqlite"))
    assert len(files) == 2, files
    assert all(re.fullmatch(r"torchmem-slow-\d{8}-\d{6}-\d+\.sqlite", f.name) for f in files), files
    # Each summary is its own run's: the 240 MiB run's peak is far above the 40 MiB run's.
    small, big = (int(float(peak_line(e).split()[3])) for e in errs)
    assert small < 150 <= big, errs
    for f, e in zip(sorted(files, key=lambda f: report(tmp_path, f)["peak"]["cpu_rss_bytes"]), errs, strict=False):
        assert f.name in e


def test_a_profile_a_live_run_holds_is_refused_even_with_force(tmp_path) -> None:
    s = script(tmp_path, "slow.py", ALLOC)
    first = subprocess.Popen(
        [CONSOLE, "run", "-o", "same.sqlite", "--", str(s), "100", "2.5"],
        cwd=tmp_path,
        env=env(tmp_path),
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(1.0)
    second = tm(tmp_path, "run", "--force", "-o", "same.sqlite", "--", str(s), "300", "0.1")
    assert second.returncode == 1 and "being recorded by another `torchmem run`" in second.stderr, second.stderr
    live = report(tmp_path, tmp_path / "same.sqlite")
    assert live["meta"]["recording"] is True and live["meta"]["finished"] is False
    text = tm(tmp_path, "report", "same.sqlite").stdout
    assert "still recording" in text and "killed?" not in text, text
    err = first.communicate(timeout=60)[1]
    assert first.returncode == 0
    peak_mib = float(peak_line(err).split()[3])
    assert 100 <= peak_mib < 290, err  # its own numbers, not the refused 300 MiB run's
    done = report(tmp_path, tmp_path / "same.sqlite")
    assert done["meta"]["recording"] is False and done["meta"]["finished"] is True


def test_a_finished_profile_is_one_self_contained_file(tmp_path) -> None:
    s = script(tmp_path, "slow.py", ALLOC)
    assert tm(tmp_path, "run", "-q", "-o", "p.sqlite", "--", str(s), "8", "0.2").returncode == 0
    prof = tmp_path / "p.sqlite"
    assert prof.read_bytes()[18:20] == b"\x01\x01", "rollback-journal mode, not WAL"
    assert sorted(p.name for p in tmp_path.glob("p.sqlite*")) == ["p.sqlite"]
    # The README's recipe, read-only, as another user or an artifact store would.
    con = sqlite3.connect(f"file:{prof}?mode=ro", uri=True)
    assert con.execute("select count(*) from cpu_samples").fetchone()[0] > 0
    con.close()
    assert sorted(p.name for p in tmp_path.glob("p.sqlite*")) == ["p.sqlite"]


def read_only_mount(dir_: Path, commands: str) -> subprocess.CompletedProcess:
    """Runs shell `commands` with `dir_` bind-mounted read-only (a private mount namespace)."""
    sh = f"mount --bind {dir_} {dir_} && mount -o remount,ro,bind {dir_} && {commands}"
    return subprocess.run(["unshare", "-m", "sh", "-c", sh], capture_output=True, text=True, timeout=120)


def can_mount_read_only(tmp_path: Path) -> bool:
    d = tmp_path / "probe-ro"
    d.mkdir()
    ok = shutil.which("unshare") and read_only_mount(d, f"! touch {d}/x 2>/dev/null").returncode == 0
    return bool(ok)


def test_profiles_read_from_a_read_only_filesystem(tmp_path) -> None:
    if not can_mount_read_only(tmp_path):
        pytest.skip("needs `unshare -m` and mount rights (root) for a real read-only mount")
    s = script(tmp_path, "slow.py", ALLOC)
    ro = tmp_path / "ro"
    ro.mkdir()
    assert tm(tmp_path, "run", "-q", "-o", str(ro / "done.sqlite"), "--", str(s), "8", "0.2").returncode == 0
    # A killed run's profile, whose log was folded by a report: WAL-mode header, no -shm (needs immutable).
    killed = subprocess.Popen(
        [CONSOLE, "run", "-q", "-o", "k.sqlite", "--", str(s), "8", "5"], cwd=tmp_path, env=env(tmp_path)
    )
    time.sleep(1.5)
    killed.kill()
    killed.wait()
    assert tm(tmp_path, "report", "k.sqlite").returncode == 0
    shutil.copy(tmp_path / "k.sqlite", ro / "killed.sqlite")
    assert (ro / "killed.sqlite").read_bytes()[18] == 2
    out = read_only_mount(
        ro,
        f"{CONSOLE} report {ro}/done.sqlite && {CONSOLE} report {ro}/killed.sqlite && "
        f"{sys.executable} -c \"import sqlite3; print('rows', sqlite3.connect('{ro}/done.sqlite')"
        f".execute('select count(*) from cpu_samples').fetchone()[0])\"",
    )
    assert out.returncode == 0, out.stderr
    assert "damaged" not in out.stderr and out.stdout.count("torchmem report") == 2, out.stdout
    assert "exit code 0" in out.stdout and "unfinished" in out.stdout
    assert re.search(r"^rows [1-9]", out.stdout, re.M), out.stdout


def test_a_copied_main_file_of_a_live_run_says_where_the_data_is(tmp_path) -> None:
    s = script(tmp_path, "slow.py", ALLOC)
    live = subprocess.Popen(
        [CONSOLE, "run", "-q", "-o", "live.sqlite", "--", str(s), "8", "2.5"], cwd=tmp_path, env=env(tmp_path)
    )
    time.sleep(1.2)
    shutil.copy(tmp_path / "live.sqlite", tmp_path / "copy.sqlite")
    r = tm(tmp_path, "report", "copy.sqlite")
    live.wait(timeout=60)
    # Before the log's first checkpoint the copy holds no data (an error); after it (every 32 pages, so
    # that a full disk can be handled), the data up to then, said to be so. Either way the -wal is named.
    if r.returncode == 1:
        assert "copy.sqlite-wal" in r.stderr and "write-ahead log" in r.stderr, r.stderr
    else:
        assert r.returncode == 0 and "copy.sqlite-wal" in r.stdout and "write-ahead log" in r.stdout, r.stdout
        assert "killed?" not in r.stdout


def test_a_failed_start_or_a_kill_leaves_no_stray_files(tmp_path) -> None:
    noexec = script(tmp_path, "noext", "#!/bin/sh\necho hi\n")
    r = tm(tmp_path, "run", "-o", "n.sqlite", "--", f"./{noexec.name}")
    assert r.returncode == 1 and "is not executable" in r.stderr, r.stderr
    assert not list(tmp_path.glob("n.sqlite*")) and strays(tmp_path) == []
    # Executable, but its interpreter does not exist: spawn fails after the profile was made.
    bad = script(tmp_path, "badexec", "#!/no/such/interpreter\necho hi\n")
    bad.chmod(0o755)
    r = tm(tmp_path, "run", "-o", "b.sqlite", "--", f"./{bad.name}")
    assert r.returncode == 1 and "cannot start" in r.stderr, r.stderr
    assert not list(tmp_path.glob("b.sqlite*")) and strays(tmp_path) == []
    # A SIGKILLed recorder cannot clean up; the next run removes what it left.
    s = script(tmp_path, "slow.py", ALLOC)
    k = subprocess.Popen(
        [CONSOLE, "run", "-q", "-o", "k.sqlite", "--", str(s), "8", "5"], cwd=tmp_path, env=env(tmp_path)
    )
    time.sleep(1.5)
    assert any(n.startswith("torchmem-inject-") for n in strays(tmp_path)), strays(tmp_path)
    k.kill()
    k.wait()
    assert tm(tmp_path, "run", "-q", "-o", "next.sqlite", "--", str(s), "1", "0").returncode == 0
    assert strays(tmp_path) == []


def test_a_missing_tmpdir_is_not_created(tmp_path) -> None:
    s = script(tmp_path, "slow.py", ALLOC)
    missing = tmp_path / "no" / "such" / "dir"
    r = tm(tmp_path, "run", "-q", "-o", "t.sqlite", "--", str(s), "1", "0", TMPDIR=str(missing))
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "no").exists()
    assert f"TMPDIR={missing} is not an existing directory; using /tmp" in r.stderr


def test_output_path_errors_name_their_cause_once(tmp_path) -> None:
    s = script(tmp_path, "ok.py", "pass\n")
    r = tm(tmp_path, "run", "-o", str(tmp_path / "nodir" / "sub" / "x.sqlite"), "--", str(s))
    assert r.returncode == 1
    assert f"directory {tmp_path / 'nodir' / 'sub'} does not exist" in r.stderr, r.stderr
    assert "unable to open" not in r.stderr and r.stderr.count("does not exist") == 1, r.stderr
    # A directory (existing, or with a trailing slash) gets a new profile of this run's own in it.
    (tmp_path / "outdir").mkdir()
    r = tm(tmp_path, "run", "-q", "-o", "outdir", "--", str(s))
    assert r.returncode == 0, r.stderr
    made = list((tmp_path / "outdir").glob("*-pid*.sqlite"))
    assert len(made) == 1, made
    r = tm(tmp_path, "run", "-o", str(tmp_path / "nodir" / "sub") + "/", "--", str(s))
    assert r.returncode == 1 and f"directory {tmp_path / 'nodir'} does not exist" in r.stderr, r.stderr
    assert "os error" not in r.stderr and not (tmp_path / "nodir").exists()


def test_directories_and_modules_as_programs(tmp_path) -> None:
    (tmp_path / "dir.py").mkdir()
    r = tm(tmp_path, "run", "--", "dir.py")
    assert r.returncode == 1 and "dir.py is a directory" in r.stderr, r.stderr
    pkg = tmp_path / "pkgdir"
    pkg.mkdir()
    (pkg / "__main__.py").write_text("import sys\nprint('pkg main', sys.argv[1:])\n")
    r = tm(tmp_path, "run", "-q", "-o", "pkg.sqlite", "--", "./pkgdir", "a")
    assert r.returncode == 0 and "pkg main ['a']" in r.stdout, r.stderr
    script(tmp_path, "mymod.py", "import sys\nprint('module', __name__, sys.argv[1:])\n")
    r = tm(tmp_path, "run", "-q", "-o", "m.sqlite", "-m", "mymod", "x", "y")
    assert r.returncode == 0 and "module __main__ ['x', 'y']" in r.stdout, r.stderr
    assert report(tmp_path, tmp_path / "m.sqlite")["meta"]["command"] == ["-m", "mymod", "x", "y"]
    r = tm(tmp_path, "run", "-q", "-m", "json.tool", "--", "--help")
    assert r.returncode == 0 and "json.tool" in r.stdout + r.stderr
    assert list(tmp_path.glob("torchmem-json_tool-*.sqlite"))


def test_snapshot_html_never_overwrites_its_input_or_a_foreign_file(tmp_path) -> None:
    src = sorted((ROOT / "tests" / "fixtures" / "snapshots").glob("*.pickle"))[0]
    snap = tmp_path / "s.pickle"
    shutil.copy(src, snap)
    original = snap.read_bytes()
    for target in ("s.pickle", "./s.pickle"):
        r = tm(tmp_path, "snapshot", "s.pickle", "--html", target, "--force")
        assert r.returncode == 1 and "would overwrite the file it reads" in r.stderr, r.stderr
    assert snap.read_bytes() == original
    notes = script(tmp_path, "notes.html", "<html>my own page</html>")
    r = tm(tmp_path, "snapshot", "s.pickle", "--html", "notes.html")
    assert r.returncode == 1 and "--force" in r.stderr, r.stderr
    assert notes.read_text() == "<html>my own page</html>"
    assert tm(tmp_path, "snapshot", "s.pickle", "--html", "notes.html", "--force").returncode == 0
    assert tm(tmp_path, "snapshot", "s.pickle", "--html", "notes.html").returncode == 0, "a torchmem page is replaced"
    assert notes.read_text().startswith("<!DOCTYPE html>")


def pty_run(argv: list[str], cwd: Path, environ: dict[str, str], rows: int = 24, cols: int = 80) -> bytes:
    pid, fd = pty.fork()
    if pid == 0:
        os.chdir(cwd)
        os.execvpe(argv[0], argv, environ)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    out = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    os.waitpid(pid, 0)
    os.close(fd)
    return out


class Screen:
    """Just enough of a VT100 for what torchmem and the program write: text, CR/LF, cursor save/restore
    (ESC 7/8), cursor position and up (CSI H, CSI A), erase line (CSI 2K) and the scrolling region (CSI r)."""

    def __init__(self, rows: int, cols: int) -> None:
        self.rows, self.cols = rows, cols
        self.grid = [[" "] * cols for _ in range(rows)]
        self.y = self.x = 0
        self.top, self.bottom = 0, rows - 1
        self.saved = (0, 0)
        self.scrolled_out: list[str] = []

    def line(self, y: int) -> str:
        return "".join(self.grid[y]).rstrip()

    def newline(self) -> None:
        if self.y == self.bottom:
            self.scrolled_out.append(self.line(self.top))
            del self.grid[self.top]
            self.grid.insert(self.bottom, [" "] * self.cols)
        elif self.y < self.rows - 1:
            self.y += 1

    def feed(self, data: str) -> None:
        i = 0
        while i < len(data):
            c = data[i]
            if c == "\x1b":
                if data[i + 1] in "78":
                    if data[i + 1] == "7":
                        self.saved = (self.y, self.x)
                    else:
                        self.y, self.x = self.saved
                    i += 2
                    continue
                m = re.match(r"\x1b\[([0-9;?]*)([A-Za-z])", data[i:])
                assert m, repr(data[i : i + 10])
                args, cmd = m.group(1), m.group(2)
                nums = [int(n) if n else 0 for n in args.split(";")] if args else []
                if cmd == "r":
                    self.top, self.bottom = (nums[0] - 1, nums[1] - 1) if nums else (0, self.rows - 1)
                    self.y = self.x = 0
                elif cmd == "H":
                    self.y, self.x = (nums[0] - 1, nums[1] - 1) if nums else (0, 0)
                elif cmd == "A":
                    self.y = max(self.top, self.y - (nums[0] if nums else 1))
                elif cmd == "K":
                    self.grid[self.y] = [" "] * self.cols
                i += m.end()
                continue
            if c == "\r":
                self.x = 0
            elif c == "\n":
                self.newline()
            else:
                if self.x < self.cols:
                    self.grid[self.y][self.x] = c
                    self.x += 1
            i += 1

    def all_lines(self) -> list[str]:
        return self.scrolled_out + [self.line(y) for y in range(self.rows)]


PRINTER = (
    "import time\nfor i in range(1, 7):\n    print(f'epoch {i}: loss={1/i:.4f}', flush=True)\n    time.sleep(0.3)\n"
)


def test_no_status_line_glued_to_the_programs_output_on_a_terminal(tmp_path) -> None:
    s = script(tmp_path, "printer.py", PRINTER)
    out = pty_run([CONSOLE, "run", "-o", "pr.sqlite", "--", str(s)], tmp_path, env(tmp_path)).decode()
    lines = out.replace("\r\n", "\n").split("\n")
    assert [line for line in lines if line.startswith("epoch")] == [f"epoch {i}: loss={1 / i:.4f}" for i in range(1, 7)]
    assert "[torchmem]" not in out and "\x1b" not in out.split("== torchmem summary ==")[0], repr(out)
    assert "== torchmem summary ==" in out


def test_the_opt_in_status_line_lives_in_its_own_row(tmp_path) -> None:
    s = script(tmp_path, "printer.py", PRINTER)
    raw = pty_run([CONSOLE, "run", "--status", "-o", "st.sqlite", "--", str(s)], tmp_path, env(tmp_path), rows=12)
    screen = Screen(12, 80)
    mid_run_bottom = []
    text = raw.decode()
    for part in re.split(r"(?<=\x1b8)", text):  # after each status draw, look at the reserved row
        screen.feed(part)
        if "[torchmem]" in part and "\x1b[r" not in part:
            mid_run_bottom.append(screen.line(11))
    assert mid_run_bottom and all(b.startswith("[torchmem]") for b in mid_run_bottom), mid_run_bottom
    lines = screen.all_lines()
    epochs = [line for line in lines if "epoch" in line]
    assert epochs == [f"epoch {i}: loss={1 / i:.4f}" for i in range(1, 7)], lines
    assert not any("[torchmem]" in line for line in lines), "the status row is cleared at the end"
    assert (screen.top, screen.bottom) == (0, 11), "the scrolling region is given back"
    assert any("== torchmem summary ==" in line for line in lines)
