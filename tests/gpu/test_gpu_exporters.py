"""The exporters (`torchmem run --metrics`, `--metrics-textfile`, `--tensorboard`) on a real NVIDIA GPU (formerly
scripts/gpu_check_exporters.py).

A real `torchmem run --metrics 127.0.0.1:0 --metrics-textfile tm.prom --tensorboard tb -- python prog.py` of a CUDA
program: a `torchmem.Monitor` loop of a few steps of an `nn.Linear` on cuda (one step holds a 2 GiB spike for a
moment, so the program's lifetime peak is not what it holds at the end), then 1 GiB held inside
`torchmem.track("gpu-hold")`. While it holds, the program has written its own `torch.cuda.memory_allocated()`,
`memory_reserved()`, `max_memory_allocated()`, `max_memory_reserved()`, its pid and its parameters' bytes, and:

- the Prometheus scrape (`/metrics` over loopback, parsed with `prometheus_client.parser`) must give the
  program's `torchmem_cuda_{allocated,reserved,peak_allocated,peak_reserved}_bytes` equal to torch's numbers;
  `torchmem_gpu_process_used_bytes` equal to NVML's (`pynvml`) per-process used memory read at the same moment;
  `torchmem_gpu_total_bytes` equal to NVML's total; `torchmem_gpu_used_bytes` within 64 MiB of NVML's (v2) used;
  the `UUID` label NVML's UUID of the device and `device` its NVML index; `torchmem_process_info` the pid;
  `torchmem_step` the last step; `torchmem_phase` "gpu-hold" open; `torchmem_breakdown_bytes` the parameters;
- `nvidia-smi --query-compute-apps` (when present) is compared with the per-process metric (PASS within 1 MiB,
  else skipped with the reason: containers often hide the pids from it);
- the node_exporter textfile parses with the same parser and holds the same allocated value;
- after the stop and the run's exit 0: the textfile's final rewrite keeps no process series, and TensorBoard's
  own reader (`EventAccumulator`) finds `torchmem/cuda_allocated_bytes` whose highest second is the spike's
  `memory_allocated()` (held long enough for the 10 ms allocator sampler) and which holds the hold's value,
  `torchmem/cuda_reserved_bytes` peaking at `max_memory_reserved()`,
  `torchmem/step/peak_allocated_bytes` at steps 0..N-1 peaking at torch's peak, the `torchmem/gpu<N>/` scalars,
  and the `torchmem/breakdown/<boundary>/cuda_0/...` scalars with `parameters_bytes` = Σ numel·element_size of
  the model's parameters (and the gradients at the end of backward likewise). TensorBoard's scalars are
  32-bit floats, so they are compared with the float32 of the exact number.

The live checks are measured while the program holds (the module's fixture, each settled until it holds or its
time is up, all within 85 s); each is one test asserting on its measurement. The whole run ends within 120 s.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import pytest

MIB = 1 << 20
GIB = 1 << 30
STEPS = 3  # the Monitor measures the breakdown at every boundary of the first 3 steps
SPIKE_STEP = 1
HOLD_MIN_S = 2.5  # the shortest hold before the stop: longer than one TensorBoard second after the spike's
# The `torchmem` of this interpreter's environment, else the one on PATH (a wheel installed with --target).
TM = str(Path(sys.executable).parent / "torchmem")
if not Path(TM).exists():
    TM = shutil.which("torchmem") or TM
# Set when the module's run starts: every check while the program holds ends by HOLD_DEADLINE, the run's exit
# and the TensorBoard reading by END_DEADLINE.
T0 = time.monotonic()
HOLD_DEADLINE = T0 + 85
END_DEADLINE = T0 + 112


def info(name: str, detail: str) -> None:
    print(f"INFO {name}: {detail}", flush=True)


def wait_for(check, timeout_s: float):
    """check() until it gives something truthy, for at most timeout_s (never past HOLD_DEADLINE); None then."""
    until = min(time.monotonic() + timeout_s, HOLD_DEADLINE)
    while True:
        try:
            got = check()
        except Exception:
            got = None
        if got or time.monotonic() >= until:
            return got or None
        time.sleep(0.2)


def settle(measure, timeout_s: float) -> tuple[bool, str]:
    """measure() -> (ok, detail), again until ok, for at most timeout_s (never past HOLD_DEADLINE): the last."""
    if time.monotonic() >= HOLD_DEADLINE:
        return False, "not measured: out of time"
    until = min(time.monotonic() + timeout_s, HOLD_DEADLINE)
    tries = 0
    while True:
        tries += 1
        try:
            ok, detail = measure()
        except Exception as e:
            ok, detail = False, f"{type(e).__name__}: {e}"
        if ok or time.monotonic() >= until:
            return ok, detail + ("" if tries == 1 else f" ({tries} tries)")
        time.sleep(0.25)


PROGRAM = (
    textwrap.dedent(
        """
    import json, os, sys, time
    from pathlib import Path
    import torch
    import torchmem

    here = Path(sys.argv[1])
    dev = torch.device("cuda", 0)
    model = torch.nn.Linear(1024, 1024).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = torchmem.Monitor(model, opt, verbose=False)
    spike_allocated = None
    for i in range(STEPS):
        with mon.step():
            loss = model(torch.randn(256, 1024, device=dev)).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if i == SPIKE_STEP:
                spike = torch.ones(2 * GIB // 4, device=dev)
                torch.cuda.synchronize()
                spike_allocated = torch.cuda.memory_allocated()
                time.sleep(0.3)  # many allocator samples (every 10 ms) see it
                del spike
        time.sleep(0.1)
    params_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with torchmem.track("gpu-hold"):
        x = torch.ones(GIB // 4, device=dev)
        torch.cuda.synchronize()
        props = torch.cuda.get_device_properties(0)
        truth = {
            "pid": os.getpid(),
            "allocated": torch.cuda.memory_allocated(),
            "reserved": torch.cuda.memory_reserved(),
            "max_allocated": torch.cuda.max_memory_allocated(),
            "max_reserved": torch.cuda.max_memory_reserved(),
            "spike_allocated": spike_allocated,
            "params_bytes": params_bytes,
            "steps": STEPS,
            "uuid": str(getattr(props, "uuid", "") or ""),
            "name": props.name,
            "torch": torch.__version__,
        }
        (here / "torch.json.tmp").write_text(json.dumps(truth))
        os.replace(here / "torch.json.tmp", here / "torch.json")
        deadline = time.monotonic() + 110  # never outlives the check, even when the check dies
        while not (here / "stop").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    """
    )
    .replace("SPIKE_STEP", str(SPIKE_STEP))
    .replace("STEPS", str(STEPS))
    .replace("GIB", str(GIB))
)


def f32(v: float) -> float:
    """What a TensorBoard `simple_value` (a 32-bit float) holds for v."""
    return struct.unpack("<f", struct.pack("<f", float(v)))[0]


# --- the run ---------------------------------------------------------------------------------------------


class Run:
    """`torchmem run` in the background, in its own session (so it can be ended as a group); stderr collected."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [TM, "run", *args],
            cwd=cwd,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.stderr: list[str] = []
        self._reader = threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True)
        self._reader.start()

    def address(self, timeout_s: float) -> str | None:
        """HOST:PORT from the sink's "torchmem: Prometheus metrics at http://HOST:PORT/metrics" line."""

        def find():
            for line in list(self.stderr):
                m = re.search(r"Prometheus metrics at http://(\S+?)/metrics", line)
                if m:
                    return m.group(1)
            return None

        return wait_for(lambda: find() or (self.proc.poll() is not None and "exited"), timeout_s)

    def stop(self, timeout_s: float) -> int | None:
        """Waits for the exit; past timeout_s ends the group (TERM, then KILL). The exit code, None if killed."""
        try:
            return self.proc.wait(timeout=max(timeout_s, 1.0))
        except subprocess.TimeoutExpired:
            pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=5)
                break
            except subprocess.TimeoutExpired:
                continue
        return None

    def stderr_tail(self, n: int = 20) -> str:
        self._reader.join(timeout=2)
        return "".join(self.stderr[-n:])


