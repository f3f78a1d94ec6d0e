"""One estimate's tracing session: puts the process on an emulated CUDA device (fake tensors, the backward fix,
`torch.cuda` answers for the target GPU), records the storage trace with phases (forward, backward, optimizer)
and optimizer steps, and takes it all down again. Used by `torchmem.estimate()` and by the script runner that
`torchmem estimate -- COMMAND` injects.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
)

from . import _device, _rules
from ._compile import CompileEmulation
from ._ctc import CtcEmulation
from ._inference import ForwardCounter, GenerationPatches
from ._rnn import RnnEmulation
from ._tracer import Tracer


class StopTrace(BaseException):
    """Raised from the optimizer's step hook once the requested number of steps has been traced (a
    BaseException, so a program's `except Exception` does not swallow it)."""


_PIN_MEMORY = torch.ops.aten._pin_memory.default
_IS_PINNED = torch.ops.aten.is_pinned.default
_PINNED_ATTR = "_torchmem_pinned"
_CUDA0 = torch.device("cuda", 0)
# Host values (see `_EmulatedFakeMode`): CPU tensors of at most this many elements made by these factories carry
# their real values, and so does what is computed from them alone.
HOST_VALUE_NUMEL = 4096
_aten = torch.ops.aten
_HOST_FACTORIES = frozenset({
    _aten.ones.default, _aten.zeros.default, _aten.full.default, _aten.scalar_tensor.default,
    _aten.arange.default, _aten.arange.start, _aten.arange.start_step,
})  # fmt: skip


def _mark_pinned(t: torch.Tensor) -> None:
    # On the storage (kept as one Python object per storage), not a weak reference to the tensor: a tensor with
    # weak references cannot be swapped by `module.to()`.
    if t.device.type == "cpu":
        setattr(t.untyped_storage(), _PINNED_ATTR, True)


def _is_pinned(t: torch.Tensor) -> bool:
    try:
        return bool(getattr(t.untyped_storage(), _PINNED_ATTR, False))
    except (NotImplementedError, RuntimeError):
        return False


class _EmulatedFakeMode(FakeTensorMode):
    """FakeTensorMode that keeps its no-device behaviour (no real CUDA init, CPU-only constant lifting) while
    `torch.cuda.is_available()` answers True for the program.

    Host values: a program's small CPU tensors carry their real values. The fake mode keeps a real copy (its
    "constant") of a CPU tensor of one element made from Python numbers, and computes what is made from
    constants alone for real; a value read of a constant answers the true value instead of 0. Here that holds
    for integer and boolean CPU tensors of up to `HOST_VALUE_NUMEL` elements, and for the plain factories
    (`torch.ones`, `zeros`, `full`, `arange` on the CPU) of such tensors too: the bookkeeping a program keeps on
    the host (Whisper's `generate` loops `while (seek < max_frames).any()` over two long tensors of the batch's
    size; a loop bound, lengths, indices) then runs as it does on the GPU, while device tensors, large host
    tensors, random ones and floating-point ones stay without values (a read of them answers 0, as before).
    Floating point is left out because a module's small parameters are made so (`nn.Parameter(torch.zeros(n))`):
    the fake mode keeps a weak reference to each constant, and `module.to("cuda")` cannot swap a tensor that has
    one. The cost: a real CPU computation on a few thousand elements at most."""

    @property
    def avoid_device_init(self) -> bool:  # type: ignore[override]
        return True

    def may_turn_const(self, t: torch.Tensor) -> bool:
        return super().may_turn_const(t) or (
            t.device.type == "cpu" and t.numel() <= HOST_VALUE_NUMEL and t.layout == torch.strided
            and not (t.is_floating_point() or t.is_complex()) and not self.is_our_fake(t)
        )  # fmt: skip

    def _host_factory(self, func, args, kwargs):
        device = kwargs.get("device")
        if device is not None and torch.device(device).type != "cpu":
            return None
        if kwargs.get("pin_memory") or kwargs.get("layout") not in (None, torch.strided):
            return None
        from torch.utils._mode_utils import no_dispatch

        with no_dispatch():  # the factory's size and dtype, from torch itself (no data)
            shape = func(*args, **{**kwargs, "device": "meta"})
            if shape.numel() > HOST_VALUE_NUMEL or shape.is_floating_point() or shape.is_complex():
                return None
            real = func(*args, **kwargs)
        return self.fake_tensor_converter.from_real_tensor(self, real, make_constant=True)

    def dispatch(self, func, types, args=(), kwargs=None):
        # Pinned host memory is host memory: `tensor.pin_memory()` (a DataLoader with `pin_memory=True`) copies
        # the tensor into a new CPU tensor that costs no device bytes; the fake mode has no kernel for it
        # ("NYI: aten._pin_memory.default") and answers `is_pinned()` False. We copy and remember the storage.
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and isinstance(device, torch.device) and device.type == "cuda" and device.index:
            # One emulated GPU per process, cuda:0: a rank's `torch.device(f"cuda:{local_rank}")` is that GPU, as
            # `.cuda()` and "cuda" are (`torch.cuda.current_device()` answers 0), so the two never mismatch.
            kwargs = {**kwargs, "device": _CUDA0}
        if func is _PIN_MEMORY:
            out = super().dispatch(torch.ops.aten.clone.default, types, (args[0],), {})
            _mark_pinned(out)
            return out
        if func is _IS_PINNED:
            return _is_pinned(args[0])
        if func in _HOST_FACTORIES:
            out = self._host_factory(func, args, kwargs)
            if out is not None:
                return out
        try:
            out = super().dispatch(func, types, args, kwargs)
        except RuntimeError as e:
            # An operator without a shape-only kernel falls back to its real kernel, which needs a real GPU for
            # device tensors ("Found no NVIDIA driver"): it is the operator that cannot be emulated.
            if "NVIDIA driver" in str(e) or "not compiled with CUDA" in str(e):
                raise UnsupportedOperatorException(func) from e
            raise
        if kwargs.get("pin_memory") and isinstance(out, torch.Tensor):  # torch.empty(..., pin_memory=True)
            _mark_pinned(out)
        return out

    def __deepcopy__(self, memo) -> _EmulatedFakeMode:
        # `copy.deepcopy(module)` (nn.TransformerEncoder copies its layer; EMA models) copies each FakeTensor's
        # `__dict__`, which holds its `fake_mode`: the copy got a copy of this mode, with a copy of its memo that
        # holds a weak reference to the copied tensor, and `.to("cuda")` then refused to swap it ("Cannot swap
        # t1 because it has weakref associated with it"). A tensor's copy belongs to the same mode.
        return self


