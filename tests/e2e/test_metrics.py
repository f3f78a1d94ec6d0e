"""`torchmem run --metrics` / `--metrics-textfile`: Prometheus metrics scraped over loopback while a real Python
program (torch on CPU, a Monitor with steps and phases, a child process that exits) runs under `torchmem run`,
parsed with the `prometheus-client` package's own parsers (Prometheus text and OpenMetrics), and the textfile
likewise. On CPU the CUDA and NVML series are absent, never 0."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from cli import ENV
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

PROGRAM = """
import os, subprocess, sys, time
from pathlib import Path
import torch
import torchmem

here = Path(sys.argv[1])
model = torch.nn.Linear(256, 256)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
mon = torchmem.Monitor(model, opt, verbose=False)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(180)"])
(here / "pids").write_text(f"{os.getpid()} {child.pid}")
deadline = time.monotonic() + 180
with mon.epoch():
    while time.monotonic() < deadline and not (here / "stop").exists():
        if (here / "kill-child").exists() and child.poll() is None:
            child.kill()
            child.wait()
        with mon.step():
            loss = model(torch.randn(64, 256)).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
        time.sleep(0.02)
if child.poll() is None:
    child.kill()
"""


def families(text: str, openmetrics: bool = False) -> dict:
    parse = parse_openmetrics if openmetrics else parse_text
    return {f.name: f for f in parse(text)}


def samples(fams: dict, name: str) -> list:
    fam = fams.get(name)
    return [] if fam is None else [s for s in fam.samples if s.name == name]


def wait_for(what, timeout_s: float = 90.0):
    deadline = time.monotonic() + timeout_s
    while True:
        got = what()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.1)


class Run:
    """A `torchmem run` in the background; its stderr is collected by a thread."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torchmem", "run", *args],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env=ENV,
        )
        self.stderr: list[str] = []
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()

    def address(self) -> str:
        line = wait_for(lambda: next((x for x in self.stderr if "Prometheus metrics at" in x), None))
        return line.split("http://", 1)[1].split("/metrics")[0]

    def wait(self) -> int:
        rc = self.proc.wait(timeout=120)
        time.sleep(0.1)
        return rc


def scrape(addr: str, openmetrics: bool = False) -> str:
    req = urllib.request.Request(f"http://{addr}/metrics")
    if openmetrics:
        req.add_header("Accept", "application/openmetrics-text; version=1.0.0")
    with urllib.request.urlopen(req, timeout=10) as r:
        ctype = r.headers["Content-Type"]
        assert ctype.startswith("application/openmetrics-text" if openmetrics else "text/plain; version=0.0.4"), ctype
        return r.read().decode()


def test_scrape_during_a_real_run_and_the_textfile(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(PROGRAM))
    textfile = tmp_path / "prom" / "torchmem.prom"
    textfile.parent.mkdir()
    run = Run(
        "-o",
        str(tmp_path / "p.sqlite"),
        "--metrics",
        "127.0.0.1:0",
        "--metrics-textfile",
        str(textfile),
        str(script),
        str(tmp_path),
    )
    try:
        addr = run.address()
        pids = wait_for(lambda: (tmp_path / "pids").exists() and (tmp_path / "pids").read_text().split())
        pid, child = pids

        def ready():
            f = families(scrape(addr))
            have = {s.labels["pid"] for s in samples(f, "torchmem_process_rss_bytes")}
            steps = samples(f, "torchmem_step")
            return f if {pid, child} <= have and steps and steps[0].value >= 3 else None

        f = wait_for(ready)
        rss = {s.labels["pid"]: s.value for s in samples(f, "torchmem_process_rss_bytes")}
        status = Path(f"/proc/{pid}/status").read_text()
        vmrss = int(next(x for x in status.splitlines() if x.startswith("VmRSS:")).split()[1]) * 1024
        assert 0.5 * vmrss < rss[pid] < 2 * vmrss, (rss[pid], vmrss)
        assert samples(f, "torchmem_process_pss_bytes") and samples(f, "torchmem_tree_rss_bytes")
        info = {s.labels["pid"]: s for s in samples(f, "torchmem_process_info")}
        assert info[pid].value == 1 and "train.py" in info[pid].labels["command"]
        assert info[pid].labels["host"] == socket.gethostname() and info[child].labels["ppid"] == pid
        phases = {s.labels["phase"]: s.value for s in samples(f, "torchmem_phase") if s.labels["pid"] == pid}
        assert {"forward", "backward", "optimizer step"} <= set(phases), phases
        assert sum(phases.values()) <= 1, phases
        assert [s.value for s in samples(f, "torchmem_epoch")] == [0]
        # torch on CPU, no NVML: no CUDA or GPU series at all (not zeros), not even their HELP lines.
        assert not [n for n in f if n.startswith(("torchmem_cuda_", "torchmem_gpu_"))], sorted(f)
        # The OpenMetrics exposition, through the strict parser.
        om = families(scrape(addr, openmetrics=True), openmetrics=True)
        assert {s.labels["pid"] for s in samples(om, "torchmem_process_rss_bytes")} >= {pid}
        # A process that exits loses its series.
        (tmp_path / "kill-child").write_text("")
        wait_for(
            lambda: child not in {s.labels["pid"] for s in samples(families(scrape(addr)), "torchmem_process_info")}
        )
        assert pid in {s.labels["pid"] for s in samples(families(scrape(addr)), "torchmem_process_info")}
        # The textfile: the same metrics, rewritten while the program runs.
        tf = wait_for(lambda: textfile.exists() and samples(families(textfile.read_text()), "torchmem_step"))
        assert tf[0].labels["pid"] == pid
    finally:
        (tmp_path / "stop").write_text("")
        rc = run.wait()
    assert rc == 0, "".join(run.stderr)
    final = families(textfile.read_text())
    assert not [n for n in final if n.startswith(("torchmem_process_", "torchmem_tree_", "torchmem_step"))], (
        "rewritten at the end without the finished run's processes"
    )
    assert sorted(p.name for p in textfile.parent.iterdir()) == ["torchmem.prom"], "no temporary file left"
    with pytest.raises(OSError):
        scrape(addr)


def test_a_taken_port_and_a_bad_address_are_clear_errors(tmp_path: Path) -> None:
    script = tmp_path / "noop.py"
    script.write_text("print('ran')\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = tmp_path / "p.sqlite"
        proc = subprocess.run(
            [sys.executable, "-m", "torchmem", "run", "-o", str(out), "--metrics", f"127.0.0.1:{port}", str(script)],
            capture_output=True,
            text=True,
            env=ENV,
            timeout=60,
        )
    assert proc.returncode == 1, proc.stderr
    assert f"cannot serve metrics on 127.0.0.1:{port}: the port is already in use" in proc.stderr
    assert "port 0" in proc.stderr and "ran" not in proc.stdout and not out.exists()
    bad = subprocess.run(
        [sys.executable, "-m", "torchmem", "run", "--metrics", "9464", str(script)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=60,
    )
    assert bad.returncode == 2 and "no port in '9464'" in bad.stderr and "HOST:PORT" in bad.stderr, bad.stderr
    txt = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchmem",
            "run",
            "-o",
            str(out),
            "--metrics-textfile",
            str(tmp_path / "m.txt"),
            str(script),
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=60,
    )
    assert txt.returncode == 1 and "must end in .prom" in txt.stderr and not out.exists(), txt.stderr