# --- Prometheus --------------------------------------------------------------------------------------------


def scrape(addr: str) -> str:
    timeout = min(max(HOLD_DEADLINE - time.monotonic(), 0.5), 3.0)
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=timeout) as r:
        return r.read().decode()


def families(text: str) -> dict:
    """Metric families by name, through prometheus-client's own parser of the text format (0.0.4)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(fams: dict, name: str, **labels: str) -> list:
    """The samples of `name` whose labels include `labels`."""
    fam = fams.get(name)
    if fam is None:
        return []
    return [s for s in fam.samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]


def value(fams: dict, name: str, **labels: str) -> int | None:
    """The one sample of `name` with `labels`, as an int; None when there is none (or more than one)."""
    got = samples(fams, name, **labels)
    return int(got[0].value) if len(got) == 1 else None


# --- NVML, nvidia-smi, TensorBoard ----------------------------------------------------------------------------


def text_of(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def nvml_device(pynvml, torch_uuid: str):
    """(NVML index, handle, UUID) of the device torch calls cuda:0: by torch's UUID, else NVML's device 0."""
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        u = text_of(pynvml.nvmlDeviceGetUUID(h))
        if torch_uuid and u in (f"GPU-{torch_uuid}", f"MIG-{torch_uuid}", torch_uuid):
            return i, h, u
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    info("nvml_device", f"torch's UUID {torch_uuid!r} not found in NVML's devices; NVML device 0 taken")
    return 0, h, text_of(pynvml.nvmlDeviceGetUUID(h))


def nvml_memory(pynvml, h) -> tuple[int, int, int, str]:
    """(used, total, v1 used, which): NVML's v2 memory info (what nvidia-smi shows, and torchmem reads: used
    without the driver's reserved memory) when the driver has it, else v1's."""
    v1 = pynvml.nvmlDeviceGetMemoryInfo(h)
    try:
        v2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
        return int(v2.used), int(v2.total), int(v1.used), "NVML v2"
    except Exception:
        return int(v1.used), int(v1.total), int(v1.used), "NVML v1 (v2 unavailable)"


def nvml_process_bytes(pynvml, h, pid: int) -> int | None:
    """NVML's used memory of `pid` on the device (compute and graphics lists, the larger: as torchmem reads it)."""
    best = None
    for fn in (pynvml.nvmlDeviceGetComputeRunningProcesses, pynvml.nvmlDeviceGetGraphicsRunningProcesses):
        try:
            procs = fn(h)
        except Exception:
            continue
        for p in procs:
            used = getattr(p, "usedGpuMemory", None)
            if p.pid == pid and used is not None:
                best = max(best or 0, int(used))
    return best


