"""Records the H200 truth of the user-style corpus `bench/estimate/corpus/` (issue 23, "Accuracy"). No torchmem
needed: plain torch (+ pynvml when installed) on the GPU machine.

Two parts, written to `OUT/corpus-truth.json.gz` (and `OUT/corpus-truth.log`):

1. `scripts`: every `*.py` of the corpus run unchanged in a FRESH process each (`--jobs` at a time: torch's
   statistics are per process and NVML is read per pid, so parallel runs do not disturb each other's figures;
   the caching allocator is deterministic, so one run each; a script that runs out of memory among the others is
   run again alone at the end): torch's `memory_stats()` peaks at the end
   (`allocated_bytes.all.peak`, `reserved_bytes.all.peak`, requested/active peaks, `num_alloc_retries`,
   `num_ooms`), NVML's `usedGpuMemory` of the process (its largest value, sampled every 5 ms by a thread, and
   its value at the end), the exit status (`ok`, `oom`, `error` with the traceback's tail), wall seconds.
2. `fit`: for the scripts of `FIT`, the largest `--batch-size` (a multiple of its step) that runs to its end
   without an out-of-memory error, each try a fresh process run ALONE on the GPU (after part 1): from the
   starting guess, steps of x1.15 outward until the answer is bracketed, then bisection on multiples of the
   step (5-7 tries of 10-25 s each per script). A try that ends with `torch.OutOfMemoryError` (or CUDA's "out of
   memory") does not fit; any other failure stops that script's search (recorded). `--fit-budget` bounds the
   wall time of the whole part: a search cut short keeps its bracket (`fits` = largest known to fit, `fails` =
   smallest known not to).
   PYTORCH_CUDA_ALLOC_CONF is left as it is (unset) and no memory fraction is set: the whole card's memory.

Usage (from the repository root on the GPU machine):
    python scripts/gpu_corpus_truth.py OUT [--jobs 4] [--only a.py,b.py] [--no-fit] [--fit-only] [--fit-budget S]
        (a second call with the same OUT adds to the first one's file: `--no-fit`, then `--fit-only`)
    python scripts/gpu_corpus_truth.py --child SCRIPT [ARGS...]      (one script in this process; prints JSON)
        (with CORPUS_SNAPSHOT=FILE.pickle in the environment the child also keeps the allocator's history and
        dumps it there at the end: `torch.cuda.memory._dump_snapshot`, for request-by-request comparisons)
    python scripts/gpu_corpus_truth.py OUT --plumbing                 (no GPU: checks the parallel runs, the
        child protocol and the bisection on stub scripts; writes OUT/corpus-truth-plumbing.json.gz)
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import runpy
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "bench" / "estimate" / "corpus"

# script: (starting guess, step). The guesses come from `torchmem estimate --fit` on this corpus (they only set
# where the search starts; the answer is the GPU's).
FIT = {
    "nanogpt_train.py": (108, 4),
    "diffusion_unet_ddpm.py": (864, 16),
    "transformer_encoder_classifier.py": (384, 8),
    "hf_bert_text_classification.py": (1792, 32),
    "tv_reference_resnet50.py": (2560, 32),
}
CHILD_TIMEOUT_S = 300
H200_CUDA_TOTAL_BYTES = 150_109_880_320


def _is_oom(message: str) -> bool:
    """Out of device memory, as the caching allocator or a CUDA library says it (cuBLAS cannot create its handle
    when the allocator has taken all but a sliver of the GPU: `CUBLAS_STATUS_ALLOC_FAILED`)."""
    return "out of memory" in message.lower() or "CUBLAS_STATUS_ALLOC_FAILED" in message


class NvmlSampler(threading.Thread):
    """This process's NVML `usedGpuMemory`, sampled every `period` seconds; keeps the largest value."""

    def __init__(self, period: float = 0.005):
        super().__init__(daemon=True)
        self.period, self.peak, self.last, self.samples, self.error = period, 0, 0, 0, None
        self._halt = threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            idx = int((os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0])
            self._h, self._nv, self._pid = pynvml.nvmlDeviceGetHandleByIndex(idx), pynvml, os.getpid()
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on without NVML
            self.error, self._nv = f"{type(e).__name__}: {e}", None

    def read(self) -> int | None:
        for p in self._nv.nvmlDeviceGetComputeRunningProcesses(self._h):
            if p.pid == self._pid and p.usedGpuMemory is not None:
                return int(p.usedGpuMemory)
        return None

    def run(self):
        while self._nv is not None and not self._halt.is_set():
            try:
                v = self.read()
            except Exception as e:  # noqa: BLE001
                self.error = f"{type(e).__name__}: {e}"
                return
            if v is not None:
                self.peak, self.last, self.samples = max(self.peak, v), v, self.samples + 1
            time.sleep(self.period)

    def stop(self):
        self._halt.set()
        if self.is_alive():
            self.join(1.0)
        if self._nv is not None:
            try:
                v = self.read()
                if v is not None:
                    self.peak, self.last = max(self.peak, v), v
            except Exception:  # noqa: BLE001
                pass


