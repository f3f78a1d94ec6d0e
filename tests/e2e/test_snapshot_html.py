"""`torchmem snapshot FILE --html` in a real headless browser (Debian's chromium): the page is self-contained
(no network resources), its scripts run, and they draw the stacked timeline bands, the icicle of the peak
and the segment map from the real GPT-2 snapshot. Skipped only when chromium is absent."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from browser import NEEDS_CHROMIUM, chromium

pytestmark = NEEDS_CHROMIUM

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "snapshots"


def dump_dom(html: Path) -> str:
    r = chromium("--dump-dom", html.as_uri())
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


@pytest.mark.parametrize("name", ["snapshot_gpt2_bs8_amp_cppstacks.pickle", "snapshot_mlp_adam_pystacks.pickle"])
def test_html_renders_offline_in_chromium(tmp_path: Path, name: str) -> None:
    out = tmp_path / "report.html"
    r = subprocess.run(
        [sys.executable, "-m", "torchmem", "snapshot", str(FIX / name), "--html", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    page = out.read_text()
    # self-contained: no external scripts, styles, images or fetches
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert "fetch(" not in page and "import(" not in page
    dom = dump_dom(out)
    assert 'data-rendered="1"' in dom, "the page's script did not finish"
    bands = re.findall(r'<path[^>]*class="band"', dom)
    assert 2 <= len(bands) <= 13  # top sites + "other sites"
    nodes = re.findall(r'<rect[^>]*class="node"', dom)
    assert len(nodes) >= 3
    runs = re.findall(r'<rect[^>]*class="run"', dom)
    assert len(runs) >= 10
    assert "probe.py" in dom  # a user frame in the legend / icicle
    # the y axis of the stacked timeline is labelled up to the traced peak (requested bytes)
    peak = subprocess.run(
        [sys.executable, "-m", "torchmem", "snapshot", str(FIX / name), "--json"], capture_output=True, text=True
    )
    peak_gib = json.loads(peak.stdout)["summary"]["devices"][0]["peak_requested_bytes"] / (1 << 30)
    if peak_gib >= 1:
        assert f"{peak_gib:.2f} GiB" in dom
    assert out.stat().st_size < 2_000_000