def nvidia_smi_used_mib(pid: int) -> int | None | str:
    """nvidia-smi's used memory (MiB) of `pid`; None when it does not list the pid; a reason when it cannot run."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return "nvidia-smi not on PATH"
    try:
        out = subprocess.run(
            [exe, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=15,
        )
    except subprocess.TimeoutExpired:
        return "nvidia-smi timed out"
    if out.returncode != 0:
        return f"nvidia-smi exit {out.returncode}: {out.stderr.strip()[:200]}"
    for line in out.stdout.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) >= 2 and cells[0] == str(pid) and cells[1].isdigit():
            return int(cells[1])
    return None


def read_tensorboard(logdir: Path) -> dict[str, list]:
    """tag -> its scalar events, from every event directory under logdir, through TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, list] = {}
    for d in sorted({f.parent for f in logdir.rglob("events.out.tfevents.*")}):
        acc = EventAccumulator(str(d), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend(acc.Scalars(tag))
    return out


# --- the live checks, measured while the program holds -------------------------------------------------------------


class Live:
    """The live checks' measurements: name -> (ok, detail); INFO lines for what is not judged."""

    def __init__(self) -> None:
        self.got: dict[str, tuple[bool, str]] = {}
        self.info: dict[str, str] = {}

    def report(self, ok: bool, name: str, detail: str) -> None:
        print(f"{'ok' if ok else 'NOT OK'} {name}: {detail}", flush=True)
        self.got[name] = (ok, detail)

    def check(self, name: str, measure, timeout_s: float, note: str = "") -> bool:
        """measure() settled over timeout_s."""
        ok, detail = settle(measure, timeout_s)
        self.report(ok, name, detail + note)
        return ok


def check_scrape(live: Live, addr: str, truth: dict, pynvml, idx: int, h, uuid: str) -> None:
    pid = str(truth["pid"])
    last: dict = {}

    def cuda(name: str, want: int, what: str):
        def measure():
            f = last["f"] = families(scrape(addr))
            got = value(f, name, pid=pid)
            return got == want, f"{name}{{pid={pid}}} {got} vs {what} {want}"

        return measure

    # The sampler reads the allocator every 10 ms and the recorder commits every 50 ms: the reading after
    # the hold's allocation is in within a second or so.
    live.check(
        "allocated_equals_torch", cuda("torchmem_cuda_allocated_bytes", truth["allocated"], "memory_allocated()"), 20
    )
    live.check("reserved_equals_torch", cuda("torchmem_cuda_reserved_bytes", truth["reserved"], "memory_reserved()"), 5)
    live.check(
        "peak_allocated_equals_torch_max",
        cuda("torchmem_cuda_peak_allocated_bytes", truth["max_allocated"], "max_memory_allocated()"),
        5,
        f"; the hold's allocated {truth['allocated']}, step {SPIKE_STEP}'s spike {truth['spike_allocated']}",
    )
    live.check(
        "peak_reserved_equals_torch_max",
        cuda("torchmem_cuda_peak_reserved_bytes", truth["max_reserved"], "max_memory_reserved()"),
        5,
    )

    f = last.get("f") or families(scrape(addr))
    alloc = samples(f, "torchmem_cuda_allocated_bytes", pid=pid)
    labels = alloc[0].labels if alloc else {}
    live.report(labels.get("device") == str(idx), "cuda_device_label_is_nvml_index", f"{labels} vs NVML index {idx}")
    live.report(labels.get("UUID") == uuid, "cuda_uuid_label_equals_nvml", f"{labels.get('UUID')} vs NVML {uuid}")
    on_device = {
        name: [s.labels.get("UUID") for s in samples(f, name, device=str(idx))]
        for name in (
            "torchmem_cuda_reserved_bytes",
            "torchmem_cuda_peak_allocated_bytes",
            "torchmem_cuda_peak_reserved_bytes",
            "torchmem_gpu_process_used_bytes",
            "torchmem_gpu_used_bytes",
            "torchmem_gpu_total_bytes",
        )
    }
    live.report(
        all(u and set(u) == {uuid} for u in on_device.values()),
        "every_gpu_series_carries_device_and_uuid",
        f"UUID labels of the series with device={idx}: {on_device}",
    )

    def process_used():
        f = families(scrape(addr))
        got = value(f, "torchmem_gpu_process_used_bytes", pid=pid, device=str(idx))
        nvml = nvml_process_bytes(pynvml, h, truth["pid"])
        diff = "" if got is None or nvml is None else f" (metric - NVML = {got - nvml})"
        return got is not None and got == nvml, f"{got} vs NVML usedGpuMemory {nvml}{diff}"

    live.check("gpu_process_used_equals_nvml", process_used, 15)

    def device_memory():
        f = families(scrape(addr))
        used, total, v1_used, which = nvml_memory(pynvml, h)
        got_used = value(f, "torchmem_gpu_used_bytes", device=str(idx))
        last["total"] = (value(f, "torchmem_gpu_total_bytes", device=str(idx)), total, which)
        ok = got_used is not None and abs(got_used - used) <= 64 * MIB
        diff = "" if got_used is None else f", {(got_used - used) / MIB:+.1f} MiB"
        return ok, f"{got_used} vs {which} used {used}{diff} (v1 used {v1_used})"

    live.check("gpu_used_within_64_mib_of_nvml", device_memory, 10)
    got_total, total, which = last.get("total", (None, None, "NVML"))
    live.report(
        got_total is not None and got_total == total, "gpu_total_equals_nvml", f"{got_total} vs {which} {total}"
    )

    f = families(scrape(addr))
    infos = samples(f, "torchmem_process_info", pid=pid)
    live.report(
        len(infos) == 1 and infos[0].value == 1 and "prog.py" in infos[0].labels.get("command", ""),
        "process_info_has_the_pid",
        f"{[(s.labels, s.value) for s in infos]}",
    )
    step = value(f, "torchmem_step", pid=pid)
    live.report(step == STEPS - 1, "step_is_the_last_index", f"torchmem_step{{pid={pid}}} {step} vs {STEPS - 1}")
    phases = {s.labels.get("phase"): s.value for s in samples(f, "torchmem_phase", pid=pid)}
    live.report(
        phases.get("gpu-hold") == 1 and sum(phases.values()) == 1 and {"forward", "backward"} <= set(phases),
        "phase_gpu_hold_open",
        f"{phases}",
    )
    bd = value(f, "torchmem_breakdown_bytes", pid=pid, category="parameters", device="cuda:0")
    live.report(
        bd == truth["params_bytes"],
        "breakdown_parameters_metric",
        f"torchmem_breakdown_bytes{{category=parameters,device=cuda:0}} {bd} vs Σ numel·element_size "
        f"{truth['params_bytes']}",
    )

    got = value(f, "torchmem_gpu_process_used_bytes", pid=pid, device=str(idx))
    smi = nvidia_smi_used_mib(truth["pid"])
    if isinstance(smi, int) and got is not None and abs(smi * MIB - got) <= MIB:
        live.report(True, "nvidia_smi_process_used", f"{smi} MiB vs metric {got} ({got / MIB:.2f} MiB)")
    else:
        if smi is None:
            shown = "nvidia-smi does not list the pid (its pid namespace?)"
        else:
            shown = smi if isinstance(smi, str) else f"nvidia-smi {smi} MiB ({smi * MIB} bytes)"
        info("nvidia_smi_process_used", f"{shown}; the metric {got}")
        live.info["nvidia_smi_process_used"] = f"{shown}; the metric {got}"


def check_textfile(live: Live, path: Path, truth: dict) -> None:
    pid = str(truth["pid"])

    def measure():
        f = families(path.read_text())
        got = value(f, "torchmem_cuda_allocated_bytes", pid=pid)
        return got == truth["allocated"], f"{path.name}: {got} vs torch {truth['allocated']} ({len(f)} families)"

    live.check("textfile_allocated_equals_torch", measure, 12)  # rewritten every 2 s


def kill_program(pid: int, tmp: Path) -> None:
    """The program, when ending the run's group missed it: by its pid, once /proc says it is still ours."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return
    if "prog.py" in cmdline and str(tmp) in cmdline:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@pytest.fixture(scope="module")
def exported() -> dict:
    """The run, its live checks measured while the program holds, then its stop and exit: what every test of this
    module asserts on."""
    global T0, HOLD_DEADLINE, END_DEADLINE
    T0 = time.monotonic()
    HOLD_DEADLINE, END_DEADLINE = T0 + 85, T0 + 112
    if not Path(TM).exists():
        pytest.fail(f"torchmem_on_path: {TM} does not exist and no torchmem is on PATH (install the wheel)")
    import pynvml

    pynvml.nvmlInit()
    tmp = Path(tempfile.mkdtemp(prefix="torchmem-exporters-gpu-"))
    (tmp / "prog.py").write_text(PROGRAM)
    info("files", f"{tmp} (the program, its profile, the textfile, the event files)")
    textfile = tmp / "tm.prom"
    logdir = tmp / "tb"
    env = dict(os.environ, TORCHMEM_PYTHON=sys.executable)
    args = ["-o", str(tmp / "p.sqlite"), "--metrics", "127.0.0.1:0", "--metrics-textfile", str(textfile)]
    args += ["--tensorboard", str(logdir), "--", sys.executable, "prog.py", str(tmp)]
    run = Run(args, tmp, env)
    live = Live()
    out: dict = {"live": live, "textfile": textfile, "logdir": logdir, "truth": None, "nvml_process": None}
    out["nvml_index"] = 0
    out["not_started"] = None
    try:
        addr = run.address(30)
        ok = addr is not None and addr != "exited"
        out["address"] = (ok, f"{addr}" if ok else f"no address line; stderr:\n{run.stderr_tail()}")
        if not ok:
            out["not_started"] = "no metrics address"
            return out

        def started():
            if (tmp / "torch.json").exists():
                return json.loads((tmp / "torch.json").read_text())
            return run.proc.poll() is not None and {"exited": run.proc.poll()}

        truth = wait_for(started, 60)
        ok = truth is not None and "exited" not in truth
        out["started"] = (ok, f"{truth}" + ("" if ok else f"\n{run.stderr_tail()}"))
        if not ok:
            out["not_started"] = "the program did not start"
            return out
        out["truth"] = truth
        held_since = time.monotonic()
        if truth["max_allocated"] != truth["spike_allocated"]:
            info(
                "torch_peak",
                f"max_memory_allocated() {truth['max_allocated']} is not the spike's {truth['spike_allocated']}",
            )
        nvml_index, h, uuid = nvml_device(pynvml, truth["uuid"])
        out["nvml_index"] = nvml_index
        info("device", f"NVML index {nvml_index}, {uuid}, torch's {truth['name']!r} (torch {truth['torch']})")
        try:
            check_scrape(live, addr, truth, pynvml, nvml_index, h, uuid)
        except Exception as e:  # the checks not measured yet fail with this
            out["live_error"] = f"{type(e).__name__}: {e}"
        try:
            check_textfile(live, textfile, truth)
        except Exception as e:
            out["live_error"] = f"{type(e).__name__}: {e}"
        out["nvml_process"] = nvml_process_bytes(pynvml, h, truth["pid"])
        # TensorBoard gets each second's highest value: the hold's value is one only when the hold covers a
        # second after the spike's. The checks above may all settle at once (well under a second), so the hold
        # lasts HOLD_MIN_S at least (the spike ends ~0.5 s before it starts).
        time.sleep(max(0.0, min(held_since + HOLD_MIN_S, HOLD_DEADLINE) - time.monotonic()))
    finally:
        (tmp / "stop").touch()
        code = run.stop(END_DEADLINE - 15 - time.monotonic())
        if code is None and out["truth"] is not None:
            kill_program(out["truth"]["pid"], tmp)
        out["code"] = code
        out["stderr"] = "" if code == 0 else run.stderr_tail()
    return out


def started(exported: dict) -> dict:
    if exported["not_started"]:
        pytest.fail(f"not measured: {exported['not_started']}")
    return exported


# --- while the program holds ---------------------------------------------------------------------------------------


def test_metrics_address_printed(exported: dict) -> None:
    ok, detail = exported["address"]
    assert ok, detail


def test_program_started(exported: dict) -> None:
    if "started" not in exported:
        pytest.fail(f"not measured: {exported['not_started']}")
    ok, detail = exported["started"]
    assert ok, detail


LIVE = (
    "allocated_equals_torch",
    "reserved_equals_torch",
    "peak_allocated_equals_torch_max",
    "peak_reserved_equals_torch_max",
    "cuda_device_label_is_nvml_index",
    "cuda_uuid_label_equals_nvml",
    "every_gpu_series_carries_device_and_uuid",
    "gpu_process_used_equals_nvml",
    "gpu_used_within_64_mib_of_nvml",
    "gpu_total_equals_nvml",
    "process_info_has_the_pid",
    "step_is_the_last_index",
    "phase_gpu_hold_open",
    "breakdown_parameters_metric",
    "textfile_allocated_equals_torch",
)


@pytest.mark.parametrize("name", LIVE)
def test_live(exported: dict, name: str) -> None:
    live = started(exported)["live"]
    if name not in live.got:
        pytest.fail(f"{name}: not measured: {exported.get('live_error')}")
    ok, detail = live.got[name]
    assert ok, f"{name}: {detail}"


def test_nvidia_smi_process_used(exported: dict) -> None:
    """nvidia-smi's per-process used memory within 1 MiB of the metric; skipped with the reason when nvidia-smi is
    missing or does not list the pid (containers often hide the pids from it), as the script's INFO line."""
    live = started(exported)["live"]
    name = "nvidia_smi_process_used"
    if name in live.info:
        pytest.skip(live.info[name])
    if name not in live.got:
        pytest.fail(f"{name}: not measured: {exported.get('live_error')}")
    ok, detail = live.got[name]
    assert ok, detail


# --- after the stop ------------------------------------------------------------------------------------------------


def test_run_exit_code(exported: dict) -> None:
    code = exported["code"]
    assert code == 0, f"{code}; stderr:\n{exported['stderr']}"


def test_textfile_final_rewrite(exported: dict) -> None:
    try:
        f = families(exported["textfile"].read_text())
    except Exception as e:
        pytest.fail(f"textfile_final_rewrite: {type(e).__name__}: {e}")
    per_process = ("torchmem_cuda_", "torchmem_process_", "torchmem_tree_", "torchmem_breakdown_")
    per_process += ("torchmem_step", "torchmem_epoch", "torchmem_phase", "torchmem_gpu_process_used_bytes")
    process = sorted(n for n in f if n.startswith(per_process) and samples(f, n))
    kept = bool(samples(f, "torchmem_gpu_total_bytes"))
    assert not process and kept, f"process families left {process}; torchmem_gpu_total_bytes kept: {kept}"


@pytest.fixture(scope="module")
def tb(exported: dict) -> dict:
    """TensorBoard's scalars of the run, through its own reader."""
    started(exported)
    logdir = exported["logdir"]
    try:
        tags = read_tensorboard(logdir)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "tags": {}}
    files = sorted(str(p.relative_to(logdir)) for p in logdir.rglob("events.out.tfevents.*"))
    return {"tags": tags, "files": files}


