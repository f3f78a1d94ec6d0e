"""Records cuDNN RNN memory truth on a real GPU (issue 23 item 3; run it on the H200).

Two parts, written to `OUT/rnn-truth.json.gz`:

1. `grid`: for each RNN configuration (mode LSTM/GRU/RNN_TANH, input and hidden size, layers, directions,
   projections, batch, sequence length, dtype, packed or padded input) in one process, every allocation and
   free of the caching allocator (`_record_memory_history`, no stacks) during a training forward, its backward
   and an inference forward, in order, as (action, size) pairs, plus the bytes alive before and after each phase.
   The estimator's cuDNN RNN model (workspace and reserve space as cuDNN sizes them) is built from these.
2. `scripts`: each user-style script of `bench/estimate/corpus/` whose name matches `rnn`/`lstm`/`gru` run in a
   fresh process (3 repeats are not needed: the caching allocator is deterministic), with torch's peaks
   (`memory_stats()`) and NVML's used memory of the process at its end; the estimator is scored on these and
   never tuned on them (they are the held-out half of the RNN corpus).

Usage: `python scripts/gpu_rnn_truth.py OUT [--quick]`; `python scripts/gpu_rnn_truth.py --script PATH` (one
script in this process; prints JSON).
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import runpy
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "bench" / "estimate" / "corpus"
MARK_BYTES = 77_777 * 512


def grid(quick: bool) -> list[dict]:
    out = []

    def add(mode, inp, hid, layers, bidir, batch, seq, dtype="float32", packed=False, proj=0, batch_first=False,
            dropout=0.0, autocast=""):  # fmt: skip
        out.append(dict(mode=mode, input=inp, hidden=hid, layers=layers, bidirectional=bidir, batch=batch, seq=seq,
                        dtype=dtype, packed=packed, proj=proj, batch_first=batch_first, dropout=dropout,
                        autocast=autocast))  # fmt: skip

    modes = ["LSTM", "GRU", "RNN_TANH"]
    sizes = [(128, 256), (512, 1024)] if not quick else [(128, 256)]
    for mode, (inp, hid), layers, bidir, batch, seq, dtype, packed in itertools.product(
        modes, sizes, (1, 2), (False, True), (8, 64), (16, 128), ("float32", "float16"), (False, True)
    ):
        add(mode, inp, hid, layers, bidir, batch, seq, dtype, packed)
    if quick:
        return out
    for mode, bidir in itertools.product(modes, (False, True)):
        add(mode, 512, 1024, 3, bidir, 64, 128)
        add(mode, 512, 1024, 2, bidir, 32, 64, dtype="bfloat16")
        add(mode, 100, 300, 2, bidir, 13, 37)
        add(mode, 100, 300, 2, bidir, 13, 37, packed=True)
        for layers, dtype in itertools.product((1, 2), ("float32", "float16")):
            add(mode, 512, 1024, layers, bidir, 32, 64, dtype=dtype, batch_first=True)
    for mode in modes:
        add(mode, 512, 1024, 2, False, 32, 64, dropout=0.2)  # cuDNN's dropout state (made once per process)
        add(mode, 512, 1024, 2, True, 32, 64, autocast="float16")
        add(mode, 512, 1024, 2, True, 32, 64, autocast="float16", batch_first=True)
        add(mode, 512, 1024, 1, False, 32, 64, autocast="bfloat16", packed=True)
        add(mode, 1024, 2048, 2, False, 128, 256)
        add(mode, 1024, 2048, 2, True, 128, 256, dtype="float16")
    for layers, bidir, batch, seq in itertools.product((1, 2), (False, True), (8, 64), (16, 128)):
        add("LSTM", 256, 768, layers, bidir, batch, seq, proj=256)
    return out


def dense_grid() -> list[dict]:
    """A second grid (`--dense`, recorded apart): the sizes training scripts use between the first grid's
    points, and modules in eval mode (cuDNN's inference workspace, no reserve space)."""
    out = []
    for mode, (inp, hid), layers, bidir, batch, seq, dtype in itertools.product(
        ("LSTM", "GRU", "RNN_TANH"), ((256, 512), (512, 768), (512, 1024)), (1, 2), (False, True), (16, 128),
        (32, 256), ("float32", "float16")
    ):  # fmt: skip
        out.append(dict(mode=mode, input=inp, hidden=hid, layers=layers, bidirectional=bidir, batch=batch, seq=seq,
                        dtype=dtype, packed=False, proj=0, batch_first=False, dropout=0.0, autocast="",
                        eval=(batch == 16 and seq == 32)))  # fmt: skip
    return out


def exercise(cfg: dict, mark) -> list[int]:
    """One config's four phases on "cuda", with `mark(name)` between them; returns the parameters' byte sizes.
    The truth runs it under the allocator's history; `bench/estimate/rnn_compare.py` under the estimator."""
    import torch
    import torch.nn as nn
    from torch.nn.utils.rnn import pack_padded_sequence

    dtype = getattr(torch, cfg["dtype"])
    cls = {"LSTM": nn.LSTM, "GRU": nn.GRU, "RNN_TANH": nn.RNN}[cfg["mode"]]
    kw = {"proj_size": cfg["proj"]} if cfg["proj"] else {}
    bf = cfg["batch_first"]
    shape = (cfg["batch"], cfg["seq"], cfg["input"]) if bf else (cfg["seq"], cfg["batch"], cfg["input"])
    lengths = None
    if cfg["packed"]:
        from torch._subclasses.fake_tensor import unset_fake_temporarily  # (a no-op outside an estimate)

        with unset_fake_temporarily():  # the lengths are the program's own values, on the CPU
            lengths = [int(v) for v in torch.linspace(cfg["seq"], max(1, cfg["seq"] // 4), cfg["batch"]).long()]
    amp = {"dtype": getattr(torch, cfg["autocast"] or "float16"), "enabled": bool(cfg["autocast"])}
    mark("start")
    rnn = cls(cfg["input"], cfg["hidden"], cfg["layers"], bidirectional=cfg["bidirectional"], batch_first=bf,
              dropout=cfg["dropout"], **kw).to(dtype)  # fmt: skip
    rnn = rnn.to("cuda")
    if cfg.get("eval"):
        rnn.eval()
    mark("to_cuda")
    x = torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=True)
    mark("input")
    inp = pack_padded_sequence(x, lengths, batch_first=bf) if lengths is not None else x
    mark("packed")
    with torch.autocast("cuda", **amp):
        out, _h = rnn(inp)
    mark("forward")
    y = out.data if lengths is not None else out
    if not cfg.get("eval"):  # (cuDNN has no backward in eval mode)
        y.float().sum().backward()
    mark("backward")
    del out, _h, y, inp
    mark("freed")
    with torch.no_grad():
        inp = pack_padded_sequence(x.detach(), lengths, batch_first=bf) if lengths is not None else x.detach()
        mark("eval_start")
        with torch.autocast("cuda", **amp):
            out, _h = rnn(inp)
        mark("eval_forward")
        del out, _h, inp
    mark("eval_freed")
    return [p.numel() * p.element_size() for p in rnn.parameters()]


def record_grid(configs: list[dict]) -> list[dict]:
    """Per config: the allocator's (action, size) events of its phases (`exercise`), split by marker requests,
    with the bytes allocated at each mark."""
    import torch

    mem = torch.cuda.memory
    results = []
    for cfg in configs:
        r = {"config": cfg}
        try:
            torch.cuda.synchronize()
            mem._record_memory_history(enabled="all", context=None, stacks="python", max_entries=1_000_000,
                                       clear_history=True)  # fmt: skip
            marks = []

            def mark(name, marks=marks):
                # a marker request of a size no RNN asks for (MARK_BYTES + 512 * its number) splits the events
                torch.cuda.synchronize()
                marks.append((name, torch.cuda.memory_allocated()))
                torch.empty(MARK_BYTES + 512 * len(marks), dtype=torch.uint8, device="cuda")

            r["param_bytes"] = exercise(cfg, mark)
            snap = mem._snapshot()
            mem._record_memory_history(enabled=None)
            trace = snap["device_traces"][0] if snap["device_traces"] else []
            r["events"] = [[e["action"], e["size"]] for e in trace if e["action"] in ("alloc", "free_requested")]
            r["marks"] = marks
        except Exception as e:  # noqa: BLE001 - recorded, the grid goes on
            r["error"] = f"{type(e).__name__}: {e}"
            try:
                mem._record_memory_history(enabled=None)
            except Exception:  # noqa: BLE001
                pass
        results.append(r)
        torch.cuda.empty_cache()
    return results


def one_script(path: str, snapshot: str | None = None) -> dict:
    import torch

    t0 = time.time()
    if snapshot:
        torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    runpy.run_path(path, run_name="__main__")
    if snapshot:
        torch.cuda.memory._dump_snapshot(snapshot)
    torch.cuda.synchronize()
    s = torch.cuda.memory_stats()
    r = {k: s.get(k, 0) for k in ("allocated_bytes.all.peak", "reserved_bytes.all.peak", "requested_bytes.all.peak",
                                  "active_bytes.all.peak", "num_alloc_retries")}  # fmt: skip
    r["seconds"] = round(time.time() - t0, 2)
    try:
        import os

        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
            if p.pid == os.getpid():
                r["nvml_process_bytes"] = p.usedGpuMemory
    except Exception as e:  # noqa: BLE001
        r["nvml_error"] = str(e)
    return r


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?")
    ap.add_argument("--script")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--snapshot", help="with --script: keep the allocator history, dump it to this pickle")
    ap.add_argument("--dense", action="store_true", help="record dense_grid() into rnn-truth-dense.json.gz only")
    a = ap.parse_args()
    if a.script:
        r = one_script(a.script, a.snapshot)
        print("TRUTH " + json.dumps(r))
        return 0
    import torch

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    if a.dense:
        doc = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
               "device": torch.cuda.get_device_name(0), "grid": record_grid(dense_grid())}  # fmt: skip
        with gzip.open(out / "rnn-truth-dense.json.gz", "wt") as f:
            json.dump(doc, f)
        print(f"dense grid: {len(doc['grid'])} configs in {time.time() - t0:.0f}s", flush=True)
        return 0
    doc = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
           "device": torch.cuda.get_device_name(0), "grid": record_grid(grid(a.quick))}  # fmt: skip
    print(f"grid: {len(doc['grid'])} configs in {time.time() - t0:.0f}s", flush=True)
    scripts = {}
    for p in sorted(CORPUS.glob("*.py")):
        if not any(k in p.name for k in ("rnn", "lstm", "gru")):
            continue
        proc = subprocess.run([sys.executable, __file__, "--script", str(p)], capture_output=True, text=True,
                              timeout=600)  # fmt: skip
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("TRUTH ")]
        scripts[p.name] = json.loads(line[-1][6:]) if line else {"error": proc.stderr[-3000:]}
        print(p.name, "ok" if line else "FAILED", flush=True)
    doc["scripts"] = scripts
    with gzip.open(out / "rnn-truth.json.gz", "wt") as f:
        json.dump(doc, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
