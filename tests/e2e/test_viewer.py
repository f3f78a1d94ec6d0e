"""`torchmem view` in a real headless chromium (Debian's package, driven over the DevTools pipe by
tests/cdp.py): real H200 snapshots and simulation traces load, hovering a known allocation shows its whole
Python stack, search and a click on a match zoom to that one block, wheel / drag / keys move the view, two
files are shown side by side, the OOM event of a real capped replay is marked, strings from the file stay
text (no script runs from them), the server refuses requests without its token, Ctrl-C ends it cleanly, and
the offline page (-o) works from file:// with the same script. Skipped only when chromium is absent."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from browser import NEEDS_CHROMIUM

pytestmark = NEEDS_CHROMIUM

FIX = Path(__file__).resolve().parents[1] / "fixtures"
MLP = FIX / "snapshots" / "snapshot_mlp_adam_pystacks.pickle"
GPT2 = FIX / "sim-h200" / "gpt2_adamw_amp__recorded.pickle.gz"
CAP_OOM = FIX / "sim-h200" / "gpt2_adamw_amp__replay__cap_oom.pickle.gz"
PROFILE = FIX / "profile_v1.sqlite"
ESTIMATE = FIX / "estimator-h200" / "gpt2_adamw_amp_b8__estimator.pickle.gz"
XSS = "</script><img src=x onerror=alert(1)>"


def torchmem(*args: str) -> list[str]:
    return [sys.executable, "-m", "torchmem", *args]


def load_pickle(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        return pickle.load(f)


def frame_text(f: dict) -> str:
    return f"{f['filename']}:{f['line']}:{f['name']}"


@contextmanager
def served(*files: Path) -> Iterator[str]:
    """Runs `torchmem view FILES --no-browser`, yields its URL, then ends it with Ctrl-C (SIGINT) and checks
    that it stopped cleanly."""
    proc = subprocess.Popen(
        torchmem("view", *map(str, files), "--no-browser"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), (url, proc.stderr.read() if proc.poll() is not None else "")
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, err
    assert "viewer stopped" in err


@pytest.fixture
def page() -> Iterator:
    from cdp import Page

    p = Page()
    try:
        yield p
    finally:
        p.close()


def open_view(page, url: str) -> None:
    page.goto(url)
    page.wait("document.body && (document.body.dataset.ready === '1' || document.body.dataset.error)", 60)
    assert page.js("document.body.dataset.error || ''") == ""
    assert page.errors() == []


def hover_band(page, doc: int, band_id: int) -> str:
    rect = page.js(f"tmViewer.bandRect({doc}, {band_id})")
    assert rect, f"allocation {band_id} is not drawn as a band"
    x, y = rect["left"] + rect["width"] / 2, rect["top"] + rect["height"] / 2
    page.mouse("mouseMoved", x - 1, y)
    page.mouse("mouseMoved", x, y)
    page.wait(f"!document.getElementById('tip').hidden && tmViewer.panels[{doc}].hoverId === {band_id}")
    return page.js("document.getElementById('tip').textContent")


def search(page, query: str) -> None:
    """Types `query` into the search box and presses Enter (a real key event)."""
    page.js(f"(() => {{ const s = document.getElementById('search'); s.value = {json.dumps(query)}; s.focus(); }})()")
    page.key("Enter")


def band_for(page, doc: int, t0: int, size: int) -> int:
    found = page.js(
        f"(tmViewer.panels[{doc}].res.bands.find(b => b.t0 === {t0} && b.size === {size}) || {{id: null}}).id"
    )
    assert found is not None, f"no band for the allocation at event {t0} ({size} bytes)"
    return found


def test_hover_shows_the_whole_stack_of_a_known_allocation(page) -> None:
    snap = load_pickle(MLP)
    trace = snap["device_traces"][0]

    # The largest allocation freed inside the trace whose stack reaches the user's script.
    def freed_at(i: int, e: dict) -> int | None:
        return next(
            (
                j
                for j in range(i + 1, len(trace))
                if trace[j]["action"] == "free_completed" and trace[j]["addr"] == e["addr"]
            ),
            None,
        )

    i, e = max(
        ((i, e) for i, e in enumerate(trace) if e["action"] == "alloc" and e.get("frames") and freed_at(i, e)),
        key=lambda ie: ie[1]["size"],
    )
    j = freed_at(i, e)
    assert any("probe.py" in f["filename"] for f in e["frames"])
    with served(MLP) as url:
        open_view(page, url)
        meta = page.js("JSON.stringify(tmViewer.panels[0].m)")
        assert json.loads(meta)["events"] == len(trace)
        # The icicle of the peak holds the traced peak's bytes; hovering its widest frame below the root names
        # a frame of the user's script.
        page.wait("tmViewer.panels[0].iceRects && tmViewer.panels[0].iceRects.length > 1")
        assert int(page.js("tmViewer.panels[0].iceSum.dataset.bytes")) == json.loads(meta)["peak_bytes"]
        node = page.js(
            "(() => { const p = tmViewer.panels[0], r = p.iceCv.getBoundingClientRect();"
            " const q = p.iceRects.filter(q => q.y > 0 && q.n.name.includes('probe.py')).sort((a, b) => b.w - a.w)[0];"
            " return {x: r.left + q.x + q.w / 2, y: r.top + q.y + 5, name: q.n.name}; })()"
        )
        page.mouse("mouseMoved", node["x"], node["y"])
        page.wait(f"document.getElementById('tip').textContent.includes({json.dumps(node['name'])})")
        tip = hover_band(page, 0, band_for(page, 0, i, e["size"]))
        for f in e["frames"]:
            assert frame_text(f) in tip
        assert f"events {i} → {j}" in tip  # its lifetime
        # Click pins it: the detail panel keeps the stack, and the segments view moves to that moment.
        rect = page.js("tmViewer.bandRect(0, tmViewer.panels[0].hoverId)")
        page.click(rect["left"] + rect["width"] / 2, rect["top"] + rect["height"] / 2)
        page.wait("tmViewer.panels[0].pin !== null")
        page.wait("document.querySelector('.detail').textContent.includes('Pinned allocation')")
        assert frame_text(e["frames"][0]) in page.js("document.querySelector('.detail').textContent")
        page.wait("document.querySelector('.segsum').textContent.includes('free inside segments')")
        # The record_function annotations (the optimizer's step) are a lane above the bands; hover names one.
        names = {a["name"] for a in snap["external_annotations"] if a["stage"] == "START"}
        spans = page.js("tmViewer.panels[0].spans")
        assert {s["name"] for s in spans} == names
        step = next(s for s in spans if s["name"].startswith("Optimizer.step"))
        page.key("0")
        x = page.js(f"tmViewer.panels[0].cv.getBoundingClientRect().left + tmViewer.panels[0].xOf({step['e0']})")
        y = page.js("tmViewer.panels[0].cv.getBoundingClientRect().top + 9")
        page.mouse("mouseMoved", x + 1, y)
        page.wait("document.getElementById('tip').textContent.includes('Optimizer.step')")


def test_search_highlights_matches_and_a_click_zooms_to_one_block(page) -> None:
    snap = load_pickle(MLP)
    trace = snap["device_traces"][0]
    # The smallest allocation made at a line of the user's script.
    small = min(
        (e for e in trace if e["action"] == "alloc" and any("probe.py" in f["filename"] for f in e.get("frames", []))),
        key=lambda e: e["size"],
    )
    user = next(f for f in small["frames"] if "probe.py" in f["filename"])
    query = f"probe.py:{user['line']}"
    want = sum(
        1
        for e in trace
        if e["action"] == "alloc" and any(query.lower() in frame_text(f).lower() for f in e.get("frames", []))
    )
    assert want >= 1
    with served(MLP) as url:
        open_view(page, url)
        page.js(
            f"(() => {{ const s = document.getElementById('search'); s.value = {json.dumps(query)}; s.focus(); }})()"
        )
        page.key("Enter")
        page.wait("document.querySelectorAll('#results button.hit').length > 0")
        page.wait("tmViewer.panels[0].sec.dataset.searchTotal !== undefined")
        assert int(page.js("tmViewer.panels[0].sec.dataset.searchTotal")) == want
        assert f"{want} allocation(s) match" in page.js("document.getElementById('results').textContent")
        # Click the result for the smallest match: the view zooms onto that one block.
        ids = page.js("[...document.querySelectorAll('#results button.hit')].map(b => +b.dataset.id)")
        sizes = page.js(
            f"Promise.all({json.dumps(ids)}.map(i => fetch('api/block?doc=0&id=' + i).then(r => r.json())))"
        )
        k = min(range(len(ids)), key=lambda j: sizes[j]["size"])
        target = {"id": ids[k]}
        page.js(f"document.querySelectorAll('#results button.hit')[{k}].scrollIntoView()")
        r = page.js(f"document.querySelectorAll('#results button.hit')[{k}].getBoundingClientRect().toJSON()")
        page.click(r["x"] + 5, r["y"] + r["height"] / 2)
        page.wait(f"tmViewer.panels[0].pin === {target['id']}")
        tid = target["id"]
        page.wait(f"(() => {{ const r = tmViewer.bandRect(0, {tid});return r && r.width > 300 && r.height > 99; }})()")
        view = page.js("tmViewer.view(0)")
        block = page.js(f"fetch('api/block?doc=0&id={target['id']}').then(r => r.json())")
        assert view["t1"] - view["t0"] < 2 * max(1, (block["t1"] or len(trace)) - block["t0"]) + 1
        assert view["y1"] - view["y0"] <= 2 * block["size"] + 1
        assert query in "\n".join(block["stack"])


def test_wheel_drag_and_keys_zoom_and_pan(page) -> None:
    with served(GPT2) as url:
        open_view(page, url)
        v0 = page.js("tmViewer.view(0)")
        r = page.js("tmViewer.panels[0].cv.getBoundingClientRect().toJSON()")
        cx, cy = r["x"] + r["width"] * 0.6, r["y"] + r["height"] * 0.5
        for _ in range(5):
            page.wheel(cx, cy, -300)
        page.wait(f"tmViewer.view(0).t1 - tmViewer.view(0).t0 < {(v0['t1'] - v0['t0']) / 4}")
        page.wait("document.getElementById('status').textContent.includes('bands')")
        v1 = page.js("tmViewer.view(0)")
        page.mouse("mousePressed", cx, cy, button="left", clickCount=1, buttons=1)
        page.mouse("mouseMoved", cx + 200, cy, buttons=1)
        page.mouse("mouseReleased", cx + 200, cy, button="left", clickCount=1)
        v2 = page.js("tmViewer.view(0)")
        assert v2["t0"] < v1["t0"], (v1, v2)
        page.key("+")
        v3 = page.js("tmViewer.view(0)")
        assert v3["t1"] - v3["t0"] < v2["t1"] - v2["t0"]
        page.key("ArrowRight")
        assert page.js("tmViewer.view(0)")["t0"] > v3["t0"]
        page.key("0")
        assert page.js("tmViewer.view(0)")["t1"] - page.js("tmViewer.view(0)")["t0"] == v0["t1"] - v0["t0"]
        assert page.errors() == []


def test_two_files_side_by_side_with_the_oom_marked(page) -> None:
    oom = [e for e in load_pickle(CAP_OOM)["device_traces"][0] if e["action"] == "oom"]
    assert len(oom) == 1  # a real H200 trace replayed under a memory cap
    with served(GPT2, CAP_OOM) as url:
        open_view(page, url)
        assert page.js("tmViewer.panels.length") == 2
        summary = page.js("document.querySelector('.diffsum').textContent")
        assert GPT2.name in summary and CAP_OOM.name in summary and "Diff: traced peak" in summary
        assert page.js("tmViewer.panels.every(p => p.res && p.res.bands.length > 0)")
        # The table by site at each trace's peak: each column adds up to that trace's traced peak.
        page.wait("document.querySelectorAll('.difftable tr').length > 2")
        diff = page.js("fetch('api/diff?a=0&b=1').then(r => r.json())")
        for col, doc in (("a_bytes", 0), ("b_bytes", 1)):
            assert sum(r[col] for r in diff["rows"]) == page.js(f"tmViewer.panels[{doc}].m.peak_bytes")
        assert page.js("document.querySelectorAll('.difftable tr').length") == len(diff["rows"]) + 1
        # The OOM marker: in the second panel only, visible, at its event.
        assert page.js("tmViewer.panels[0].sec.querySelectorAll('.oom').length") == 0
        marker = page.js(
            "(() => { const d = tmViewer.panels[1].sec.querySelector('.oom'); "
            "return {hidden: d.hidden, text: d.textContent, event: +d.dataset.event}; })()"
        )
        assert not marker["hidden"] and marker["text"].startswith("OOM: ")
        trace = load_pickle(CAP_OOM)["device_traces"][0]
        assert marker["event"] == next(i for i, e in enumerate(trace) if e["action"] == "oom")
        # Zooming one side moves the other to the same fraction of its trace.
        r = page.js("tmViewer.panels[0].cv.getBoundingClientRect().toJSON()")
        for _ in range(3):
            page.wheel(r["x"] + r["width"] / 2, r["y"] + 100, -400)
        a, b = page.js("tmViewer.view(0)"), page.js("tmViewer.view(1)")
        ea, eb = page.js("tmViewer.panels[0].m.events"), page.js("tmViewer.panels[1].m.events")
        assert a["t1"] - a["t0"] < ea / 2
        assert abs(a["t0"] / ea - b["t0"] / eb) < 1e-6 and abs(a["t1"] / ea - b["t1"] / eb) < 1e-6


def xss_snapshot(path: Path) -> None:
    frames = [
        {"filename": XSS, "name": "<b onmouseover=alert(2)>f</b>", "line": 7},
        {"filename": "/home/u/train.py", "name": "step", "line": 42},
    ]
    entry = {"action": "alloc", "addr": 1 << 20, "size": 1 << 20, "stream": 0, "time_us": 1, "frames": frames}
    entry["user_metadata"] = XSS
    free = dict(entry, action="free_completed", time_us=5)
    other = dict(entry, addr=3 << 20, size=1 << 19, time_us=2, frames=frames[1:])
    snap = {
        "segments": [],
        "device_traces": [[entry, other, dict(other, action="free_completed", time_us=3), free]],
        "allocator_settings": {},
        "external_annotations": [],
    }
    path.write_bytes(pickle.dumps(snap, protocol=4))


def assert_stays_text(page) -> None:
    band = page.js("tmViewer.panels[0].res.bands.find(b => b.size === 1048576).id")
    tip = hover_band(page, 0, band)
    assert XSS in tip and "<b onmouseover=alert(2)>f</b>" in tip
    search(page, XSS)
    page.wait("document.querySelectorAll('#results button.hit').length === 1")
    time.sleep(0.3)
    assert page.js("document.querySelectorAll('img').length") == 0
    assert page.js("document.querySelectorAll('b[onmouseover]').length") == 0
    assert page.dialogs() == [], "a string from the file ran as script"


def test_strings_from_the_file_stay_text_served_and_offline(page, tmp_path: Path) -> None:
    snap = tmp_path / "xss.pickle"
    xss_snapshot(snap)
    with served(snap) as url:
        open_view(page, url)
        assert_stays_text(page)
    out = tmp_path / "xss.html"
    r = subprocess.run(torchmem("view", str(snap), "-o", str(out)), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    html = out.read_text()
    assert XSS not in html  # the data block escapes < and >, so the string cannot close it
    open_view(page, out.as_uri())
    assert_stays_text(page)


def test_the_server_refuses_requests_without_its_token() -> None:
    with served(MLP) as url:
        base, token = url.rstrip("/").rsplit("/", 1)
        wrong_last = "1" if token[-1] == "0" else "0"  # the token with its last digit changed
        with urllib.request.urlopen(url + "api/meta") as r:
            assert r.status == 200
            csp = r.headers["Content-Security-Policy"]
            assert csp.startswith(
                "default-src 'none'; script-src 'self'; style-src 'self'; img-src data:; connect-src 'self'"
            )
        for bad in [base + "/", base + "/api/meta", base + "/viewer.js", f"{base}/{token[:-1]}{wrong_last}/api/meta"]:
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(bad)
            assert e.value.code == 403, bad
            assert token not in e.value.read().decode()
        req = urllib.request.Request(url + "api/meta", headers={"Host": "attacker.example"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req)
        assert e.value.code == 403
        assert len(token) == 32


def test_offline_page_works_from_a_file_and_never_replaces_a_foreign_file(page, tmp_path: Path) -> None:
    out = tmp_path / "mlp.html"
    r = subprocess.run(torchmem("view", str(MLP), "-o", str(out)), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    html = out.read_text()
    assert "connect-src 'none'" in html and "'sha256-" in html and "unsafe-inline" not in html
    open_view(page, out.as_uri())
    snap = load_pickle(MLP)
    trace = snap["device_traces"][0]
    i, e = max(
        ((i, e) for i, e in enumerate(trace) if e["action"] == "alloc" and e.get("frames")),
        key=lambda ie: ie[1]["size"],
    )
    tip = hover_band(page, 0, band_for(page, 0, i, e["size"]))
    for f in e["frames"]:
        assert frame_text(f) in tip
    # Written again over our own page: fine. Over a file torchmem did not write: refused, file untouched.
    r = subprocess.run(torchmem("view", str(MLP), "-o", str(out)), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    foreign = tmp_path / "notes.html"
    foreign.write_text("<html>my notes</html>")
    r = subprocess.run(torchmem("view", str(MLP), "-o", str(foreign)), capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--force" in r.stderr, r.stderr
    assert foreign.read_text() == "<html>my notes</html>"


def test_a_run_profile_shows_series_and_lanes(page) -> None:
    with served(PROFILE) as url:
        open_view(page, url)
        assert page.js("tmViewer.panels[0].type") == "profile"
        res = page.js("tmViewer.panels[0].res")
        assert len(res["series"]) >= 1
        assert any(v is not None for s in res["series"] for v in s["max"])
        legend = page.js("tmViewer.panels[0].legend.textContent")
        assert "CPU RSS" in legend


def test_an_estimate_trace_and_a_simulation_trace_side_by_side(page) -> None:
    # The estimator's trace of GPT-2 (AdamW, AMP, batch 8) next to the simulator's replay of the real recording.
    replay = FIX / "sim-h200" / "gpt2_adamw_amp__replay__default.pickle.gz"
    with served(ESTIMATE, replay) as url:
        open_view(page, url)
        kinds = page.js("tmViewer.panels.map(p => p.m.kind)")
        assert kinds == ["estimate trace", "simulation trace"]
        for doc, path in enumerate([ESTIMATE, replay]):
            trace = load_pickle(path)["device_traces"][0]
            assert page.js(f"tmViewer.panels[{doc}].m.events") == len(trace)
            assert page.js(f"tmViewer.panels[{doc}].res.bands.length") > 0
            peak = page.js(f"tmViewer.panels[{doc}].m.peak_bytes")
            assert fmt_gib(peak) in page.js(f"tmViewer.panels[{doc}].sec.querySelector('.meta').textContent")


def test_a_profile_puts_its_epoch_and_step_lanes_above_a_trace_of_the_same_run(page, tmp_path: Path) -> None:
    import torchmem

    prof = torchmem.load_profile(str(PROFILE))
    start_us = prof.meta["started_unix_s"] * 1e6
    steps = [m for m in prof.markers if m["kind"] == "step" and m["edge"] == "start"]
    assert len(steps) >= 2
    first, last = min(m["t_ns"] for m in prof.markers), max(m["t_ns"] for m in prof.markers)
    # A trace over the same wall-clock time (what _record_memory_history would record next to the run): one
    # alloc/free pair every 5 ms, stamped in Unix microseconds like torch's.
    t, trace = start_us + first / 1000 - 10_000, []
    while t < start_us + last / 1000 + 10_000:
        e = {"action": "alloc", "addr": 1 << 20, "size": 4096, "stream": 0, "time_us": int(t), "frames": []}
        trace += [e, dict(e, action="free_completed", time_us=int(t) + 2500)]
        t += 5000
    snap = tmp_path / "same_run.pickle"
    snap.write_bytes(pickle.dumps({"segments": [], "device_traces": [trace]}, protocol=4))
    with served(snap, PROFILE) as url:
        open_view(page, url)
        lanes = page.js("tmViewer.panels[0].lanes")
        assert "epoch" in lanes and "step" in lanes
        spans = page.js("tmViewer.panels[0].spans.filter(s => s.lane === 'step')")
        assert len(spans) == len(steps)
        times = [e["time_us"] for e in trace]
        for sp, m in zip(sorted(spans, key=lambda s: s["e0"]), sorted(steps, key=lambda m: m["t_ns"]), strict=True):
            want = next(i for i, x in enumerate(times) if x >= start_us + m["t_ns"] / 1000)
            assert abs(sp["e0"] - want) <= 1, (sp, want)
        sp = max(spans, key=lambda s: s["e1"] - s["e0"])
        x = page.js(
            f"tmViewer.panels[0].cv.getBoundingClientRect().left + tmViewer.panels[0].xOf({(sp['e0'] + sp['e1']) / 2})"
        )
        y = page.js("tmViewer.panels[0].cv.getBoundingClientRect().top + tmViewer.panels[0].laneY('step') + 8")
        page.mouse("mouseMoved", x, y)
        page.wait("document.getElementById('tip').textContent.includes('step from the run profile')")


def fmt_gib(b: int) -> str:
    return f"{b / (1 << 30):.2f} GiB"


def test_it_opens_the_browser_named_by_BROWSER(tmp_path: Path) -> None:
    seen = tmp_path / "opened.txt"
    script = tmp_path / "browser.sh"
    script.write_text(f'#!/bin/sh\necho "$1" > {seen}\n')
    script.chmod(0o755)
    env = dict(os.environ, BROWSER=str(script))
    proc = subprocess.Popen(
        torchmem("view", str(MLP)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        deadline = time.monotonic() + 20
        while not (seen.exists() and seen.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert seen.read_text().strip() == url
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=10)
    assert proc.returncode == 0


def test_bad_input_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.pickle"
    bad.write_bytes(b"\x80\x04not a pickle")
    r = subprocess.run(torchmem("view", str(bad), "--no-browser"), capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "bad.pickle" in r.stderr
    r = subprocess.run(torchmem("view", str(tmp_path / "missing.pickle")), capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "no such file" in r.stderr
