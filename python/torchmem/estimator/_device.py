"""An emulated CUDA device for `torchmem estimate`: lets a training step run on fake `cuda` tensors, backward
included, in a process that has no GPU (the default PyPI torch wheel is a CUDA build; without a driver every
backward over fake CUDA tensors failed with "hasPrimaryContext expects a valid device index").

Why backward failed, and the fix (measured on torch 2.15, CUDA build, no driver):

* `FakeTensorMode.__enter__` installs a no-op CUDA device guard (`_ensureCUDADeviceGuardSet`) whose
  `deviceCount()` is 1, so the autograd engine's `GraphTask::stash_current_streams` asks the CUDA hooks
  `hasPrimaryContext(0)`; `CUDAHooks::hasPrimaryContext` checks the index against the real device count (0) and
  throws. It is a virtual call on the one `at::CUDAHooksInterface` object (`at::detail::getCUDAHooks()`).
* We give that object a copy of its vtable whose `hasPrimaryContext` slot answers "no context" (false), so the
  engine stashes no caller stream (a `nullopt`, exactly what it does for a device with no context) and goes on.
  Everything else in the vtable is the original. The slot is found by probing (a tiny fake backward per
  candidate slot, the first that the engine calls with a device index wins), then cached for the process.
* Tried and rejected (see docs/estimator.md): `c10::cuda::_internal::setHasPrimaryContext` (only the Python
  binding uses that pointer; the engine calls the hooks), a Python PrivateUse1 backend (the engine then treats
  CUDA nodes as stream-less and trips `opt_ready_stream && opt_parent_stream`).

The module also answers the `torch.cuda` queries a training script makes (is_available, device properties of
the target GPU, memory counters from the trace) and names the calls that need a real device.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

_VTABLE_SLOTS = 160  # copied; CUDAHooksInterface has fewer virtual functions than this

_lock = threading.Lock()
_installed = False
_keep_alive: list[Any] = []


class EstimateUnsupported(RuntimeError):
    """The program did something an estimate cannot follow on an emulated device (the message names it)."""


@dataclass(frozen=True)
class GpuSpec:
    """The emulated GPU: what `torch.cuda.get_device_properties` answers during the trace."""

    name: str
    total_memory_bytes: int
    major: int
    minor: int
    multi_processor_count: int
    context_bytes: int | None = None


def _torch_lib(name: str) -> ctypes.CDLL:
    import torch

    return ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", name))


def _probe_backward(mode) -> bool:
    import torch

    with mode:
        w = torch.ones(2, device="cuda", requires_grad=True)
        (w * 2).sum().backward()
    return w.grad is not None


def install_backward_fix(make_mode: Callable[[], Any]) -> int:
    """Patches the CUDA hooks so that backward over fake CUDA tensors runs without a GPU; returns the vtable
    slot it replaced. Idempotent. `make_mode` builds a FakeTensorMode for the probes."""
    global _installed
    with _lock:
        if _installed:
            return _installed_slot[0]
        import torch

        if torch.cuda._is_compiled() is False:
            # A CPU-only build has no CUDA hooks to ask; backward works there as it is.
            _installed = True
            _installed_slot[0] = -1
            return -1
        lib = _torch_lib("libtorch_cpu.so")
        get_hooks = lib._ZN2at6detail12getCUDAHooksEv
        get_hooks.restype = ctypes.c_void_p
        hooks = get_hooks()
        original_vptr = ctypes.c_void_p.from_address(hooks).value
        original = (ctypes.c_void_p * _VTABLE_SLOTS).from_address(original_vptr)
        table = (ctypes.c_void_p * _VTABLE_SLOTS)(*[original[i] for i in range(_VTABLE_SLOTS)])
        seen: list[int] = []

        @ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_int8)
        def no_primary_context(_this, device_index):
            seen.append(device_index)
            return False

        answer = ctypes.cast(no_primary_context, ctypes.c_void_p).value
        mode = make_mode()
        # Slot 4 on torch 2.9-2.15 (after the two destructors, isBuilt and isAvailable); probe the rest if not.
        order = [4] + [i for i in range(2, 64) if i != 4]
        for slot in order:
            table[slot] = answer
            ctypes.c_void_p.from_address(hooks).value = ctypes.addressof(table)
            seen.clear()
            try:
                ok = _probe_backward(mode) and bool(seen)
            except RuntimeError:
                ok = False
            if ok:
                _keep_alive.extend([table, no_primary_context])
                # Give the object its own vtable back before Python frees ours (C++ static destructors call
                # through it at exit).
                atexit.register(_restore_vptr, hooks, original_vptr)
                _installed = True
                _installed_slot[0] = slot
                return slot
            ctypes.c_void_p.from_address(hooks).value = original_vptr
            table[slot] = original[slot]
        raise EstimateUnsupported(
            f"torch {torch.__version__}: could not make backward run on an emulated CUDA device (no slot of the "
            "CUDA hooks answered the autograd engine's context query). If a backward already ran in this process, "
            "the engine set up its device threads without CUDA: run the estimate in a fresh process "
            "(`torchmem estimate script.py`). Else use a torch version from 2.9 to 2.15, or a machine with a GPU"
        )


_installed_slot = [-1]


def _restore_vptr(hooks: int, vptr: int) -> None:
    ctypes.c_void_p.from_address(hooks).value = vptr


# ----------------------------------------------------------------------------------------------- torch.cuda
class _Props:
    """What `torch.cuda.get_device_properties` returns for the emulated GPU."""

    def __init__(self, spec: GpuSpec) -> None:
        self.name = spec.name
        self.total_memory = spec.total_memory_bytes
        self.major = spec.major
        self.minor = spec.minor
        self.multi_processor_count = spec.multi_processor_count
        self.is_integrated = False
        self.is_multi_gpu_board = False
        self.gcnArchName = "NVIDIA CUDA"
        self.uuid = "00000000-0000-0000-0000-000000000000"
        self.L2_cache_size = 50 * 2**20
        self.warp_size = 32
        self.max_threads_per_multi_processor = 2048
        self.regs_per_multiprocessor = 65536
        self.shared_memory_per_block = 48 * 1024
        self.shared_memory_per_block_optin = 227 * 1024
        self.shared_memory_per_multiprocessor = 228 * 1024

    def __repr__(self) -> str:
        return (
            f"_CudaDeviceProperties(name='{self.name}', major={self.major}, minor={self.minor}, "
            f"total_memory={self.total_memory // 2**20}MB, multi_processor_count={self.multi_processor_count}) "
            "[emulated by torchmem estimate]"
        )


def _needs_device(what: str):
    def fail(*_a, **_k):
        raise EstimateUnsupported(
            f"{what} needs a real CUDA device; `torchmem estimate` runs the program on an emulated one. "
            "Remove or guard the call (e.g. behind an environment variable) for the estimate"
        )

    return fail


def _needs_device_class(what: str) -> type:
    """A class (usable in annotations such as `torch.cuda.CUDAGraph | None`) that fails when instantiated."""

    def __init__(self, *_a, **_k):
        _needs_device(what)()

    return type("NeedsRealDevice", (), {"__init__": __init__, "__doc__": f"{what}: needs a real CUDA device"})


class _Streams:
    """The emulated device's streams: the current one, and where the trace changed stream.

    The caching allocator keeps a pool per stream (a block freed on one stream is not reused by a request on
    another), so each request of the trace carries the stream current when it was made: FSDP2 allocates its
    all-gather buffers on its copy-in stream and its reduce-scatter outputs (the sharded gradients) on its
    reduce-scatter stream. `marks` holds `(index of the next trace event, stream id)` at each change; the snapshot
    (`_snapshot.build`) gives every request the stream of the last mark before it (the default stream, 0, before
    any). The current stream is one for the process: a stream context (`torch.cuda.stream(s)`) restores the one
    it replaced, so nested and sequential use on any thread comes out as torch's thread-local stream would when
    threads do not interleave them."""

    def __init__(self) -> None:
        self.next_id = 1
        self.current_id = 0
        self.tracer = None
        self.default = None

    def new_id(self) -> int:
        i = self.next_id
        self.next_id += 1
        return i

    def set_current(self, stream_id: int) -> int:
        prev = self.current_id
        if stream_id != prev:
            self.current_id = stream_id
            tr = self.tracer
            if tr is not None:
                marks = tr.__dict__.setdefault("stream_marks", [])
                marks.append((len(tr.events), stream_id))
        return prev


_STREAMS = _Streams()


class _FakeStream:
    """`torch.cuda.Stream` stand-in. Each new stream has its own id (the default stream is 0); entering it (or
    `torch.cuda.stream(s)`) makes it current, and the trace's requests carry the current stream (`_Streams`)."""

    device_index = 0
    device_type = 1  # c10::DeviceType::CUDA

    def __init__(self, *_a, _stream_id: int | None = None, **_k) -> None:
        self.device = _torch_device()
        # `torch.Stream`'s fields (FSDP2's `record_grad_output_stream` passes them to a no-op custom op).
        self.stream_id = _STREAMS.new_id() if _stream_id is None else _stream_id
        self._prev: list[int] = []

    @property
    def cuda_stream(self) -> int:
        # A `cudaStream_t`-like value: 0 for the default stream, distinct and increasing for the others.
        return 0 if self.stream_id == 0 else 0x7F0000000000 + 0x10 * self.stream_id

    def __enter__(self):
        self._prev.append(_STREAMS.set_current(self.stream_id))
        return self

    def __exit__(self, *exc) -> None:
        _STREAMS.set_current(self._prev.pop() if self._prev else 0)
        return None

    def wait_stream(self, *_a) -> None:
        return None

    def wait_event(self, *_a) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def record_event(self, event=None):
        return event if event is not None else _FakeEvent()

    def __eq__(self, other) -> bool:
        return isinstance(other, _FakeStream) and other.stream_id == self.stream_id

    def __hash__(self) -> int:
        return self.stream_id


