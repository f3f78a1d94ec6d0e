"""The what-if panel (issue #10) against the real allocator (was scripts/gpu_check_whatif.py; ~40 s on an H200).

A real CUDA out-of-memory error under `torchmem.on_oom` and a memory cap (`set_per_process_memory_fraction`),
then every claim of the report's what-if checked against the real allocator, each run in a fresh process:

- the report has the panel, knows the cap, and says the recorded settings fail where the program failed;
- for each setting of the panel, the same program under that `PYTORCH_CUDA_ALLOC_CONF` and the same cap gets
  past the allocation that failed exactly when the panel says it avoids the OOM; where it does, its peak
  reserved (`torch.cuda.max_memory_reserved()` up to that allocation) equals the panel's to the byte;
- "needs at least M" (default settings and expandable segments): the program runs up to and including the
  allocation that failed under a cap of M + 1 MiB and fails under M - 1 MiB (reserved memory moves in 2 MiB
  steps, so these bracket M robustly against the fraction's rounding);
- `torchmem snapshot OOM.pickle --html OUT --memory-limit CAP` has the same verdicts.

The workload is torch.empty / del only (no cuBLAS workspace, no kernels), so every process replays the same
allocation sequence. The children run this file as a script (`python test_gpu_whatif.py --child ARGS`); the
module-scoped fixtures run the OOM and the verification children once (four at a time, as the script did) and
each check is a test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

MIB = 1 << 20
# The panel's settings (crates/torchmem-sim/src/search.rs, common_settings); test_every_panel_setting_is_checked
# fails if the panel has one that is not here, so no row goes unchecked.
SETTINGS = (
    "default",
    "expandable_segments:True",
    "max_split_size_mb:64",
    "max_split_size_mb:512",
    "roundup_power2_divisions:4",
    "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]",
    "garbage_collection_threshold:0.6",
)
MIN_SETTINGS = ("default", "expandable_segments:True")


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


@pytest.fixture(scope="module")
def probe() -> dict:
    return run_child(None, None)


@pytest.fixture(scope="module")
def oom(probe: dict) -> dict:
    """A cap between the peaks (as tests/fixtures/sim-h200's cap_retry): the default settings run out of memory
    from fragmentation. Lowered until they do."""
    lo, hi = probe["peak_allocated_bytes"], probe["peak_reserved_bytes"]
    tmp = Path(tempfile.mkdtemp(prefix="torchmem-whatif-"))
    cap = None
    for frac in (0.5, 0.3, 0.15, 0.05, 0.0):
        cap = int(lo + (hi - lo) * frac) // MIB * MIB + MIB // 2
        d = tmp / f"oom-{frac}"
        r = run_child(None, cap, oom_dir=str(d))
        if r["failed_at"] is not None:
            return {"r": r, "dir": d, "cap": cap, "tmp": tmp}
    return {"r": None, "dir": None, "cap": cap, "tmp": tmp}


def _oomed(oom: dict) -> dict:
    if oom["r"] is None:
        pytest.fail(f"the default settings never ran out of memory down to a cap of {oom['cap']}")
    return oom


@pytest.fixture(scope="module")
def report(oom: dict) -> dict:
    """The OOM report (JSON) with its text and the what-if panel's rows by setting."""
    d = _oomed(oom)["dir"]
    reports = sorted(d.glob("*-report.json"))
    if len(reports) != 1:
        pytest.fail(f"report written: {[p.name for p in d.iterdir()]}")
    rep = json.loads(reports[0].read_text())
    text = reports[0].with_name(reports[0].name.replace("-report.json", "-report.txt")).read_text()
    wi = rep.get("what_if") or {}
    return {"rep": rep, "text": text, "wi": wi, "rows": {row["settings"]: row for row in wi.get("rows") or []}}


def _panel(report: dict) -> dict:
    wi = report["wi"]
    if not (wi.get("unavailable") is None and bool(wi.get("rows")) and wi.get("recorded_oom") is True):
        pytest.fail(f"no what-if panel: {wi.get('headline') or str(wi.get('unavailable'))}")
    return report["rows"]


@pytest.fixture(scope="module")
def verified(oom: dict, report: dict) -> dict:
    """Every panel row replayed on the real allocator under the same cap (and the "needs at least M" brackets),
    four children at a time: {("avoids" | "min", setting): result dict or the exception}."""
    rows = _panel(report)
    cap, failed_k = oom["cap"], oom["r"]["failed_at"]

    def verify(setting: str) -> dict:
        return run_child(setting, cap, stop_after=failed_k)

    def verify_min(setting: str) -> dict:
        m = rows[setting]["min_memory_bytes"]
        above = run_child(setting, m + MIB, stop_after=failed_k)
        below = run_child(setting, m - MIB, stop_after=failed_k)
        return {"m": m, "above": above, "below": below}

    out: dict = {}
    with ThreadPoolExecutor(4) as pool:
        futures = {("avoids", s): pool.submit(verify, s) for s in rows}
        futures.update({("min", s): pool.submit(verify_min, s) for s in MIN_SETTINGS})
        for key, f in futures.items():
            try:
                out[key] = f.result()
            except Exception as e:
                out[key] = e
    return out


def _result(verified: dict, key: tuple[str, str]) -> dict:
    got = verified.get(key)
    if got is None:
        pytest.fail(f"{key[1]}: not a row of the what-if panel")
    if isinstance(got, Exception):
        pytest.fail(f"child: {got}")
    return got


def test_probe(probe: dict) -> None:
    assert probe["failed_at"] is None, (
        f"uncapped: failed at allocation {probe['failed_at']}; peak allocated {probe['peak_allocated_bytes']}, "
        f"reserved {probe['peak_reserved_bytes']}"
    )


def test_oom(oom: dict) -> None:
    assert oom["r"] is not None, f"the default settings never ran out of memory down to a cap of {oom['cap']}"
    print(f"default settings ran out of memory at allocation {oom['r']['failed_at']} under a cap of {oom['cap']} B")


def test_report_written(oom: dict) -> None:
    d = _oomed(oom)["dir"]
    reports = sorted(d.glob("*-report.json"))
    assert len(reports) == 1, f"{[p.name for p in d.iterdir()]}"


def test_report_knows_the_cap(oom: dict, report: dict) -> None:
    allowed = report["rep"]["memory_limit_bytes"]
    assert allowed is not None and abs(allowed - oom["cap"]) < 2, f"{allowed} vs {oom['cap']}"


def test_panel_present(report: dict) -> None:
    wi = report["wi"]
    ok = wi.get("unavailable") is None and bool(wi.get("rows")) and wi.get("recorded_oom") is True
    assert ok, wi.get("headline") or str(wi.get("unavailable"))
    print(wi["headline"])


def test_panel_in_the_text_report(report: dict) -> None:
    _panel(report)
    assert report["wi"]["headline"] in report["text"], report["text"][-600:]


def test_recorded_settings_fail_there(report: dict) -> None:
    rows = _panel(report)
    assert rows["default"]["avoids_recorded_oom"] is False, str(rows["default"])


def test_every_panel_setting_is_checked(report: dict) -> None:
    rows = _panel(report)
    assert set(rows) <= set(SETTINGS), f"panel settings not in SETTINGS (add them): {sorted(set(rows) - set(SETTINGS))}"


@pytest.mark.parametrize("setting", SETTINGS)
def test_setting_avoids_the_oom(setting: str, oom: dict, report: dict, verified: dict) -> None:
    row = _panel(report).get(setting)
    if row is None:
        pytest.skip(f"{setting} is not a row of this panel")
    real = _result(verified, ("avoids", setting))
    failed_k = oom["r"]["failed_at"]
    got_past = real["failed_at"] is None
    assert got_past == row["avoids_recorded_oom"], (
        f"{setting} avoids the OOM: panel {row['avoids_recorded_oom']}, real allocator "
        f"{'got past' if got_past else 'failed at'} allocation {failed_k if got_past else real['failed_at']}"
    )


@pytest.mark.parametrize("setting", SETTINGS)
def test_setting_peak_reserved(setting: str, report: dict, verified: dict) -> None:
    row = _panel(report).get(setting)
    if row is None:
        pytest.skip(f"{setting} is not a row of this panel")
    real = _result(verified, ("avoids", setting))
    if not (real["failed_at"] is None and row["avoids_recorded_oom"]):
        pytest.skip(f"{setting}: no peak to compare (the panel or the real allocator says it does not get past)")
    assert real["peak_reserved_at_stop_bytes"] == row["peak_reserved_bytes"], (
        f"{setting} peak reserved: panel {row['peak_reserved_bytes']}, real {real['peak_reserved_at_stop_bytes']}"
    )


@pytest.mark.parametrize("setting", MIN_SETTINGS)
def test_setting_needs_at_least(setting: str, verified: dict) -> None:
    got = _result(verified, ("min", setting))
    above, below = got["above"], got["below"]
    assert above["failed_at"] is None and below["failed_at"] is not None, (
        f"{setting} needs at least {got['m']}: cap M+1MiB: {'runs' if above['failed_at'] is None else 'fails'}, "
        f"M-1MiB: {'fails' if below['failed_at'] is not None else 'runs'}"
    )


def test_page_verdicts(oom: dict, report: dict) -> None:
    rows = _panel(report)
    rep = report["rep"]
    allowed = rep["memory_limit_bytes"]
    snap = Path(rep["snapshot"])
    page = oom["tmp"] / "page.html"
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
    assert p.returncode == 0 and same, p.stderr[-500:] or "not the same verdicts as the report"


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        cap_arg, stop_arg, dir_arg = json.loads(sys.argv[2])
        child(cap_arg, stop_arg, dir_arg)