def values(tb: dict, tag: str) -> list[float]:
    if "error" in tb:
        pytest.fail(f"tensorboard_reads: {tb['error']}")
    return [e.value for e in tb["tags"].get(tag, [])]


def test_tensorboard_reads(tb: dict) -> None:
    assert "error" not in tb, f"tensorboard_reads: {tb.get('error')}"
    assert bool(tb["tags"]), f"{len(tb['tags'])} scalar tags in {tb['files']}"


def test_tb_allocated_max_equals_the_spike(exported: dict, tb: dict) -> None:
    # The highest second is the spike: memory_allocated() while it was held (0.3 s, ~30 allocator samples),
    # which is also the program's lifetime peak.
    truth = exported["truth"]
    alloc = values(tb, "torchmem/cuda_allocated_bytes")
    peak, spike = truth["max_allocated"], truth["spike_allocated"]
    assert bool(alloc) and max(alloc) == f32(spike), (
        f"max of {len(alloc)} torchmem/cuda_allocated_bytes {max(alloc, default=None)} vs memory_allocated() "
        f"during step {SPIKE_STEP}'s spike {spike} (float32 {f32(spike)}; torch max_memory_allocated() {peak})"
    )


def test_tb_allocated_holds_the_hold(exported: dict, tb: dict) -> None:
    truth = exported["truth"]
    alloc = values(tb, "torchmem/cuda_allocated_bytes")
    assert f32(truth["allocated"]) in alloc, (
        f"the hold's allocated {truth['allocated']} (float32 {f32(truth['allocated'])}) among the last values "
        f"{alloc[-5:]}"
    )


