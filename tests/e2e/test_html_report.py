"""`torchmem plot` in a real headless browser (Debian's chromium).

Records a real run (`torchmem run` on a small torch training loop with a Monitor), writes the HTML page, then
loads it in chromium: the DOM after the scripts ran must hold the hover read-out with the values the profile
holds at that moment (reached through a `#t=` link and through a real `mousemove` event on the chart), and a
screenshot must show the chart's line and bands in their colours. The phase lane stacks every phase's share
(no majority vote), epoch bands carry their number and peak, headings are not doubled, and in a line profile a
line that freed memory is shaded differently from one that allocated. Skipped only when chromium is absent.
"""

from __future__ import annotations

import csv
import io
import json
import re
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from browser import NEEDS_CHROMIUM, chromium
from cli import torchmem

pytestmark = NEEDS_CHROMIUM

CPU_RSS_RGB = (0x1F, 0x77, 0xB4)
# phase lane colours (#9467bd, #17becf) drawn at 75 % opacity on white
PHASE_RGB = {"forward": (175, 141, 206), "backward": (81, 206, 219)}

TRAIN = """
import time
import torch
import torchmem

model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
mon = torchmem.Monitor(model, opt)
for epoch in range(3):
    with mon.epoch():
        big = torch.ones(64 * 1024 * 1024 // 4) if epoch == 1 else None  # 64 MiB during epoch 1
        for step in range(5):
            with mon.step():
                loss = model(torch.randn(64, 256)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            time.sleep(0.05)
        del big
        time.sleep(0.2)
"""

MIB = 1 << 20


def fmt_bytes(b: int) -> str:
    """The report's byte format (units.rs and the page's script)."""
    if b >= 1 << 30:
        return f"{b / (1 << 30):.2f} GiB"
    if b >= MIB:
        return f"{b / MIB:.1f} MiB"
    if b >= 1024:
        return f"{b / 1024:.1f} KiB"
    return f"{b} B"


