"""Runs an unchanged training program under the estimator: `torchmem estimate -- COMMAND` puts a
`sitecustomize.py` first on PYTHONPATH that calls `start_from_env()` before the program's own code. The program
then runs on the emulated GPU until it has made N optimizer steps or M top-level forward / `generate` calls
(`--forward-calls`, unset: no bound), or ends, or fails, and we write the trace (an allocator snapshot) and a
summary JSON for the CLI, which simulates the allocator and reports. A program that ends without an optimizer
step (inference, evaluation, generation) is estimated to its end: `kind` says which it was.

Configuration comes in `TORCHMEM_ESTIMATE` (JSON: `trace`, `summary`, `steps`, `forward_calls`, `gpu`,
`frames_min_bytes`).
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
import traceback
from typing import Any

from . import _snapshot
from ._device import EstimateUnsupported, GpuSpec
from ._distributed import world_from_env
from ._tracer import round512

_TOP = 12


def largest_at_peak(tracer, top: int = _TOP) -> tuple[int, int, list[dict]]:
    """(peak live bytes, event index of the peak, the largest live requests at that moment with their frames)."""
    live: dict[int, Any] = {}
    live_bytes = peak = 0
    at = -1
    best: dict[int, Any] = {}
    for i, e in enumerate(tracer.events):
        if e.action == "alloc":
            live[e.addr] = e
            live_bytes += round512(e.size_bytes)
            if live_bytes > peak:
                peak, at = live_bytes, i
                best = {}
        else:
            ev = live.pop(e.addr, None)
            if ev is not None:
                live_bytes -= round512(ev.size_bytes)
        if at == i:
            best = dict(live)
    items = sorted(best.values(), key=lambda ev: -ev.size_bytes)[:top]
    out = []
    for ev in items:
        site = ""
        for f in ev.frames or []:
            fn = f["filename"]
            if "site-packages/torch/" not in fn:
                site = f"{fn}:{f['line']} ({f['name']})"
                break
        if not site and ev.phase == "backward":
            # only torch's frames (the engine running a custom Function's backward, e.g. the emulated CTC loss's)
            site = "(autograd engine, backward of the forward op)"
        if not site and ev.frames:
            f = ev.frames[0]
            site = f"{f['filename']}:{f['line']} ({f['name']})"
        out.append({"size_bytes": ev.size_bytes, "phase": ev.phase, "what": ev.what, "site": site, "step": ev.step})
    return peak, at, out


def summary(session, *, reason: str, seconds: float, error: str | None = None) -> dict:
    from ._tracer import phase_of

    tr = session.tracer
    peak, _at, top = largest_at_peak(tr)
    phases = {k: v for k, v in phase_of(tr.events).items() if k in ("forward", "backward", "optimizer")}
    import torch

    if tr.step > 0:
        kind = "training"
    elif session.backward_calls > 0:
        kind = "backward without optimizer step"
    else:
        kind = "inference"
    return {
        "kind": kind,
        "steps_traced": tr.step,
        "forward_calls": session.forwards.forward_calls,
        "generate_calls": session.forwards.generate_calls,
        "backward_calls": session.backward_calls,
        "reason": reason,
        "error": error,
        "notes": list(tr.notes.messages) + session.rules.conv_notes(),
        "trace_peak_bytes": peak,
        "phase_peak_bytes": phases,
        "largest_at_peak": top,
        "uses_half_precision": session.uses_half_precision,
        "uses_convolution": session.rules.used_conv,
        "convolution_workspaces": session.rules.conv_summary(),
        # What the trace does not know exactly, for the upper bound (docs/estimator.md, intervals).
        "uncertainty": tr.uncertainty(),
        "uncertain_requests": tr.uncertain_requests,
        "requests": sum(1 for e in tr.events if e.action == "alloc"),
        "trace_seconds": round(seconds, 3),
        "torch_version": torch.__version__,
        "gpu": session.gpu.name,
        "distributed": distributed_summary(session),
    }


def distributed_summary(session) -> dict:
    """The emulated world of the trace (`_distributed`): world size, traced rank, communicators, the NCCL model,
    and the rank classes the traced rank stands for."""
    emu = session.distributed
    if emu is not None:
        d = emu.summary()
    else:
        from ._distributed import World, nccl_model

        w = session.world or World()
        d = {**w.as_dict(), "process_group": None, "communicators": [], "ddp_modules": 0}
        d["nccl"] = nccl_model([], world_size=w.world_size)
    # The emulation's classes (uneven shards, pipeline stages; `_distributed.Emulation.rank_classes`), else one:
    # symmetric parallelisms (FSDP2, DDP, TP over whole meshes, even shards) make the same requests on every rank.
    d.setdefault("rank_classes", [{"ranks": list(range(d["world_size"])), "traced_rank": d["rank"], "symmetric": True}])
    return d


class _ScriptRun:
    def __init__(self, cfg: dict) -> None:
        from ._session import Session

        g = cfg["gpu"]
        self.cfg = cfg
        self.t0 = time.perf_counter()
        spec = GpuSpec(g["name"], int(g["cuda_total_bytes"]), int(g["major"]), int(g["minor"]), int(g["sms"]))
        forward_calls = cfg.get("forward_calls")
        d = cfg.get("distributed") or {}
        # The world the CLI asked for (--nnodes x --nproc-per-node, --rank), else WORLD_SIZE/RANK, else 1 rank.
        world = world_from_env(
            int(d["world_size"]) if d.get("world_size") else None,
            int(d["rank"]) if d.get("rank") is not None else None,
            int(d["nproc_per_node"]) if d.get("nproc_per_node") else None,
        )
        self.session = Session(
            spec,
            steps_limit=int(cfg.get("steps", 3)),
            forward_calls_limit=int(forward_calls) if forward_calls else None,
            frames_min_bytes=cfg.get("frames_min_bytes", 1 << 20),
            world=world,
        )
        self.session.on_limit = self.limit_reached
        self.session._shim.alloc_conf = cfg.get("alloc_conf", "")
        self.done = False
        self.pid = os.getpid()

    def finish(self, reason: str, error: str | None = None) -> None:
        # A forked child (DataLoader worker) inherits the hooks: only the traced process writes the files.
        if self.done or os.getpid() != self.pid:
            return
        self.done = True
        s = self.session
        s.tracer.close()
        snap = _snapshot.build(s.tracer, alloc_conf=self.cfg.get("alloc_conf", ""))
        _snapshot.write(snap, self.cfg["trace"])
        data = summary(s, reason=reason, seconds=time.perf_counter() - self.t0, error=error)
        with open(self.cfg["summary"], "w") as f:
            json.dump(data, f)

    def limit_reached(self) -> None:
        s = self.session
        steps_done = s.steps_limit is not None and s.tracer.step >= s.steps_limit
        self.finish("steps" if steps_done else "forward calls")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    def at_exit(self) -> None:
        self.finish("program ended")

    def excepthook(self, etype, value, tb) -> None:
        from ._session import translate_error

        translated = translate_error(value) if isinstance(value, Exception) else None
        err = translated or value
        later = ""
        if not isinstance(err, EstimateUnsupported):
            # What the estimate cannot follow, raised first and replaced while the program handled it (Lightning's
            # teardown moves the model to the CPU after an error inside `fit`, and that fails too): the first
            # one is the answer, the later one is said after it.
            root = _first_unsupported(value, translate_error)
            if root is not None:
                later = f" (then, while the program handled it: {type(value).__name__}: {value})"
                err, tb = root
        if isinstance(err, EstimateUnsupported):
            message = str(err) + later
        else:
            message = f"{type(err).__name__}: {err}"
        where = ""
        for frame in reversed(traceback.extract_tb(tb)):
            if "site-packages" not in frame.filename and "torchmem/estimator/" not in frame.filename:
                where = f" (at {frame.filename}:{frame.lineno})"
                break
        self.finish("error", error=message + where)
        if not isinstance(err, EstimateUnsupported):
            sys.__excepthook__(etype, value, tb)
        sys.stderr.flush()


def _first_unsupported(value: BaseException, translate) -> tuple[EstimateUnsupported, Any] | None:
    """The earliest exception in `value`'s chain (`__cause__`, `__context__`) that is a call the estimate cannot
    follow, as its message and traceback; None if there is none."""
    chain: list[BaseException] = []
    e: BaseException | None = value.__cause__ or value.__context__
    while e is not None and all(e is not c for c in chain) and len(chain) < 64:
        chain.append(e)
        e = e.__cause__ or e.__context__
    for e in reversed(chain):
        found = e if isinstance(e, EstimateUnsupported) else translate(e) if isinstance(e, Exception) else None
        if found is not None:
            return found, e.__traceback__
    return None


def start_from_env() -> None:
    raw = os.environ.pop("TORCHMEM_ESTIMATE", None)
    if not raw:
        return
    cfg = json.loads(raw)
    run = _ScriptRun(cfg)
    try:
        run.session.__enter__()
    except EstimateUnsupported as e:
        run.done = True
        with open(cfg["summary"], "w") as f:
            json.dump({"reason": "error", "error": str(e), "steps_traced": 0}, f)
        raise SystemExit(3) from None
    atexit.register(run.at_exit)
    sys.excepthook = run.excepthook