def _new_mode() -> FakeTensorMode:
    return _EmulatedFakeMode(allow_non_fake_inputs=True)


class Session:
    """Enter to trace; `tracer` holds the events. `steps_limit` stops the program (StopTrace) after that many
    optimizer steps, `forward_calls_limit` after that many top-level forward calls or `generate` calls
    (`_inference.ForwardCounter`), whichever comes first; None never stops."""

    def __init__(
        self,
        gpu: _device.GpuSpec,
        *,
        steps_limit: int | None = None,
        forward_calls_limit: int | None = None,
        frames_min_bytes: int = 1 << 20,
        world=None,
    ):
        self.gpu = gpu
        # The emulated distributed world (`_distributed.World`; None: from the environment) and its emulation.
        self.world = world
        self.distributed = None
        self.steps_limit = steps_limit
        self.forwards = ForwardCounter(forward_calls_limit, self._limit_reached)
        self.backward_calls = 0
        self.rules = _rules.CudaRules(gpu)
        self.tracer = Tracer(frames_min_bytes=frames_min_bytes, rules=self.rules)
        self.mode: FakeTensorMode | None = None
        self._stack = contextlib.ExitStack()
        self._shim = _device.CudaShim(gpu, self.tracer)
        self._handles: list[Any] = []
        self._patches: list[tuple[Any, str, Any]] = []
        self._in_backward = 0
        self._in_optimizer = 0
        self._warning_filter: tuple | None = None
        self._generation = GenerationPatches(self.forwards, self.tracer.note)
        self._rnn = RnnEmulation(self.tracer, gpu)
        self._ctc = CtcEmulation(self.tracer)
        self._compile = CompileEmulation(self.tracer, self.rules, gpu)
        # Called once `steps_limit` steps are traced (the script runner writes the trace and exits); without
        # it the hook raises StopTrace.
        self.on_limit = None

    def _limit_reached(self) -> None:
        if self.on_limit is not None:
            self.on_limit()
        raise StopTrace

    @property
    def uses_half_precision(self) -> bool:
        """Whether the context's middle tier applies: half-precision GEMMs or cuDNN attention (`rules`), or cuDNN's
        RNN kernels, which load as much (758 MiB on the H200 and the H100 for every cuDNN RNN training script of
        the corpus)."""
        return self.rules.used_half or self._rnn.calls > 0

    # ------------------------------------------------------------------ patches
    def _patch(self, obj, name: str, value) -> None:
        self._patches.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def _install(self) -> None:
        import torch._subclasses.fake_tensor as fake_tensor_mod

        if hasattr(fake_tensor_mod, "init_gpu_context"):
            # torch 2.10-2.11: every new fake CUDA tensor first makes one real CUDA tensor when
            # `torch.cuda.is_available()` answers True (our answer, below), which fails without a driver; the
            # emulated device has no context to initialise.
            self._patch(fake_tensor_mod, "init_gpu_context", lambda device: None)
        self._shim.install()
        _device.install_backward_fix(_new_mode)
        import torch.optim.optimizer as optim_mod

        # The default optimizer picks foreach/fused only for `type(p) in (Tensor, Parameter)`; a fake parameter
        # is a FakeTensor, so without this the trace would take the per-tensor loop a real CUDA run never takes.
        if FakeTensor not in optim_mod._foreach_supported_types:
            self._patches.append((optim_mod, "_foreach_supported_types", list(optim_mod._foreach_supported_types)))
            optim_mod._foreach_supported_types.append(FakeTensor)
        self._patch_swap_tensors()
        self._patch_storage_resize()
        self._patch_backward()
        self._patch_distributed()
        # `copy.deepcopy` of a fake parameter reads its data pointer (torch's deepcopy checks for 0): torch warns
        # about that in the program's output; it is ours, not the program's.
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        self._warning_filter = warnings.filters[0]
        import torch.nn.functional as F

        self._patch(F, "scaled_dot_product_attention", _rules.sdpa_wrapper(self.rules, F.scaled_dot_product_attention))
        # torch.compile: Inductor's plan executed on the emulated device, or a stated bound (`_compile`).
        self._compile.install(self._patch)
        self._patch_dataloader()
        self._rnn.install()
        self._ctc.install()
        tr = self.tracer
        session = self

        forwards = self.forwards

        def forward_pre(_module, _args):
            if torch.compiler.is_compiling():  # inside a compiled graph: its caller's call counted
                return
            forwards.forward_pre()
            if session._in_backward == 0 and session._in_optimizer == 0 and tr.phase != "forward":
                session._set_phase("forward")

        def forward_post(_module, _args, _out):
            if torch.compiler.is_compiling():
                return
            forwards.forward_post(in_backward=session._in_backward > 0)

        def opt_pre(_opt, _args, _kwargs):
            session._in_optimizer += 1
            session._set_phase("optimizer")

        def opt_post(_opt, _args, _kwargs):
            session._in_optimizer -= 1
            if session._in_optimizer == 0:
                tr.step += 1
                session._set_phase("between steps")
                if session.steps_limit is not None and tr.step >= session.steps_limit:
                    session._limit_reached()

        self._handles.append(torch.nn.modules.module.register_module_forward_pre_hook(forward_pre))
        self._handles.append(torch.nn.modules.module.register_module_forward_hook(forward_post, always_call=True))
        self._generation.install()
        self._handles.append(optim_mod.register_optimizer_step_pre_hook(opt_pre))
        self._handles.append(optim_mod.register_optimizer_step_post_hook(opt_post))

    def _set_phase(self, phase: str) -> None:
        tr = self.tracer
        if tr.phase == phase:
            return
        if tr.phase not in ("setup", "between steps"):
            tr.mark(tr.phase, "END")
        tr.phase = phase
        if phase not in ("between steps",):
            tr.mark(phase, "START")

    def _patch_dataloader(self) -> None:
        # Worker processes would send fake tensors through shared memory, which fake tensors have none of; the
        # loader's workers hold no device memory, so loading in the main process changes nothing on the GPU.
        import torch.utils.data as data

        original = data.DataLoader.__init__
        tr = self.tracer

        def init(loader, *args, **kwargs):
            if kwargs.get("num_workers", 0) or (len(args) > 5 and args[5]):
                tr.note("DataLoader workers were replaced by loading in the main process (no effect on the GPU)")
                if len(args) > 5:  # DataLoader(dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, ...)
                    args = (*args[:5], 0, *args[6:])
                else:
                    kwargs["num_workers"] = 0
                kwargs.pop("prefetch_factor", None)
                kwargs["persistent_workers"] = False
            return original(loader, *args, **kwargs)

        self._patch(data.DataLoader, "__init__", init)

    def _patch_distributed(self) -> None:
        # A torchrun-style program (`init_process_group("nccl")`, WORLD_SIZE in the environment) waited forever
        # for ranks that never come: it runs as one rank of an emulated world (`_distributed`, torch's fake
        # process group), the world given to the session or else WORLD_SIZE/RANK from the environment, else 1.
        from ._distributed import Emulation, world_from_env

        world = self.world if self.world is not None else world_from_env()
        self.world = world
        emulation = Emulation(world, self.tracer)
        if emulation.install():
            self.distributed = emulation

    def _patch_storage_resize(self) -> None:
        # FSDP (fully_shard and FSDP1) frees unsharded parameters and all-gather outputs with
        # `tensor.untyped_storage().resize_(0)` and brings them back with `resize_(size)`: no operator returns the
        # storage, so without this the trace kept every unsharded parameter alive (an FSDP2 rank's peak then held
        # the whole model).
        original = torch.UntypedStorage.resize_
        tracer = self.tracer

        def resize_(storage, size):
            out = original(storage, size)
            tracer.storage_resized(storage)
            return out

        self._patch(torch.UntypedStorage, "resize_", resize_)

    def _patch_swap_tensors(self) -> None:
        # `module.to("cuda")` swaps fake parameters (torch >= 2.5 always swaps FakeTensors), and swapping refuses
        # a tensor with weak references; the only one is the fake mode's own memo entry, which we drop first.
        original = torch.utils.swap_tensors
        session = self

        def swap_tensors(t1, t2):
            mode = session.mode
            if mode is not None:
                memo = mode.fake_tensor_converter.meta_converter.tensor_memo
                for k, v in list(memo.items()):
                    if v is t1 or v is t2:
                        del memo[k]
            return original(t1, t2)

        self._patch(torch.utils, "swap_tensors", swap_tensors)

    def _patch_backward(self) -> None:
        import torch.autograd as autograd_mod
        import torch.autograd.graph as graph_mod

        original = graph_mod._engine_run_backward
        session = self

        def run_backward(*args, **kwargs):
            session._in_backward += 1
            if session._in_backward == 1:
                session.backward_calls += 1
                session._set_phase("backward")
            try:
                return original(*args, **kwargs)
            finally:
                session._in_backward -= 1
                if session._in_backward == 0:
                    session._set_phase("after backward")

        self._patch(graph_mod, "_engine_run_backward", run_backward)
        self._patch(autograd_mod, "_engine_run_backward", run_backward)

    # ------------------------------------------------------------------ context
    def __enter__(self) -> Session:
        try:
            self._install()
            self.mode = _new_mode()
            self._stack.enter_context(self.mode)
            self._stack.enter_context(self.tracer)
            _rules.calibrate_accumulation(self.mode)
            self.tracer.events.clear()
            self.tracer.annotations.clear()
            self.tracer.phase = "setup"
            self.tracer.step = 0
            self.forwards.reset()
            self.backward_calls = 0
        except BaseException:
            self.__exit__(None, None, None)
            raise
        global _active
        _active = self
        _register_fork_handler()
        return self

    def __exit__(self, *exc) -> None:
        global _active
        if _active is self:
            _active = None
        self.tracer.close()
        self._stack.close()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._generation.uninstall()
        self._ctc.uninstall()
        self._rnn.uninstall()
        self._compile.uninstall()
        for obj, name, old in reversed(self._patches):
            if isinstance(old, list) and name == "_foreach_supported_types":
                getattr(obj, name)[:] = old
            else:
                setattr(obj, name, old)
        self._patches.clear()
        if self.distributed is not None:
            self.distributed.uninstall()
        self._shim.uninstall()
        self.mode = None
        if self._warning_filter in warnings.filters:
            warnings.filters.remove(self._warning_filter)
            getattr(warnings, "_filters_mutated", lambda: None)()