def read_png(path: Path) -> tuple[int, int, list[bytearray]]:
    """Decodes an 8-bit, non-interlaced RGB/RGBA PNG (what chromium writes) into rows of RGBA bytes."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat = 8, b""
    width = height = color_type = 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color_type, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and color_type in (2, 6) and interlace == 0, (depth, color_type, interlace)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    bpp = 4 if color_type == 6 else 3
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows: list[bytearray] = []
    prev = bytearray(stride)
    for y in range(height):
        start = y * (stride + 1)
        ftype, line = raw[start], bytearray(raw[start + 1 : start + 1 + stride])
        if ftype == 1:
            for i in range(bpp, stride):
                line[i] = (line[i] + line[i - bpp]) & 0xFF
        elif ftype == 2:
            line = bytearray((a + b) & 0xFF for a, b in zip(line, prev, strict=False))
        elif ftype == 3:
            for i in range(stride):
                left = line[i - bpp] if i >= bpp else 0
                line[i] = (line[i] + ((left + prev[i]) >> 1)) & 0xFF
        elif ftype == 4:
            for i in range(stride):
                a = line[i - bpp] if i >= bpp else 0
                b = prev[i]
                c = prev[i - bpp] if i >= bpp else 0
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                line[i] = (line[i] + pred) & 0xFF
        rows.append(line)
        prev = line
    if bpp == 3:
        rows = [bytearray(b for i in range(0, stride, 3) for b in (*r[i : i + 3], 255)) for r in rows]
    return width, height, rows


def pixels_near(rows: list[bytearray], rgb: tuple[int, int, int], tol: int = 40) -> list[tuple[int, int]]:
    out = []
    r0, g0, b0 = rgb
    for y, row in enumerate(rows):
        for x in range(0, len(row), 4):
            if abs(row[x] - r0) + abs(row[x + 1] - g0) + abs(row[x + 2] - b0) <= tol:
                out.append((x // 4, y))
    return out


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    d = tmp_path_factory.mktemp("html")
    script = d / "train.py"
    script.write_text(TRAIN)
    prof = d / "run.sqlite"
    r = torchmem("run", "-o", str(prof), "--", sys.executable, str(script))
    assert r.returncode == 0, r.stderr
    page = d / "run.html"
    r = torchmem("plot", str(prof), "-o", str(page))
    assert r.returncode == 0, r.stderr
    report = json.loads(torchmem("report", str(prof), "--format", "json").stdout)
    timeline = list(csv.DictReader(io.StringIO(torchmem("report", str(prof), "--format", "csv").stdout)))
    return {"dir": d, "page": page, "report": report, "timeline": timeline}


def chart_data(html: str) -> dict[str, object]:
    m = re.search(r'<script type="application/json" id="tm-data">(.*?)</script>', html, re.S)
    assert m, "no chart data block"
    return json.loads(m.group(1))


def readout(dom: str) -> tuple[float, str]:
    m = re.search(r'<div id="tm-readout" data-t="([0-9.]+)">(.*?)</div>', dom, re.S)
    assert m, "the read-out was not filled: " + dom[dom.find('id="tm-readout"') - 20 :][:400]
    return float(m.group(1)), m.group(2)


def rss_range(timeline: list[dict[str, str]], t0: float, t1: float) -> tuple[int, int]:
    """Min and max CPU RSS in [t0, t1], with the last sample before t0 (the read-out carries it forward
    over pixel columns without a sample)."""
    before = [int(r["cpu_rss_bytes"]) for r in timeline if float(r["t_s"]) < t0][-1:]
    vals = before + [int(r["cpu_rss_bytes"]) for r in timeline if t0 <= float(r["t_s"]) <= t1]
    assert vals, (t0, t1)
    return min(vals), max(vals)


def parse_bytes(shown: str) -> tuple[float, float]:
    """'779.3 MiB' -> (bytes, half of the last shown digit in bytes)."""
    number, unit = shown.split()
    scale = {"B": 1, "KiB": 1024, "MiB": MIB, "GiB": 1 << 30}[unit]
    decimals = len(number.partition(".")[2])
    return float(number) * scale, 0.5 * 10**-decimals * scale


def check_readout_at(recorded: dict[str, object], t_read: float, text: str) -> None:
    data = chart_data(recorded["page"].read_text())
    bucket_s = data["t_end_s"] / data["n"]
    # the CPU RSS shown is the highest value the profile holds in that pixel column (± a column for rounding)
    m = re.search(r"CPU RSS: <b>([0-9.]+ [KMG]?i?B)", text)
    assert m, text
    shown, tol = parse_bytes(m.group(1))
    lo, hi = rss_range(recorded["timeline"], t_read - 1.5 * bucket_s, t_read + 1.5 * bucket_s)
    assert lo - tol <= shown <= hi + tol, (m.group(1), fmt_bytes(lo), fmt_bytes(hi))
    # the epoch named is the one the profile has at that time
    inside = [label for (s, e, label) in data["epochs"] if s <= t_read < e]
    if inside:
        assert inside[0] in text, (inside, text)
    assert "GPU" not in text, "a CPU-only run shows no GPU series: " + text


def test_page_is_offline_and_small(recorded: dict[str, object]) -> None:
    html = recorded["page"].read_text()
    for needle in ("http://", "https://", "src=", "<link", "@import", "url("):
        assert needle not in html, f"{needle!r} in the page: it must work offline"
    assert len(html) < 400 * 1024, len(html)
    data = chart_data(html)
    assert [s["label"] for s in data["series"]] == ["CPU RSS"]
    assert len(data["epochs"]) == 3, data["epochs"]
    assert {"forward", "backward"} <= {p[2] for p in data["phases"]}, data["phases"]


def test_hover_readout_from_a_link(recorded: dict[str, object]) -> None:
    data = chart_data(recorded["page"].read_text())
    # the middle of the second epoch, where the 64 MiB tensor lives
    s, e, label = data["epochs"][1]
    t = (s + e) / 2
    r = chromium("--dump-dom", recorded["page"].as_uri() + f"#t={t:.3f}")
    assert r.returncode == 0, r.stderr
    assert 'data-chart="ready"' in r.stdout, "the page's script did not run"
    t_read, text = readout(r.stdout)
    assert abs(t_read - t) <= 2 * data["t_end_s"] / data["n"], (t_read, t)
    assert label in text, text
    check_readout_at(recorded, t_read, text)


def test_hover_readout_follows_a_real_mouse_event(recorded: dict[str, object]) -> None:
    """Dispatches a mousemove at 3/4 of the chart's width, through the browser's own layout and SVG maths."""
    html = recorded["page"].read_text()
    probe = """<script>
    (function () {
      var svg = document.getElementById("tm-chart");
      var D = JSON.parse(document.getElementById("tm-data").textContent);
      var r = svg.getBoundingClientRect(), scale = r.width / svg.viewBox.baseVal.width;
      var x = r.left + (D.left + 0.75 * D.plot_w) * scale, y = r.top + (D.top + D.plot_h / 2) * scale;
      svg.dispatchEvent(new MouseEvent("mousemove", {clientX: x, clientY: y, bubbles: true}));
      document.body.setAttribute("data-probe-t", (0.75 * D.t_end_s).toFixed(3));
    })();
    </script></body>"""
    probed = recorded["dir"] / "probe.html"
    probed.write_text(html.replace("</body>", probe))
    r = chromium("--dump-dom", probed.as_uri())
    assert r.returncode == 0, r.stderr
    m = re.search(r'data-probe-t="([0-9.]+)"', r.stdout)
    assert m, "the probe did not run"
    t_read, text = readout(r.stdout)
    data = chart_data(html)
    assert abs(t_read - float(m.group(1))) <= 2 * data["t_end_s"] / data["n"], (t_read, m.group(1))
    check_readout_at(recorded, t_read, text)


def test_screenshot_shows_the_chart(recorded: dict[str, object]) -> None:
    shot = recorded["dir"] / "shot.png"
    r = chromium(f"--screenshot={shot}", "--window-size=1300,760", recorded["page"].as_uri() + "#t=1")
    assert shot.exists(), r.stderr
    width, height, rows = read_png(shot)
    assert (width, height) == (1300, 760)
    line = pixels_near(rows, CPU_RSS_RGB)
    xs = {x for x, _ in line}
    ys = [y for _, y in line]
    # the RSS line crosses most of the plot's width and climbs (RSS grows from the interpreter's start)
    assert len(xs) > 700, f"only {len(xs)} columns hold the CPU RSS colour"
    assert max(ys) - min(ys) > 100, (min(ys), max(ys))
    for name, rgb in PHASE_RGB.items():
        assert len(pixels_near(rows, rgb, tol=12)) > 20, f"no {name} band in the phase lane"
    # epochs: the shaded bands are a faint blue-grey tint (#4a5a8a at 7 % on white) inside the plot
    plot_rows = rows[min(ys) : max(ys) + 1]
    tint = pixels_near(plot_rows, (242, 243, 247), tol=4)
    assert len(tint) > 10_000, len(tint)


def test_phase_lane_shows_every_phase_and_epochs_their_peak(recorded: dict[str, object]) -> None:
    html = recorded["page"].read_text()
    data = chart_data(html)
    recorded_phases = {p["name"] for p in recorded["report"]["phases"]}
    in_lane = {name for (_s, _e, parts) in data["phase_mix"] for name, _pct in parts}
    assert {"forward", "backward"} <= recorded_phases <= in_lane | {"step"}, (recorded_phases, in_lane)
    # the shares of a column add up to at most 100 % of its time
    assert all(sum(pct for _n, pct in parts) <= 101 for (_s, _e, parts) in data["phase_mix"])
    s, e, label = data["epochs"][1]
    assert label.startswith("epoch 1 (peak CPU RSS ") and label.endswith("iB)"), label
    # the 64 MiB tensor lives in epoch 1: its peak is the highest of the three
    peak = [parse_bytes(lbl.split("RSS ")[1].rstrip(")"))[0] for (_s, _e, lbl) in data["epochs"]]
    assert peak[1] == max(peak) and peak[1] - min(peak) > 40 * MIB, peak
    assert html.count(">Memory journey</h") == 1
    assert "Epochs are the shaded bands" in html and "stacks, in each pixel column" in html
    # in the browser: the read-out names the phases under the cursor with their shares
    busy = max(data["phase_mix"], key=lambda b: len(b[2]))
    r = chromium("--dump-dom", recorded["page"].as_uri() + f"#t={(busy[0] + busy[1]) / 2:.4f}")
    _t, text = readout(r.stdout)
    # A phase shorter than 1 % of the window reads "<1%" (escaped in the readout's HTML as "&lt;1%").
    assert re.search(r"phases [a-z_]+ (?:&lt;|<)?\d+%", text), text


LINES = """
@profile
def work():
    a = b"x" * (64 << 20)
    b = a + b"y"
    del a
    return len(b)