def test_tb_reserved_max_equals_torch_peak(exported: dict, tb: dict) -> None:
    truth = exported["truth"]
    reserved = values(tb, "torchmem/cuda_reserved_bytes")
    assert bool(reserved) and max(reserved) == f32(truth["max_reserved"]), (
        f"max of {len(reserved)} torchmem/cuda_reserved_bytes {max(reserved, default=None)} vs torch "
        f"max_memory_reserved() {truth['max_reserved']} (float32 {f32(truth['max_reserved'])})"
    )


def test_tb_step_peak_allocated(exported: dict, tb: dict) -> None:
    values(tb, "")  # fails when TensorBoard could not be read
    peak = exported["truth"]["max_allocated"]
    steps = tb["tags"].get("torchmem/step/peak_allocated_bytes", [])
    assert [e.step for e in steps] == list(range(STEPS)) and max(e.value for e in steps) == f32(peak), (
        f"steps {[e.step for e in steps]} vs 0..{STEPS - 1}; values {[e.value for e in steps]}, highest vs torch "
        f"max_memory_allocated() {peak} (float32 {f32(peak)})"
    )


def test_tb_gpu_scalars(exported: dict, tb: dict) -> None:
    gpu = f"torchmem/gpu{exported['nvml_index']}/"
    used, proc = values(tb, gpu + "used_bytes"), values(tb, gpu + "process_used_bytes")
    assert bool(used) and bool(proc), (
        f"{gpu}used_bytes: {len(used)} events, {gpu}process_used_bytes: {len(proc)} events"
    )


