"""Time to first render: `torchmem view` against PyTorch's memory_viz (`torch.cuda._memory_viz.trace_plot`, the
Active Memory Timeline) on the same snapshots, in the same headless chromium (tests/support/cdp.py drives it), plus a
generated large snapshot (--entries, 1M by default). Prints a table with the ratios.

memory_viz's page imports MemoryViz.js from cdn.jsdelivr.net and d3 from cdn.skypack.dev, so it cannot load
offline; give the two files (`--memoryviz-js`: torch/utils/viz/MemoryViz.js of pytorch's repository;
`--d3-js`: d3 5.x's dist/d3.min.js, e.g. from `npm pack d3@5`). The bench rewrites the imports to these local
files and serves both pages from 127.0.0.1. Without them only torchmem is timed.

    .venv/bin/python bench/viewer_load.py --memoryviz-js /tmp/memviz/MemoryViz.js --d3-js /tmp/d3/package/dist/d3.min.js

Timed: for torchmem, the command's start until it prints its URL (read + index), then the page's navigation
until the first LOD answer is drawn; for memory_viz, trace_plot() writing its HTML (pickle + base64 in
Python), then the page's navigation until the first timeline polygon exists. JS heap after first render from
the DevTools Performance domain; the torchmem server's peak RSS (VmHWM) then. A page not drawn within
--timeout-s is reported as such."""

from __future__ import annotations

import argparse
import functools
import gzip
import http.server
import os
import pickle
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "support"))

from cdp import Page  # noqa: E402

FIRST_RENDER = """
(() => {
  const t0 = performance.now();
  const check = () => {
    const mv = document.querySelector('svg polygon');
    const tm = window.tmViewer && tmViewer.panels.length && tmViewer.panels.every(p => p.res);
    if (mv || tm) { window.__firstRender = performance.now(); return; }
    setTimeout(check, 5);
  };
  document.addEventListener('DOMContentLoaded', check);
})();
"""


def generated_snapshot(path: Path, entries: int) -> None:
    """A training-loop-like trace of `entries` events: per step, 40 activations allocated through a Python
    stack and freed in reverse, over 400 MB of weights alive from the start (segments hold them)."""
    files = [f"/home/u/model/layer{i}.py" for i in range(8)]
    stacks = [
        [
            {"filename": files[i % 8], "line": 10 + i, "name": f"forward_{i}"},
            {"filename": "/home/u/train.py", "line": 42, "name": "train_step"},
            {"filename": "/home/u/train.py", "line": 90, "name": "main"},
        ]
        for i in range(40)
    ]
    base = 0x7F0000000000
    trace = []
    t = 1_700_000_000_000_000
    addr_of = [base + (1 << 30) + i * (64 << 20) for i in range(40)]
    while len(trace) < entries:
        for i in range(40):
            t += 3
            size = (1 + i % 7) << 20
            trace.append(
                {"action": "alloc", "addr": addr_of[i], "size": size, "stream": 0, "time_us": t, "frames": stacks[i]}
            )
        for i in reversed(range(40)):
            t += 2
            size = (1 + i % 7) << 20
            trace.append(
                {
                    "action": "free_requested",
                    "addr": addr_of[i],
                    "size": size,
                    "stream": 0,
                    "time_us": t,
                    "frames": stacks[i],
                }
            )
            trace.append(
                {
                    "action": "free_completed",
                    "addr": addr_of[i],
                    "size": size,
                    "stream": 0,
                    "time_us": t,
                    "frames": stacks[i],
                }
            )
    trace = trace[:entries]
    weights = {
        "address": base,
        "total_size": 400 << 20,
        "allocated_size": 400 << 20,
        "active_size": 400 << 20,
        "requested_size": 400 << 20,
        "stream": 0,
        "segment_type": "large",
        "segment_pool_id": (0, 0),
        "device": 0,
        "is_expandable": False,
        "blocks": [
            {
                "address": base,
                "size": 400 << 20,
                "requested_size": 400 << 20,
                "state": "active_allocated",
                "frames": stacks[0][1:],
            }
        ],
    }
    acts = {
        "address": base + (1 << 30),
        "total_size": 40 * (64 << 20),
        "allocated_size": 0,
        "active_size": 0,
        "requested_size": 0,
        "stream": 0,
        "segment_type": "large",
        "segment_pool_id": (0, 0),
        "device": 0,
        "is_expandable": False,
        "blocks": [
            {
                "address": base + (1 << 30),
                "size": 40 * (64 << 20),
                "requested_size": 0,
                "state": "inactive",
                "frames": [],
            }
        ],
    }
    snap = {"segments": [weights, acts], "device_traces": [trace], "allocator_settings": {}, "external_annotations": []}
    path.write_bytes(pickle.dumps(snap, protocol=4))