work()
"""


def test_line_profile_frees_are_not_shaded_like_allocations(tmp_path: Path) -> None:
    (tmp_path / "lp.py").write_text(LINES)
    prof = tmp_path / "lp.sqlite"
    r = subprocess.run(
        [sys.executable, "-m", "torchmem", "run", "-q", "--line", "-o", str(prof), "--", sys.executable, "lp.py"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    page = tmp_path / "lp.html"
    assert torchmem("plot", str(prof), "-o", str(page)).returncode == 0
    html = page.read_text()
    rows = {
        m.group(2).strip(): m.group(1) for m in re.finditer(r"<tr([^>]*)>.*?white-space:pre\">([^<]*)</td></tr>", html)
    }
    alloc = next(attrs for src, attrs in rows.items() if src.endswith("(64 &lt;&lt; 20)"))
    assert "rgba(220,60,40" in alloc and "data-freed" not in alloc, rows
    assert 'data-freed="1"' in rows["del a"] and "rgba(40,160,90" in rows["del a"], rows
    # one heading for the line profile; no epoch/phase note on a run without them
    assert html.count("Line profile</h2>") == 1 and "Line-by-line memory" not in html
    assert "Epochs are the shaded bands" not in html and "coloured lane" not in html
    dom = chromium("--dump-dom", page.as_uri()).stdout
    assert 'data-freed="1"' in dom