_active: Session | None = None
_fork_handler_registered = False


def _register_fork_handler() -> None:
    global _fork_handler_registered
    if not _fork_handler_registered and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_leave_in_forked_child)
        _fork_handler_registered = True


def _leave_in_forked_child() -> None:
    """A forked child (a `multiprocessing` pool, a DataLoader worker a library starts itself) works on the CPU:
    it leaves the emulated device, so what it makes are real CPU tensors that can be sent back to the traced
    process (a fake tensor cannot be pickled). It records nothing: only the traced process writes the trace."""
    s = _active
    if s is None:
        return
    s.tracer.enabled = False
    s.on_limit = None
    try:
        s.__exit__(None, None, None)
    except Exception:  # noqa: BLE001 - forked from a thread without the modes: nothing more to take down
        pass


def translate_error(e: BaseException) -> BaseException | None:
    """A fake-tensor error turned into the estimate's message naming the call, or None if it is not one."""
    if isinstance(e, DynamicOutputShapeException):
        return _device.EstimateUnsupported(
            f"the program calls {e.func}, whose output shape depends on tensor values; an estimate on an "
            "emulated device has no values. Give the op a fixed size (e.g. a padded mask) for the estimate"
        )
    if isinstance(e, DataDependentOutputException):
        return _device.EstimateUnsupported(
            f"the program reads a tensor value ({e.func}); an estimate on an emulated device has no values"
        )
    if isinstance(e, UnsupportedOperatorException):
        return _device.EstimateUnsupported(
            f"the operator {e.func} has no fake (shape-only) kernel (a custom CUDA extension, or one of the few "
            "torch operators without one, such as the CTC loss); the estimate cannot run it without a GPU"
        )
    return None