def _default_stream() -> _FakeStream:
    if _STREAMS.default is None:
        _STREAMS.default = _FakeStream(_stream_id=0)
    return _STREAMS.default


def _current_stream(*_a, **_k) -> _FakeStream:
    if _STREAMS.current_id == 0:
        return _default_stream()
    s = _FakeStream(_stream_id=_STREAMS.current_id)
    return s


class _StreamContext:
    """`torch.cuda.stream(s)`: `s` current inside (None: no change)."""

    def __init__(self, stream=None) -> None:
        self.stream = stream
        self.prev = 0

    def __enter__(self):
        if self.stream is not None:
            self.prev = _STREAMS.set_current(getattr(self.stream, "stream_id", 0))
        return self.stream

    def __exit__(self, *exc) -> None:
        if self.stream is not None:
            _STREAMS.set_current(self.prev)
        return None


class _FakeEvent:
    """`torch.cuda.Event` stand-in: `elapsed_time` is the host time between the two `record()` calls (the
    emulated device computes nothing), never 0, so a program's throughput print does not divide by zero."""

    def __init__(self, *_a, **_k) -> None:
        self._recorded_s = time.perf_counter()

    def record(self, *_a) -> None:
        self._recorded_s = time.perf_counter()

    def wait(self, *_a) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event) -> float:
        ms = (getattr(end_event, "_recorded_s", self._recorded_s) - self._recorded_s) * 1e3
        return max(ms, 1e-3)