def child(script: str, argv: list[str], plumbing: bool) -> dict:
    """Runs one script in this process as `python SCRIPT ARGS` would, then reads the peaks."""
    sampler = None if plumbing else NvmlSampler()
    if sampler is not None:
        sampler.start()
    sys.argv = [script, *argv]
    sys.path[0] = str(Path(script).resolve().parent)
    snapshot = None if plumbing else os.environ.get("CORPUS_SNAPSHOT")
    if snapshot:
        import torch

        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    t0 = time.time()
    r: dict = {"argv": argv, "status": "ok"}
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            r["status"], r["error"] = "error", f"SystemExit({e.code})"
    except BaseException as e:  # noqa: BLE001 - an OOM is an answer, anything else is recorded
        import traceback

        oom = type(e).__name__ == "OutOfMemoryError" or _is_oom(str(e))
        r["status"] = "oom" if oom else "error"
        r["error"] = "".join(traceback.format_exception(e))[-3000:]
    r["seconds"] = round(time.time() - t0, 2)
    if plumbing:
        return r
    import torch

    try:
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - after an OOM the device is still readable; recorded otherwise
        r["sync_error"] = str(e)[:300]
    if snapshot:
        torch.cuda.memory._dump_snapshot(snapshot)
    s = torch.cuda.memory_stats()
    for k in ("allocated_bytes.all.peak", "reserved_bytes.all.peak", "requested_bytes.all.peak",
              "active_bytes.all.peak", "num_alloc_retries", "num_ooms", "num_device_alloc"):  # fmt: skip
        r[k] = s.get(k, 0)
    sampler.stop()
    r["nvml_process_bytes"] = sampler.peak or None
    r["nvml_process_bytes_end"] = sampler.last or None
    r["nvml_samples"] = sampler.samples
    if sampler.error:
        r["nvml_error"] = sampler.error
    return r


def run_child(script: Path, argv: list[str], plumbing: bool, timeout: int = CHILD_TIMEOUT_S) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(script), *argv]
    if plumbing:
        cmd.insert(2, "--plumbing")
    t0 = time.time()
    try:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "disabled"}
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=str(script.parent), env=env)
    except subprocess.TimeoutExpired:
        return {"argv": argv, "status": "timeout", "wall_seconds": round(time.time() - t0, 1)}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("TRUTH ")]
    if lines:
        r = json.loads(lines[-1][6:])
    else:  # the child died without a word (a crash, a kill): its stderr says why
        err = p.stderr[-3000:]
        r = {"argv": argv, "status": "oom" if _is_oom(err) else "error", "error": err}
    r["exit_status"] = p.returncode
    r["wall_seconds"] = round(time.time() - t0, 1)
    return r