def test_tb_gpu_process_used_max_equals_nvml(exported: dict, tb: dict) -> None:
    # The program's GPU memory only grows (its allocator never gives segments back), so the highest
    # second is what NVML said while it held, until its exit.
    nvml_process = exported["nvml_process"]
    if nvml_process is None:
        pytest.skip("NVML gave no per-process bytes for the program during the hold (not judged, as the script)")
    proc = values(tb, f"torchmem/gpu{exported['nvml_index']}/process_used_bytes")
    assert bool(proc) and max(proc) == f32(nvml_process), (
        f"max {max(proc, default=None)} vs NVML usedGpuMemory during the hold {nvml_process} "
        f"(float32 {f32(nvml_process)})"
    )


def _breakdown_cuda_tags(tb: dict) -> tuple[list[str], list[str]]:
    values(tb, "")  # fails when TensorBoard could not be read
    breakdown = sorted(t for t in tb["tags"] if t.startswith("torchmem/breakdown/"))
    return breakdown, [t for t in breakdown if "/cuda_0/" in t]


def test_tb_breakdown_tags(tb: dict) -> None:
    breakdown, cuda = _breakdown_cuda_tags(tb)
    assert bool(cuda), f"{len(breakdown)} tags, {len(cuda)} on cuda_0: {cuda[:12]}"


def test_tb_breakdown_parameters_equal_model(exported: dict, tb: dict) -> None:
    _, cuda = _breakdown_cuda_tags(tb)
    want = exported["truth"]["params_bytes"]
    params = {t: sorted({e.value for e in tb["tags"][t]}) for t in cuda if t.endswith("/parameters_bytes")}
    assert bool(params) and all(v == [f32(want)] for v in params.values()), f"{params} vs Σ numel·element_size {want}"


def test_tb_breakdown_gradients_at_end_of_backward(exported: dict, tb: dict) -> None:
    values(tb, "")  # fails when TensorBoard could not be read
    want = exported["truth"]["params_bytes"]
    grads = tb["tags"].get("torchmem/breakdown/end_of_backward/cuda_0/gradients_bytes", [])
    assert [e.step for e in grads] == list(range(STEPS)) and {e.value for e in grads} == {f32(want)}, (
        f"steps {[e.step for e in grads]}, values {sorted({e.value for e in grads})} vs {want}"
    )