def load_snapshot(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        return pickle.load(f)


def serve_dir(directory: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(directory))
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}/"


# After torchmem's first render: ms per redraw while panning (from the last answer, as a drag does), and ms for
# a new LOD answer of a zoomed window (fetch + JSON + draw).
PAN_PROBE = """
(async () => {
  const p = tmViewer.panels[0];
  let t = performance.now();
  for (let i = 0; i < 30; i++) { const d = (p.t1 - p.t0) * 0.01; p.t0 += d; p.t1 += d; p.clamp(); p.draw(); }
  const frame = (performance.now() - t) / 30;
  p.t0 = p.m.events * 0.4; p.t1 = p.m.events * 0.45; p.clamp();
  t = performance.now();
  await p.fetch();
  return [frame, performance.now() - t];
})()
"""


def page_time(url: str, timeout_s: float, probe: str | None = None):
    """Seconds from navigation to first render, the JS heap then (MiB), and `probe`'s value; None when not
    drawn in time."""
    page = Page()
    try:
        page.call("Page.addScriptToEvaluateOnNewDocument", {"source": FIRST_RENDER})
        page.call("Performance.enable")
        page.goto(url)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                v = page.js("window.__firstRender || 0")
            except RuntimeError:
                v = 0
            if v:
                metrics = {m["name"]: m["value"] for m in page.call("Performance.getMetrics")["metrics"]}
                extra = page.js(probe) if probe else None
                return v / 1000.0, metrics.get("JSHeapUsedSize", 0) / (1 << 20), extra
            time.sleep(0.05)
        return None, None, None
    finally:
        page.close()


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def time_torchmem(cmd: list[str], snapshot: Path, timeout_s: float):
    start = time.monotonic()
    proc = subprocess.Popen(
        [*cmd, "view", str(snapshot), "--no-browser"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        ready_s = time.monotonic() - start
        assert url.startswith("http://127.0.0.1:"), url
        render_s, heap, extra = page_time(url, timeout_s, PAN_PROBE)
        frame_ms, lod_ms = extra or (None, None)
        return ready_s, render_s, heap, peak_rss_mib(proc.pid), frame_ms, lod_ms
    finally:
        proc.terminate()
        proc.wait()


def time_memory_viz(snapshot: Path, workdir: Path, mv_js: Path, d3_js: Path, timeout_s: float):
    from torch.cuda._memory_viz import trace_plot

    start = time.monotonic()
    html = trace_plot(load_snapshot(snapshot))
    prep_s = time.monotonic() - start
    # The CDN imports become local files: the same code, loaded from 127.0.0.1.
    html = re.sub(r'from "https://cdn\.jsdelivr\.net/[^"]*MemoryViz\.js"', 'from "./MemoryViz.local.js"', html)
    html = html.replace("<head>", '<head><script src="d3.min.js"></script>', 1)
    (workdir / "memory_viz.html").write_text(html)
    render_s, heap, _ = page_time(memviz_url(workdir) + "memory_viz.html", timeout_s)
    return prep_s, render_s, heap


_SERVERS: dict[Path, str] = {}


def memviz_url(workdir: Path) -> str:
    if workdir not in _SERVERS:
        _SERVERS[workdir] = serve_dir(workdir)[1]
    return _SERVERS[workdir]


def prepare_memory_viz(workdir: Path, mv_js: Path, d3_js: Path) -> None:
    js = mv_js.read_text()
    js = re.sub(r'import \* as d3 from "[^"]+";', "const d3 = window.d3;", js)
    for names in ("axisLeft", "scaleLinear", "zoom, zoomIdentity", "brushX"):
        js = re.sub(r"import \{" + names + r'\} from "[^"]+";', "const {" + names + "} = window.d3;", js)
    assert "cdn." not in js, "an import was left pointing at a CDN"
    (workdir / "MemoryViz.local.js").write_text(js)
    (workdir / "d3.min.js").write_bytes(d3_js.read_bytes())


def fmt(v: float | None, unit: str = "s") -> str:
    if v is None:
        return "not drawn"
    return f"{v:.2f} {unit}" if unit == "s" else f"{v:.1f} {unit}" if v < 10 else f"{v:.0f} {unit}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--memoryviz-js", type=Path)
    ap.add_argument("--d3-js", type=Path)
    ap.add_argument("--entries", type=int, default=1_000_000)
    ap.add_argument(
        "--torchmem", default=f"{sys.executable} -m torchmem", help="the torchmem command (default: this venv's)"
    )
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--repeat", type=int, default=3, help="runs per file and tool; the fastest is reported")
    ap.add_argument("files", nargs="*", type=Path)
    args = ap.parse_args()
    fixtures = ROOT / "tests" / "fixtures"
    files = args.files or [
        fixtures / "snapshots" / "snapshot_mlp_adam_pystacks.pickle",
        fixtures / "snapshots" / "snapshot_gpt2_bs8_amp_cppstacks.pickle",
        fixtures / "sim-h200" / "gpt2_adamw_amp__recorded.pickle.gz",
    ]
    with tempfile.TemporaryDirectory(prefix="tm-viewer-bench-") as tmp:
        work = Path(tmp)
        if args.entries:
            big = work / f"generated_{args.entries}_entries.pickle"
            generated_snapshot(big, args.entries)
            files.append(big)
        with_mv = args.memoryviz_js is not None and args.d3_js is not None
        if with_mv:
            prepare_memory_viz(work, args.memoryviz_js, args.d3_js)
        rows = []
        for f in files:
            size_mb = f.stat().st_size / 1e6
            # The fastest of --repeat runs (the machine is shared: the slower runs measure the neighbours).
            runs = [time_torchmem(args.torchmem.split(), f, args.timeout_s) for _ in range(args.repeat)]
            ready, render, heap, rss, frame_ms, lod_ms = min(runs, key=lambda r: r[0] + (r[1] or 1e9))
            tm_total = ready + render if render is not None else None
            row = [
                f.name,
                f"{size_mb:.1f} MB",
                fmt(ready),
                fmt(render),
                fmt(tm_total),
                fmt(heap, "MiB"),
                fmt(rss, "MiB"),
                fmt(frame_ms, "ms"),
                fmt(lod_ms, "ms"),
            ]
            if with_mv:
                mv_runs = [
                    time_memory_viz(f, work, args.memoryviz_js, args.d3_js, args.timeout_s) for _ in range(args.repeat)
                ]
                prep, mv_render, mv_heap = min(mv_runs, key=lambda r: r[0] + (r[1] or 1e9))
                mv_total = prep + mv_render if mv_render is not None else None
                ratio = f"{mv_total / tm_total:.1f}x" if mv_total and tm_total else "-"
                row += [fmt(prep), fmt(mv_render), fmt(mv_total), fmt(mv_heap, "MiB"), ratio]
            rows.append(row)
            # The machine is shared: say how loaded it was while this file was timed.
            print(" | ".join(row), f"(load average {os.getloadavg()[0]:.1f})", flush=True)
    head = [
        "file",
        "size",
        "torchmem: URL",
        "page",
        "total",
        "JS heap",
        "server peak RSS",
        "pan redraw",
        "zoomed LOD answer",
    ]
    if with_mv:
        head += ["memory_viz: HTML", "page", "total", "JS heap", "memory_viz / torchmem"]
    print()
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