def fit_search(script: Path, guess: int, step: int, deadline: float, plumbing: bool, log) -> dict:
    """Largest multiple of `step` for --batch-size that runs without OOM, each try a fresh process."""
    tries: list[dict] = []
    fits, fails = 0, None  # largest known to fit, smallest known not to

    def attempt(b: int) -> bool | None:
        r = run_child(script, ["--batch-size", str(b)], plumbing)
        t = {"batch": b, "status": r["status"], "seconds": r.get("wall_seconds"),
             "reserved_peak": r.get("reserved_bytes.all.peak"), "nvml": r.get("nvml_process_bytes")}  # fmt: skip
        if r["status"] not in ("ok", "oom"):
            t["error"] = (r.get("error") or "")[-800:]
        tries.append(t)
        log(f"  fit {script.name} batch {b}: {r['status']} ({r.get('wall_seconds')} s)")
        return {"ok": True, "oom": False}.get(r["status"])

    def up(b: int) -> int:
        return max(b + step, int(b * 1.15) // step * step)

    def down(b: int) -> int:
        return max(step, int(b / 1.15) // step * step)

    b = max(step, guess // step * step)
    stopped = None
    while fails is None or fails - fits > step:
        if time.time() > deadline:
            stopped = "fit budget spent"
            break
        ok = attempt(b)
        if ok is None:
            stopped = "a try failed without an out-of-memory error"
            break
        if ok:
            fits = b
        else:
            fails = b
        if fails is None:
            if b >= 1 << 16:
                stopped = "fits at 65536: not searched further"
                break
            b = up(b)
        elif fits == 0:
            if b == step:
                break  # even the smallest does not fit
            b = down(b)
        else:
            b = fits + ((fails - fits) // step // 2) * step
            if b <= fits:
                break
    return {"step": step, "guess": guess, "fits": fits, "fails": fails, "exact": stopped is None and fails is not None,
            "stopped": stopped, "tries": tries}  # fmt: skip


def versions(plumbing: bool) -> dict:
    v = {"python": platform.python_version(), "host": platform.node()}
    for mod in ("torch", "transformers", "torchvision", "timm", "peft", "lightning", "accelerate", "pynvml"):
        try:
            v[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            v[mod] = None
    if not plumbing:
        import torch

        v.update(device=torch.cuda.get_device_name(0), cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
                 total_memory=torch.cuda.get_device_properties(0).total_memory,
                 alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))  # fmt: skip
        try:
            import pynvml

            pynvml.nvmlInit()
            v["driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception:  # noqa: BLE001
            pass
    return v


def plumbing_corpus(tmp: Path) -> tuple[list[Path], dict]:
    """Stub scripts (no GPU): one fine, one failing, one whose batch > 37 'runs out of memory'."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "stub_ok.py").write_text(
        "import argparse\np = argparse.ArgumentParser()\n"
        "p.add_argument('--batch-size', type=int, default=4)\nprint(p.parse_args())\n"
    )
    (tmp / "stub_error.py").write_text("raise ValueError('a bug in the script')\n")
    (tmp / "stub_oom.py").write_text(
        "import argparse\nimport torch\np = argparse.ArgumentParser()\n"
        "p.add_argument('--batch-size', type=int, default=8)\na = p.parse_args()\n"
        "if a.batch_size > 37:\n    raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')\n"
    )
    return sorted(tmp.glob("stub_*.py")), {"stub_oom.py": (34, 1), "stub_ok.py": (4096, 512)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?")
    ap.add_argument("--child", nargs=argparse.REMAINDER, help="SCRIPT [ARGS...]: run one script here")
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--only", help="comma-separated script names")
    ap.add_argument("--no-fit", action="store_true")
    ap.add_argument("--fit-only", action="store_true")
    ap.add_argument("--fit-budget", type=float, default=300.0, help="seconds for the whole fit part")
    ap.add_argument("--plumbing", action="store_true", help="no GPU: stub scripts, no CUDA reads")
    a = ap.parse_args()
    if a.child:
        r = child(a.child[0], a.child[1:], a.plumbing)
        print("TRUTH " + json.dumps(r), flush=True)
        return 0
    if not a.out:
        ap.error("OUT is required")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    logf = open(out / "corpus-truth.log", "a")

    def log(msg: str):
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        logf.write(line + "\n")
        logf.flush()

    if a.plumbing:
        scripts, fit = plumbing_corpus(out / "plumbing-stubs")
    else:
        scripts, fit = sorted(CORPUS.glob("*.py")), dict(FIT)
    if a.only:
        names = set(a.only.split(","))
        scripts = [p for p in scripts if p.name in names]
        fit = {k: v for k, v in fit.items() if k in names}
    name = "corpus-truth-plumbing.json.gz" if a.plumbing else "corpus-truth.json.gz"
    doc = {"versions": versions(a.plumbing), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "jobs": a.jobs, "scripts": {}, "fit": {}}  # fmt: skip
    if (out / name).exists():  # a second call (--fit-only after --no-fit) adds to the first one's file
        old = json.load(gzip.open(out / name))
        doc["scripts"], doc["fit"] = old.get("scripts", {}), old.get("fit", {})
    t0 = time.time()

    def save():
        doc["wall_seconds"] = round(time.time() - t0, 1)
        with gzip.open(out / name, "wt") as f:
            json.dump(doc, f, indent=1)

    if not a.fit_only:

        def one(p: Path):
            r = run_child(p, [], a.plumbing)
            log(f"{p.name}: {r['status']} {r.get('wall_seconds')} s alloc {r.get('allocated_bytes.all.peak')} "
                f"reserved {r.get('reserved_bytes.all.peak')} nvml {r.get('nvml_process_bytes')}")  # fmt: skip
            return p.name, r

        with ThreadPoolExecutor(a.jobs) as pool:
            for n, r in pool.map(one, scripts):
                doc["scripts"][n] = r
        for p in scripts:  # an OOM next to other runs may be theirs: again, alone on the GPU
            if doc["scripts"][p.name]["status"] == "oom" and a.jobs > 1:
                n, r = one(p)
                r["rerun_alone"] = True
                doc["scripts"][n] = r
        log(f"scripts: {len(scripts)} in {time.time() - t0:.0f} s")
        save()
    if not a.no_fit:
        t1 = time.time()
        deadline = t1 + a.fit_budget
        # The guesses are the H200's; on a smaller GPU the search starts at the same share of its memory.
        scale = min(1.0, (doc["versions"].get("total_memory") or H200_CUDA_TOTAL_BYTES) / H200_CUDA_TOTAL_BYTES)
        for n, (guess, step) in fit.items():
            p = next((s for s in scripts if s.name == n), None)
            if p is None:
                continue
            guess = max(step, int(guess * scale) // step * step)
            doc["fit"][n] = fit_search(p, guess, step, deadline, a.plumbing, log)
            f = doc["fit"][n]
            log(f"fit {n}: fits {f['fits']} fails {f['fails']} exact {f['exact']} ({f['stopped'] or 'done'})")
            save()
        log(f"fit: {time.time() - t1:.0f} s")
    save()
    log(f"wrote {out / name} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