class _FakeDeviceContext:
    """`torch.cuda.device(i)` / `torch.cuda.device_of(t)` stand-in: the emulated device is the only one, so
    switching to it changes nothing (the real one calls the CUDA runtime: "driver version is insufficient")."""

    def __init__(self, device=None) -> None:
        self.idx = 0
        self.prev_idx = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False


def _generator_class(original: type) -> type:
    """`torch.Generator` whose `device="cuda"` generator is a CPU one: the real one initializes CUDA ("driver
    version is insufficient"); the fake random kernels take a CPU generator for a CUDA tensor and compute
    nothing. A subclass, so `isinstance(g, torch.Generator)` holds."""

    class Generator(original):  # type: ignore[misc, valid-type]
        def __new__(cls, device=None):
            if device is None:
                return original.__new__(cls)
            if isinstance(device, int) or str(device).startswith("cuda"):
                device = "cpu"
            return original.__new__(cls, device)

    Generator.__qualname__ = Generator.__name__ = "Generator"
    Generator.__module__ = "torch"
    return Generator


def _rng_state():
    import torch

    return torch.zeros(16, dtype=torch.uint8)


def _torch_device():
    import torch

    return torch.device("cuda", 0)


_INHERITED = object()


class CudaShim:
    """Replaces the `torch.cuda` functions a training script calls with answers for the emulated GPU; the
    memory counters come from the tracer (`memory_allocated` is the trace's live bytes, 512-rounded)."""

    def __init__(self, spec: GpuSpec, tracer) -> None:
        self.spec = spec
        self.tracer = tracer
        self._saved: list[tuple[Any, str, Any]] = []
        # PYTORCH_CUDA_ALLOC_CONF the estimate simulates (the runner sets the CLI's --alloc-conf).
        self.alloc_conf = ""
        self._reserved_at: tuple[int, int] = (-1, 0)  # (trace length, simulated reserved bytes)

    def reserved_bytes(self) -> int:
        """What `torch.cuda.memory_reserved()` answers: the allocator simulator's reserved bytes for the trace so
        far (the estimate's own simulation, with the device's capacity). The emulated allocator never gives
        segments back (`empty_cache` is not modelled), so the current reserved is the peak so far."""
        tr = self.tracer
        n = len(tr.events)
        if self._reserved_at[0] == n:
            return self._reserved_at[1]
        reserved = tr.live_bytes_rounded()
        try:
            import pickle

            from .. import _native
            from . import _snapshot

            with tr._lock:
                snap = _snapshot.build(tr, alloc_conf=self.alloc_conf)
            r = _native.simulate(
                data=pickle.dumps(snap, protocol=4),
                alloc_conf=self.alloc_conf or None,
                device_memory_bytes=self.spec.total_memory_bytes,
            )
            reserved = max(reserved, int(r["devices"][0]["peak_reserved_bytes"]))
        except Exception:  # noqa: BLE001 - an empty trace or a simulator error: the live bytes, never a failure
            pass
        self._reserved_at = (n, reserved)
        return reserved

    def _memory_stats(self) -> dict:
        tr = self.tracer
        reserved = self.reserved_bytes()
        return {
            "allocated_bytes.all.current": tr.live_bytes_rounded(),
            "allocated_bytes.all.peak": tr.peak_bytes_rounded(),
            "active_bytes.all.current": tr.live_bytes_rounded(),
            "active_bytes.all.peak": tr.peak_bytes_rounded(),
            "reserved_bytes.all.current": reserved,
            "reserved_bytes.all.peak": reserved,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }

    def _set(self, obj, name: str, value) -> None:
        # A class's inherited method (Tensor.record_stream) is deleted again, not copied onto the class.
        inherited = isinstance(obj, type) and name not in obj.__dict__
        self._saved.append((obj, name, _INHERITED if inherited else getattr(obj, name, None)))
        setattr(obj, name, value)

    def install(self) -> None:
        import torch
        import torch.cuda.memory as cmem

        props = _Props(self.spec)
        tr = self.tracer
        _STREAMS.tracer, _STREAMS.current_id = tr, 0
        cuda = torch.cuda
        simple = {
            "is_available": lambda: True,
            "device_count": lambda: 1,
            "current_device": lambda: 0,
            "set_device": lambda *_a, **_k: None,
            "synchronize": lambda *_a, **_k: None,
            "init": lambda: None,
            "_lazy_init": lambda: None,
            "is_initialized": lambda: True,
            "get_device_properties": lambda *_a, **_k: props,
            "get_device_name": lambda *_a, **_k: self.spec.name,
            "get_device_capability": lambda *_a, **_k: (self.spec.major, self.spec.minor),
            "get_arch_list": lambda: [f"sm_{self.spec.major}{self.spec.minor}"],
            "is_bf16_supported": lambda *_a, **_k: self.spec.major >= 8,
            "manual_seed": lambda *_a, **_k: None,
            "manual_seed_all": lambda *_a, **_k: None,
            "seed": lambda: None,
            "seed_all": lambda: None,
            "empty_cache": lambda: tr.note(
                "torch.cuda.empty_cache() was called: the estimate keeps the cache (its reserved is an upper bound)"
            ),
            "memory_allocated": lambda *_a, **_k: tr.live_bytes_rounded(),
            "max_memory_allocated": lambda *_a, **_k: tr.peak_bytes_rounded(),
            "memory_reserved": lambda *_a, **_k: self.reserved_bytes(),
            "max_memory_reserved": lambda *_a, **_k: self.reserved_bytes(),
            "reset_peak_memory_stats": lambda *_a, **_k: tr.reset_peak(),
            "reset_max_memory_allocated": lambda *_a, **_k: tr.reset_peak(),
            "mem_get_info": lambda *_a, **_k: (
                self.spec.total_memory_bytes - self.reserved_bytes(),
                self.spec.total_memory_bytes,
            ),
            "memory_stats": lambda *_a, **_k: self._memory_stats(),
            "set_per_process_memory_fraction": lambda *_a, **_k: tr.note(
                "torch.cuda.set_per_process_memory_fraction() was called; the estimate ignores the cap"
            ),
            "Stream": _FakeStream,
            "Event": _FakeEvent,
            "current_stream": _current_stream,
            "default_stream": lambda *_a, **_k: _default_stream(),
            "stream": _StreamContext,
            "StreamContext": _StreamContext,
            "set_stream": lambda s=None: _STREAMS.set_current(getattr(s, "stream_id", 0)),
            # CUDA's generator state is 16 bytes (Philox seed and offset) in a CPU uint8 tensor; the emulated
            # device computes nothing random, so any state is accepted and a fixed one given.
            "get_rng_state": lambda *_a, **_k: _rng_state(),
            "set_rng_state": lambda *_a, **_k: None,
            "get_rng_state_all": lambda: [_rng_state()],
            "set_rng_state_all": lambda *_a, **_k: None,
            "initial_seed": lambda: 0,
            "device": _FakeDeviceContext,
            "device_of": _FakeDeviceContext,
            "_exchange_device": lambda *_a, **_k: 0,
            "_maybe_exchange_device": lambda *_a, **_k: 0,
            # Asked by libraries before a CUDA-graph-only path (transformers' `is_tracing`): no capture here.
            "is_current_stream_capturing": lambda: False,
            "current_blas_handle": _needs_device("torch.cuda.current_blas_handle()"),
            "CUDAGraph": _needs_device_class("torch.cuda.CUDAGraph (CUDA graphs)"),
            "graph": _needs_device_class("torch.cuda.graph (CUDA graph capture)"),
            "memory_snapshot": _needs_device("torch.cuda.memory_snapshot()"),
        }
        for name, value in simple.items():
            if hasattr(cuda, name):
                self._set(cuda, name, value)
        for name in (
            "memory_allocated",
            "max_memory_allocated",
            "memory_reserved",
            "max_memory_reserved",
            "memory_stats",
            "mem_get_info",
            "reset_peak_memory_stats",
            "reset_max_memory_allocated",
            "empty_cache",
        ):
            if hasattr(cmem, name):
                self._set(cmem, name, simple[name])
        self._set(cmem, "_record_memory_history", lambda *_a, **_k: None)
        self._set(cmem, "_snapshot", _needs_device("torch.cuda.memory._snapshot()"))
        self._set(cmem, "_dump_snapshot", _needs_device("torch.cuda.memory._dump_snapshot()"))
        self._set(torch.backends.cuda, "is_built", lambda: True)
        self._set(torch, "Generator", _generator_class(torch.Generator))
        # `tensor.record_stream(s)` keeps a block from reuse until the stream's work is done; the trace has one
        # stream, so there is nothing to wait for (the C binding would refuse our stand-in stream).
        self._set(torch.Tensor, "record_stream", lambda _tensor, _stream: None)

    def uninstall(self) -> None:
        _STREAMS.tracer, _STREAMS.current_id = None, 0
        for obj, name, old in reversed(self._saved):
            if old is _INHERITED:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
        self._saved.clear()
