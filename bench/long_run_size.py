"""A long, fast monitored loop under `torchmem run`: how big the profile gets and what `report` and `plot` cost to
read it back (issue 8 §4). The loop is newcomer-probe finding #9's: Linear(16, 32)-ReLU-Linear(32, 4), batch 8,
`Monitor(model, opt, verbose=False)`, an epoch every 1000 steps, ~2,300 steps/s (8 markers per step).

It records the loop for `--seconds` with each of, side by side:
  - `before` (with `--old-torchmem CMD`, e.g. a build of the previous commit): today's approach, every marker
    in the file, read back by that torchmem;
  - `all markers`: this torchmem with `--keep-spans` above any count (every marker in the file; the reader
    folds while streaming);
  - `folded`: this torchmem's default (the first 100 occurrences of each step/phase per process keep their
    markers, the rest are exact per-epoch aggregate rows).
Then it copies every timed row N times, shifted by the run's length (as the probe did with its 5x file), to
stand for an N-times longer run (`--scale` for the folded file, `--scale-all` for the all-markers one, whose
copies grow by 1.1 M markers a minute), and times `report` and `plot` on each file (wall seconds and max RSS
of that child alone, from wait4). Profile MB/min is measured on the real recording, before copying.

    .venv/bin/python bench/long_run_size.py --seconds 60 --scale 60 --scale-all 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

LOOP = textwrap.dedent(
    """
    import sys, time
    import torch, torchmem
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.CrossEntropyLoss()
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    mon = torchmem.Monitor(model, opt, verbose=False)
    deadline = time.monotonic() + float(sys.argv[1])
    steps = 0
    while time.monotonic() < deadline:
        with mon.epoch():
            for _ in range(1000):
                with mon.step():
                    loss_fn(model(x), y).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                steps += 1
    print(steps)
    """
)

TIMED = {
    "cpu_samples": "t_ns",
    "process_samples": "t_ns",
    "gpu_samples": "t_ns",
    "torch_samples": "t_ns",
    "markers": "t_ns",
    "line_profiles": "t_ns",
    "blobs": "t_ns",
}


def timed_child(cmd: list[str]) -> tuple[float, float]:
    """Runs `cmd`; returns (wall seconds, max RSS in MiB) of that child alone."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    err = proc.stderr.read().decode() if proc.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {err}")
    return wall, usage.ru_maxrss / 1024


def scale(profile: Path, times: int) -> None:
    """Appends `times - 1` copies of every timed row, each shifted by the run's length."""
    con = sqlite3.connect(profile)
    span = con.execute("SELECT max(t_ns) FROM cpu_samples").fetchone()[0] + 1
    tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    for table, col in TIMED.items():
        if table not in tables:
            continue
        cols = [r[1] for r in con.execute(f"PRAGMA table_info({table})")]
        con.execute(f"CREATE TEMP TABLE orig AS SELECT * FROM {table}")
        for k in range(1, times):
            exprs = ", ".join(f"{c} + {k * span}" if c == col else c for c in cols)
            con.execute(f"INSERT INTO {table} SELECT {exprs} FROM orig")
        con.execute("DROP TABLE orig")
    if "span_aggregates" in tables:
        cols = [r[1] for r in con.execute("PRAGMA table_info(span_aggregates)")]
        epochs = (con.execute("SELECT max(epoch) FROM span_aggregates").fetchone()[0] or 0) + 1
        con.execute("CREATE TEMP TABLE orig AS SELECT * FROM span_aggregates")
        for k in range(1, times):
            shifted = {
                "epoch": f"epoch + {k * epochs}",
                "first_start_t_ns": f"first_start_t_ns + {k * span}",
                "last_end_t_ns": f"last_end_t_ns + {k * span}",
            }
            exprs = ", ".join(shifted.get(c, c) for c in cols)
            con.execute(f"INSERT INTO span_aggregates SELECT {exprs} FROM orig")
        con.execute("DROP TABLE orig")
    con.commit()
    con.execute("VACUUM")
    con.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--scale", type=int, default=60, help="read the folded file back as an N-times longer run")
    ap.add_argument("--scale-all", type=int, default=5, help="read the all-markers file back as an N-times longer run")
    ap.add_argument("--torchmem", help="the torchmem command (default: the one next to this Python)")
    ap.add_argument("--old-torchmem", help="a torchmem command from before folding, for the `before` row")
    args = ap.parse_args()
    torchmem = args.torchmem or shutil.which("torchmem", path=str(Path(sys.executable).parent))
    if torchmem is None:
        raise SystemExit("torchmem is not installed: run ./setup.sh first")
    tmp = Path(tempfile.mkdtemp(prefix="torchmem-long-"))
    loop = tmp / "loop.py"
    loop.write_text(LOOP)
    rows = []
    runs = [("all markers", torchmem, str(10**15), args.scale_all), ("folded", torchmem, None, args.scale)]
    if args.old_torchmem:
        runs.insert(0, ("before", args.old_torchmem, None, args.scale_all))
    for label, tool, keep, times in runs:
        prof = tmp / f"{label.replace(' ', '_')}.sqlite"
        cmd = [*tool.split(), "run", "-q", "-o", str(prof)] + (["--keep-spans", keep] if keep else [])
        out = subprocess.run([*cmd, "--", sys.executable, str(loop), str(args.seconds)], capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"torchmem run failed: {out.stderr}")
        steps = int(out.stdout.split()[-1])
        con = sqlite3.connect(prof)
        markers = con.execute("SELECT count(*) FROM markers").fetchone()[0]
        con.close()
        mb_per_min = prof.stat().st_size / 1e6 / (args.seconds / 60)
        scale(prof, times)
        big_mb = prof.stat().st_size / 1e6
        rep = timed_child([*tool.split(), "report", str(prof)])
        plot = timed_child([*tool.split(), "plot", str(prof), "-o", str(tmp / f"{label}.html")])
        rows.append((label, steps / args.seconds, markers, mb_per_min, args.seconds / 60 * times, big_mb, *rep, *plot))
    print(f"loop recorded for {args.seconds:.0f} s by each; each file read back as a longer run (rows copied)")
    print(
        "| profile | steps/s | markers in file | profile MB/min | read back as (min) | its MB | "
        "report s | report max RSS MiB | plot s | plot max RSS MiB |"
    )
    print("|" + "---|" * 10)
    for label, sps, markers, mbm, minutes, big, rs, rm, ps, pm in rows:
        print(
            f"| {label} | {sps:,.0f} | {markers:,} | {mbm:.2f} | {minutes:.0f} | {big:.1f} | "
            f"{rs:.2f} | {rm:.0f} | {ps:.2f} | {pm:.0f} |"
        )
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
