"""GPU check of the what-if panel (issue #10): a real CUDA out-of-memory error under `torchmem.on_oom` and a
memory cap (`set_per_process_memory_fraction`), then every claim of the report's what-if checked against the
real allocator, each run in a fresh process:

- the report has the panel, knows the cap, and says the recorded settings fail where the program failed;
- for each setting of the panel, the same program under that `PYTORCH_CUDA_ALLOC_CONF` and the same cap gets
  past the allocation that failed exactly when the panel says it avoids the OOM; where it does, its peak
  reserved (`torch.cuda.max_memory_reserved()` up to that allocation) equals the panel's to the byte;
- "needs at least M" (default settings and expandable segments): the program runs up to and including the
  allocation that failed under a cap of M + 1 MiB and fails under M - 1 MiB (reserved memory moves in 2 MiB
  steps, so these bracket M robustly against the fraction's rounding);
- `torchmem snapshot OOM.pickle --html OUT --memory-limit CAP` has the same verdicts.

    python scripts/gpu_check_whatif.py          # PASS/FAIL lines; exit status 1 if any failed; ~40 s on an H200

The workload is torch.empty / del only (no cuBLAS workspace, no kernels), so every process replays the same
allocation sequence.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MIB = 1 << 20
FAILED = 0


def check(name: str, ok: bool, detail: str) -> None:
    global FAILED
    print(f"{'PASS' if ok else 'FAIL'} whatif {name}: {detail}", flush=True)
    FAILED += not ok


# --- the child: the workload ------------------------------------------------------------------------------


def sizes() -> list[tuple[str, int]]:
    """A fixed fragmenting sequence: rounds of mixed-size tensors, every other one freed, then larger ones."""
    seq: list[tuple[str, int]] = []
    state = 12345
    live = 0
    for rnd in range(4):
        names = []
        for _ in range(40):
            state = (state * 1103515245 + 12345) % (1 << 31)
            n = (3 + state % 45) * MIB + (state % 977) * 512  # 3..48 MiB, odd sizes
            seq.append(("alloc", n))
            names.append(live)
            live += 1
        for i, _ in enumerate(names):
            if i % 2 == 0:
                seq.append(("free", names[i]))
        for _ in range(12):
            state = (state * 1103515245 + 12345) % (1 << 31)
            seq.append(("alloc", (30 + state % 40 + 10 * rnd) * MIB))
            live += 1
    return seq


def child(cap_bytes: int | None, stop_after: int | None, oom_dir: str | None) -> None:
    import torch

    if oom_dir is not None:
        import torchmem

        torchmem.on_oom(oom_dir)  # history from the first allocation
    total = torch.cuda.get_device_properties(0).total_memory
    if cap_bytes is not None:
        torch.cuda.set_per_process_memory_fraction(cap_bytes / total, 0)
    held: dict[int, torch.Tensor] = {}
    k = 0
    failed_at = None
    peak_reserved_at_stop = None
    for op, n in sizes():
        if op == "free":
            held.pop(n, None)
            continue
        try:
            held[k] = torch.empty(n, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError:
            failed_at = k
            break
        if stop_after is not None and k == stop_after:
            peak_reserved_at_stop = torch.cuda.max_memory_reserved()
            break
        k += 1
    print(
        json.dumps(
            {
                "failed_at": failed_at,
                "allocs": k,
                "total_bytes": total,
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
                "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
                "peak_reserved_at_stop_bytes": peak_reserved_at_stop,
            }
        )
    )


# --- the parent ----------------------------------------------------------------------------------------------


def run_child(conf: str | None, cap: int | None, stop_after: int | None = None, oom_dir: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    if conf and conf != "default":
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    args = [sys.executable, __file__, "--child", json.dumps([cap, stop_after, oom_dir])]
    p = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env)
    if p.returncode != 0:
        raise RuntimeError(f"child {conf} cap={cap}: exit {p.returncode}: {p.stderr[-1500:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("FAIL whatif setup: no CUDA device")
        return 1
    probe = run_child(None, None)
    check(
        "probe",
        probe["failed_at"] is None,
        f"uncapped: peak allocated {probe['peak_allocated_bytes']}, reserved {probe['peak_reserved_bytes']}",
    )
    # A cap between the peaks (as tests/fixtures/sim-h200's cap_retry): the default settings run out of
    # memory from fragmentation. Lower it until they do.
    lo, hi = probe["peak_allocated_bytes"], probe["peak_reserved_bytes"]
    tmp = Path(tempfile.mkdtemp(prefix="torchmem-whatif-"))
    rec = None
    cap = None
    for frac in (0.5, 0.3, 0.15, 0.05, 0.0):
        cap = int(lo + (hi - lo) * frac) // MIB * MIB + MIB // 2
        d = tmp / f"oom-{frac}"
        r = run_child(None, cap, oom_dir=str(d))
        if r["failed_at"] is not None:
            rec = (r, d)
            break
    if rec is None:
        check("oom", False, f"the default settings never ran out of memory down to a cap of {cap}")
        return 1
    r, d = rec
    failed_k = r["failed_at"]
    check("oom", True, f"default settings ran out of memory at allocation {failed_k} under a cap of {cap} B")
    reports = sorted(d.glob("*-report.json"))
    check("report written", len(reports) == 1, f"{[p.name for p in d.iterdir()]}")
    if not reports:
        return 1
    rep = json.loads(reports[0].read_text())
    wi = rep.get("what_if") or {}
    allowed = rep["memory_limit_bytes"]
    check("report knows the cap", allowed is not None and abs(allowed - cap) < 2, f"{allowed} vs {cap}")
    ok = wi.get("unavailable") is None and bool(wi.get("rows")) and wi.get("recorded_oom") is True
    check("panel present", ok, wi.get("headline") or str(wi.get("unavailable")))
    if not ok:
        return 1
    text = reports[0].with_name(reports[0].name.replace("-report.json", "-report.txt")).read_text()
    check("panel in the text report", wi["headline"] in text, text[-600:])
    rows = {row["settings"]: row for row in wi["rows"]}
    check("recorded settings fail there", rows["default"]["avoids_recorded_oom"] is False, str(rows["default"]))

    def verify(setting: str) -> None:
        row = rows[setting]
        real = run_child(setting, cap, stop_after=failed_k)
        got_past = real["failed_at"] is None
        check(
            f"{setting} avoids the OOM",
            got_past == row["avoids_recorded_oom"],
            f"panel {row['avoids_recorded_oom']}, real allocator {'got past' if got_past else 'failed at'} "
            f"allocation {failed_k if got_past else real['failed_at']}",
        )
        if got_past and row["avoids_recorded_oom"]:
            check(
                f"{setting} peak reserved",
                real["peak_reserved_at_stop_bytes"] == row["peak_reserved_bytes"],
                f"panel {row['peak_reserved_bytes']}, real {real['peak_reserved_at_stop_bytes']}",
            )

    def verify_min(setting: str) -> None:
        m = rows[setting]["min_memory_bytes"]
        above = run_child(setting, m + MIB, stop_after=failed_k)
        below = run_child(setting, m - MIB, stop_after=failed_k)
        check(
            f"{setting} needs at least {m}",
            above["failed_at"] is None and below["failed_at"] is not None,
            f"cap M+1MiB: {'runs' if above['failed_at'] is None else 'fails'}, "
            f"M-1MiB: {'fails' if below['failed_at'] is not None else 'runs'}",
        )

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(verify, s) for s in rows]
        futures += [pool.submit(verify_min, s) for s in ("default", "expandable_segments:True")]
        for f in futures:
            try:
                f.result()
            except Exception as e:
                check("child", False, str(e))
    snap = Path(rep["snapshot"])
    page = tmp / "page.html"
    p = subprocess.run(
        [sys.executable, "-m", "torchmem", "snapshot", str(snap), "--html", str(page), "--memory-limit", str(allowed)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    html = page.read_text() if page.exists() else ""
    same = all(
        f"data-avoids={str(row['avoids_recorded_oom']).lower()}" in html.split(f'data-settings="{s}"', 1)[-1][:400]
        for s, row in rows.items()
        if "[" not in s and ">" not in s
    )
    check("page verdicts", p.returncode == 0 and same, p.stderr[-500:] or "same as the report")
    print(f"{'PASS' if FAILED == 0 else 'FAIL'} whatif: {FAILED} failed", flush=True)
    return 1 if FAILED else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        cap_arg, stop_arg, dir_arg = json.loads(sys.argv[2])
        child(cap_arg, stop_arg, dir_arg)
    else:
        sys.exit(main())
