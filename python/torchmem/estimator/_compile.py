"""`torch.compile` under the emulated device (issue 23 item 4): the estimate of the compiled program, not the eager one.

What a compiled training step allocates is Inductor's plan, not the eager program's: aot_autograd partitions the
joint graph (the min-cut partitioner chooses which activations are saved for backward and recomputes the rest),
Inductor fuses pointwise and reduction work into Triton kernels (their intermediates never exist) and its wrapper
code allocates, reuses and frees the buffers (`buf3 = empty_strided_cuda(...)`, `del buf3`, `buf7 = buf3; # reuse`).

**The way (a): Inductor's plan, executed.** `torch.compile` runs for real on this CPU-only machine: dynamo traces,
aot_autograd partitions, Inductor lowers, schedules and generates its wrapper code for the target GPU (device
properties, compute capability and Triton's target are the emulated GPU's). Only Triton's compilation is skipped:
each generated kernel becomes a no-op that keeps its autotuning metadata. The wrapper then runs on the emulated
device as it would on the GPU: its `empty_strided_cuda` allocations are fake CUDA tensors the tracer records, its
`del`s and reuses are the frees, its extern kernels (cuBLAS GEMMs with `out=`, cuDNN convolutions, attention) run
through the estimate's CUDA rules (workspaces). What a GPU does besides the plan in the compile step is modelled:
the first run of a kernel with several configurations benchmarks them (`CachingAutotuner.bench`), with clones of the
arguments it mutates and the benchmarker's L2-flush buffer, once per kernel.

**The way (b), a stated bound**, when Inductor fails here or takes too long (`COMPILE_SECONDS`): aot_autograd with
Inductor's decompositions and partitioner (`min_cut_rematerialization_partition`), its forward and backward graphs
run op by op on the emulated device: the saved activations are the compiled program's, every intermediate is
materialised (fusion only removes intermediates), so the trace is an upper bound; the estimate says so.

Either way the report names torch.compile (a note, and an `uncertainty` reason of kind "torch.compile").
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
import sys
import threading
import time
import warnings
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# A compile (forward and backward of one graph) that takes longer than this on the estimating machine falls back to
# the bound (b); the graphs compiled so far keep their plans. TORCHMEM_ESTIMATE_COMPILE_SECONDS sets it;
# TORCHMEM_ESTIMATE_COMPILE=bound takes the bound (b) for every graph (no Inductor).
COMPILE_SECONDS = 240.0


def _compile_seconds() -> float:
    try:
        return float(os.environ.get("TORCHMEM_ESTIMATE_COMPILE_SECONDS", COMPILE_SECONDS))
    except ValueError:
        return COMPILE_SECONDS


_GEMM_EXTERN = {"mm": False, "addmm": True, "bmm": False, "baddbmm": False, "_int_mm": False, "_scaled_mm": False}
_KIND = "torch.compile"


# The L2 cache of the catalogue's GPUs (`torch.cuda.get_device_properties().L2_cache_size`): the size of Inductor's
# L2-flush buffer when it benchmarks a kernel's configurations.
_MIB = 1 << 20
_L2_BYTES = (
    ("H200", 50 * _MIB),
    ("H100", 50 * _MIB),
    ("A100", 40 * _MIB),
    ("L40S", 96 * _MIB),
    ("L4", 48 * _MIB),
    ("A10", 6 * _MIB),
    ("T4", 4 * _MIB),
    ("V100", 6 * _MIB),
    ("RTX 4090", 72 * _MIB),
    ("RTX 3090", 6 * _MIB),
    ("RTX 3060", 3 * _MIB),
)


def l2_cache_bytes(gpu) -> int:
    for key, size in _L2_BYTES:
        if key in gpu.name:
            return size
    return int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or 0)


class _CompileTimeout(Exception):
    pass


class _NoKernel:
    """A generated Triton kernel that does not run (no GPU): `.run()` is a no-op on the emulated device, except the
    first call of a kernel with several configurations, which does the allocations of its autotuning."""

    def __init__(self, emulation: CompileEmulation, name: str, configs: int, mutated: list[str], arg_names: list[str]):
        self._emulation = emulation
        self.name = name
        self.configs = configs
        self.mutated = mutated
        self.arg_names = arg_names
        self._ran = False

    def run(self, *args, **_kwargs) -> None:
        if not self._ran:
            self._ran = True
            if self.configs > 1:
                self._emulation.autotune(self, args)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *_a, **_k: None


def _kernel_info(name: str, source: str) -> tuple[int, list[str], list[str]]:
    """(number of autotuning configs, mutated argument names, argument names) of a generated kernel: from the
    CachingAutotuner its source builds (Triton's compilation is never started), else read from the source."""
    try:
        from torch._inductor.codecache import PyCodeCache

        kernel = getattr(PyCodeCache.load(source), name)
        configs = len(getattr(kernel, "configs", ()) or ())
        mutated = list(getattr(kernel, "mutated_arg_names", ()) or ())
        arg_names = list(getattr(getattr(kernel, "fn", None), "arg_names", ()) or ())
        return configs, mutated, arg_names
    except Exception:  # noqa: BLE001 - read the source instead
        pass
    m = re.search(r"'mutated_arg_names':\s*\[([^\]]*)\]", source)
    mutated = re.findall(r"'([^']+)'", m.group(1)) if m else []
    sig = re.search(r"def\s+" + re.escape(name) + r"\(([^)]*)\)", source)
    arg_names = [a.split(":")[0].strip() for a in sig.group(1).split(",")] if sig else []
    # Reductions and persistent reductions are autotuned over several configurations; pointwise kernels mostly not.
    configs = 2 if re.search(r"@triton_heuristics\.(reduction|persistent_reduction|split_scan)", source) else 1
    return configs, mutated, arg_names


class _Extern:
    """`extern_kernels` of the generated wrapper: cuBLAS GEMMs are called with `out=` (`aten.mm.out`), which the
    estimate's GEMM rule does not see; the first GEMM of a thread takes cuBLAS's workspace as in eager mode."""

    def __init__(self, emulation: CompileEmulation, inner) -> None:
        self._emulation = emulation
        self._inner = inner

    def __getattr__(self, name: str):
        fn = getattr(self._inner, name)
        if name not in _GEMM_EXTERN:
            return fn
        emulation = self._emulation
        lt = _GEMM_EXTERN[name]

        @functools.wraps(fn)
        def gemm(*args, **kwargs):
            out = fn(*args, **kwargs)
            emulation.gemm(lt, args)
            return out

        return gemm


class CompileEmulation:
    """Installs `torch.compile` for a tracing session (`_session.Session`): Inductor's plan executed on the
    emulated device, or the bound (b)."""

    def __init__(self, tracer, rules, gpu) -> None:
        self.tracer = tracer
        self.rules = rules
        self.gpu = gpu
        self.graphs = 0  # graphs compiled by Inductor (forward and backward count apart)
        self.kernels = 0
        self.autotuned = 0
        self.bounded: list[str] = []  # why graphs fell back to (b)
        self.compile_seconds = 0.0
        self._real_compile = None
        self._message = ""
        self._library = None
        self._warning_filter = None
        self._dynamo_config = None
        self.eager_frames: list[str] = []  # frames dynamo failed on here (run eagerly)

    # ------------------------------------------------------------------ install
    def install(self, patch) -> None:
        """`patch(obj, name, value)` is the session's patcher (undone at its exit)."""
        self._real_compile = torch.compile
        patch(torch, "compile", self.compile)
        # Dynamo refuses to trace while a non-infrastructure dispatch mode is on the stack (it would run the frame
        # eagerly): the tracer asks it not to look at compile internals, which run with the modes taken off
        # (`_compiling`), while the compiled code runs under them.
        self.tracer.ignore_compile_internals = lambda: True
        # The estimate's global module hooks make torch warn about compiled modules in the program's output; they are
        # ours, not the program's.
        warnings.filterwarnings("ignore", message=r"Using `torch\.compile\(module\)` when there are global hooks")
        self._warning_filter = warnings.filters[0]
        self._install_sdpa(patch)
        _reset_dynamo()

    def _install_sdpa(self, patch) -> None:
        """SDPA in a compiled graph: the estimate's `F.scaled_dot_product_attention` wrapper picks the backend in
        Python (`_rules.sdpa_wrapper`), which dynamo cannot trace (a graph break in every attention layer split
        nanoGPT's forward into 14 graphs). While dynamo traces, the wrapper hands over to torch's own function, as
        on a GPU; aot_autograd's decomposition of it then takes the backend from `_sdpa_kernel` (installed for the
        compile). A program's own `torch._fused_sdp_choice` call (on fake CUDA tensors: the Meta kernel) answers the
        estimate's rule too."""
        import torch.nn.functional as F

        wrapper = F.scaled_dot_product_attention
        original = torch._C._nn.scaled_dot_product_attention

        @functools.wraps(wrapper)
        def scaled_dot_product_attention(*args, **kwargs):
            if torch.compiler.is_compiling():
                return original(*args, **kwargs)
            return wrapper(*args, **kwargs)

        patch(F, "scaled_dot_product_attention", scaled_dot_product_attention)
        rules = self.rules

        def fused_sdp_choice(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
            # Fake tensors run this kernel as meta tensors (their `.device` says meta inside the kernel call): the
            # device that counts is the one they stand for.
            device = getattr(q, "fake_device", q.device)
            if device.type != "cuda":
                return 0  # math, as torch's Meta kernel answers for a tensor not on CUDA
            return int(rules.sdpa_backend(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa))

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": ours, until uninstall
                lib = torch.library.Library("aten", "IMPL")
                lib.impl("_fused_sdp_choice", fused_sdp_choice, "Meta")
            self._library = lib
        except Exception:  # noqa: BLE001 - then compiled attention takes torch's answer (math), said in a note
            self.tracer.note("torch.compile: the SDPA backend rule could not be installed for compiled graphs")

    def uninstall(self) -> None:
        if self._real_compile is not None:
            _reset_dynamo()
        if self._library is not None:
            self._library._destroy()
            self._library = None
        if self._dynamo_config is not None:
            import torch._dynamo.config as dconfig

            dconfig.suppress_errors, logger, handler, logger.propagate = self._dynamo_config
            logger.removeHandler(handler)
            self._dynamo_config = None
        if self._warning_filter in warnings.filters:
            warnings.filters.remove(self._warning_filter)
            getattr(warnings, "_filters_mutated", lambda: None)()
        self.tracer.__dict__.pop("ignore_compile_internals", None)

    # ------------------------------------------------------------------ torch.compile
    def compile(
        self, model=None, *, fullgraph=False, dynamic=None, backend="inductor", mode=None, options=None, disable=False
    ):
        if model is None:
            return lambda m: self.compile(
                m, fullgraph=fullgraph, dynamic=dynamic, backend=backend, mode=mode, options=options, disable=disable
            )
        if disable:
            return model
        tr = self.tracer
        if backend != "inductor":
            name = backend if isinstance(backend, str) else getattr(backend, "__name__", type(backend).__name__)
            if name not in ("eager", "aot_eager"):
                tr.note(
                    f"torch.compile(backend={name!r}): the estimate traced the program eagerly (only Inductor's plan "
                    "is emulated); a backend that plans its own buffers can need less or more"
                )
            return model
        if mode in ("reduce-overhead", "max-autotune"):
            tr.note(
                f"torch.compile(mode={mode!r}) uses CUDA graphs: the estimate is Inductor's plan without them (a CUDA "
                "graph's private memory pool keeps its buffers between replays: more reserved memory)"
            )
        if mode in ("max-autotune", "max-autotune-no-cudagraphs"):
            tr.note(
                f"torch.compile(mode={mode!r}) autotunes GEMM templates on the GPU: the estimate uses the default "
                "choices (cuBLAS)"
            )
        self._suppress_dynamo_errors()
        return self._real_compile(model, backend=self._backend(options or {}), fullgraph=fullgraph, dynamic=dynamic)

    def _suppress_dynamo_errors(self) -> None:
        """A frame dynamo cannot trace on the emulated device (a compiled optimizer step: dynamo runs `_init_group`
        with the estimate's modes off, and `torch.zeros(device="cuda")` then needs a driver) runs eagerly instead of
        ending the estimate, and the report says so (dynamo's `suppress_errors`, its warning caught)."""
        if self._dynamo_config is not None:
            return
        import logging

        import torch._dynamo.config as dconfig

        emulation = self

        class _Caught(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if record.levelno < logging.WARNING:
                    return
                first = next((ln for ln in record.getMessage().splitlines() if ln.strip()), "")[:200]
                emulation.eager_frames.append(first)
                emulation._describe()

        logger = logging.getLogger("torch._dynamo.convert_frame")
        handler = _Caught()
        self._dynamo_config = (dconfig.suppress_errors, logger, handler, logger.propagate)
        dconfig.suppress_errors = True
        logger.addHandler(handler)
        logger.propagate = False

    def _backend(self, options: dict):
        emulation = self

        def torchmem_inductor(gm, example_inputs):
            return emulation._compile_graph(gm, example_inputs, options)

        return torchmem_inductor

    def _compile_graph(self, gm, example_inputs, options: dict):
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        lowered = [0]

        def inner(*args, **kwargs):
            with self._compiling():
                out = compile_fx_inner(*args, **kwargs)
            lowered[0] += 1
            return out

        t0 = time.perf_counter()
        limit = _compile_seconds()
        why = ""
        compiled = None
        try:
            if os.environ.get("TORCHMEM_ESTIMATE_COMPILE") == "bound":
                why = "TORCHMEM_ESTIMATE_COMPILE=bound asked for the bound"
            else:
                with self._compiling(), _deadline(limit):
                    compiled = compile_fx(gm, example_inputs, inner_compile=inner, config_patches=_options(options))
                self.graphs += lowered[0]
        except _CompileTimeout:
            why = f"Inductor took more than {limit:g} s here (TORCHMEM_ESTIMATE_COMPILE_SECONDS)"
        except Exception as e:  # noqa: BLE001 - Inductor failed on the emulated device: the bound (b), said so
            if os.environ.get("TORCHMEM_COMPILE_DEBUG"):
                raise
            if _timed_out(e):  # the alarm fired inside Inductor, which wrapped it (LoweringException)
                why = f"Inductor took more than {limit:g} s here (TORCHMEM_ESTIMATE_COMPILE_SECONDS)"
            else:
                inner_e = getattr(e, "inner_exception", None) or e.__cause__ or e
                first = (str(inner_e).strip().splitlines() or [""])[0][:200]
                why = f"Inductor failed on the emulated device ({type(inner_e).__name__}: {first})"
        finally:
            self.compile_seconds += time.perf_counter() - t0
        if compiled is None:
            compiled = self._bounded(gm, example_inputs, why)
        self._describe()
        return compiled

    # ------------------------------------------------------------------ the bound (b)
    def _bounded(self, gm, example_inputs, why: str):
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func
        from torch._functorch.partitioners import min_cut_rematerialization_partition
        from torch._inductor.decomposition import select_decomp_table

        self.bounded.append(why)

        def run_graph(g, _inputs):
            # The partitioned graph, run op by op on the emulated device when the compiled program runs.
            return make_boxed_func(g)

        backend = aot_autograd(
            fw_compiler=run_graph,
            bw_compiler=run_graph,
            partition_fn=min_cut_rematerialization_partition,
            decompositions=select_decomp_table(),
        )
        with self._compiling(inductor=False):
            return backend(gm, example_inputs)

    # ------------------------------------------------------------------ the report
    def _describe(self) -> None:
        """The report's note and `uncertainty` reason (kind "torch.compile"), kept up to date as graphs compile and
        kernels autotune: exact plan or bound, and what is modelled."""
        tr = self.tracer
        parts = []
        if self.graphs:
            parts.append(
                f"torch.compile: Inductor's plan was executed on the emulated device ({self.graphs} graph(s), "
                f"{self.kernels} Triton kernel(s) as no-ops, {self.autotuned} autotuned at their first run: "
                f"argument clones and the L2-flush buffer); the generated code is torch {torch.__version__}'s, "
                f"compiled here in {self.compile_seconds:.0f} s"
            )
        if self.bounded:
            parts.append(
                f"torch.compile: {self.bounded[-1]}; {len(self.bounded)} graph(s) were traced op by op after "
                "aot_autograd's min-cut partition (the saved activations are the compiled program's; every "
                "intermediate that Inductor would fuse away is counted): that part is an upper bound"
            )
        if self.eager_frames:
            parts.append(
                f"torch.compile: dynamo could not trace {len(self.eager_frames)} frame(s) on the emulated device "
                f"({self.eager_frames[-1]}); they ran eagerly: that part of the estimate is the eager program's"
            )
        message = "; ".join(parts)
        if not message:
            return
        notes = tr.notes.messages
        if self._message in notes:
            notes[notes.index(self._message)] = message
        else:
            notes.append(message)
        self._message = message
        reason = tr.uncertain_reasons.setdefault(
            (_KIND, "", "", ""), {"kind": _KIND, "what": "", "op": "", "shapes": "", "site": "", "calls": 0, "bytes": 0}
        )
        reason["what"] = message
        reason["calls"] = self.graphs + len(self.bounded) + len(self.eager_frames)
        ways = []
        if self.graphs:
            ways.append(f"Inductor's plan executed ({self.graphs} graph(s))")
        if self.bounded:
            ways.append(f"graphs op by op after the min-cut partition, an upper bound ({len(self.bounded)} graph(s))")
        if self.eager_frames:
            ways.append(f"frames run eagerly ({len(self.eager_frames)})")
        reason["op"] = "; ".join(ways)

    # ------------------------------------------------------------------ runtime hooks
    def gemm(self, lt: bool, args) -> None:
        tr = self.tracer
        if not tr.enabled or tr.paused:
            return
        self.rules._gemm_workspaces(tr, lt=lt)
        if any(isinstance(a, torch.Tensor) and a.dtype in (torch.float16, torch.bfloat16) for a in args):
            self.rules.used_half = True

    def autotune(self, kernel: _NoKernel, args) -> None:
        """The first run of a kernel with several configurations benchmarks each (`CachingAutotuner.bench`): the
        arguments it mutates are cloned for each try, and the benchmarker allocates its L2-flush buffer."""
        tr = self.tracer
        if not tr.enabled or tr.paused:
            return
        self.autotuned += 1
        l2 = l2_cache_bytes(self.gpu)
        clones = []
        for name, arg in zip(kernel.arg_names, args, strict=False):
            if name in kernel.mutated and isinstance(arg, torch.Tensor) and arg.device.type == "cuda":
                clones.append(torch.empty_strided(arg.size(), arg.stride(), dtype=arg.dtype, device=arg.device))
        # The clones of the warm-up call are freed before the flush buffer exists; the benchmark's calls clone again
        # while it lives: the most at once is the buffer and one set of clones.
        addr = tr.alloc(l2 // 4 * 4, "Inductor autotuning: L2-flush buffer") if l2 else 0
        del clones
        if addr:
            tr.free(addr, l2 // 4 * 4)
        self._describe()

    # ------------------------------------------------------------------ the compile environment
    @contextlib.contextmanager
    def _compiling(self, inductor: bool = True):
        """Compile internals run off the estimate's modes, on a GPU-less machine that looks like the target to
        Inductor: fake tensors that never touch the device, the device interface's and Triton's answers for the
        emulated GPU, no Triton compilation, no caches on disk, compile work in this process."""
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.utils._python_dispatch import _disable_current_modes

        with contextlib.ExitStack() as stack:
            saved: list[tuple[Any, str, Any]] = []

            def setattr_saved(obj, name, value):
                saved.append((obj, name, obj.__dict__.get(name, getattr(obj, name, None))))
                setattr(obj, name, value)

            stack.callback(lambda: [setattr(o, n, v) for o, n, v in reversed(saved)])
            setattr_saved(FakeTensorMode, "avoid_device_init", property(lambda _self: True))
            _patch_device_interface(setattr_saved)
            if inductor:
                self._patch_inductor(setattr_saved, stack)
            self._sdpa_kernel(stack)
            stack.enter_context(_disable_current_modes())
            yield

    def _sdpa_kernel(self, stack) -> None:
        """While dynamo and aot_autograd trace, `aten::scaled_dot_product_attention` picks the backend the target
        GPU would (`_rules.sdpa_backend`). Its CompositeImplicitAutograd kernel (C++) asks CUDA's
        `_fused_sdp_choice` stub directly, not the dispatcher, and without a GPU that answers math: the compiled
        graph then held the math path's attention matrices (nanoGPT on the H100: 384 MiB fp32 per layer, +88 %
        where the GPU ran cuDNN attention). This kernel, installed only for the compile, calls the chosen fused
        op as torch's does; math (and attention off CUDA, which the estimate does not size) goes through
        `_scaled_dot_product_attention_math` as torch's math case does."""
        from ._rules import _sdpa

        rules = self.rules

        def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
            out = None
            if getattr(query, "fake_device", query.device).type == "cuda":
                out = _sdpa(rules, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
            if out is None:
                if attn_mask is not None and attn_mask.dtype == torch.bool:
                    zero = torch.zeros((), dtype=query.dtype, device=query.device)
                    attn_mask = torch.where(attn_mask, zero, torch.full_like(zero, float("-inf")))
                out = torch.ops.aten._scaled_dot_product_attention_math(
                    query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
                )[0]
            return out

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": ours, for the compile
                lib = torch.library.Library("aten", "IMPL")
                lib.impl("scaled_dot_product_attention", sdpa, "CompositeImplicitAutograd")
        except Exception:  # noqa: BLE001 - then compiled attention takes torch's answer (math), said in a note
            self.tracer.note("torch.compile: the SDPA backend rule could not be installed for compiled graphs")
            return
        stack.callback(lib._destroy)

    def _patch_inductor(self, setattr_saved, stack) -> None:
        import torch._functorch.config as fconfig
        import torch._inductor.async_compile as async_compile
        import torch._inductor.codecache as codecache
        import torch._inductor.config as iconfig
        from torch._inductor.runtime import triton_helpers

        emulation = self
        _patch_triton_driver(setattr_saved, self.gpu)
        setattr_saved(triton_helpers, "set_driver_to_gpu", lambda: None)

        def triton(_self, kernel_name, source_code, *_a, **_k):
            configs, mutated, arg_names = _kernel_info(kernel_name, source_code)
            emulation.kernels += 1
            return _NoKernel(emulation, kernel_name, configs, mutated, arg_names)

        setattr_saved(async_compile.AsyncCompile, "triton", triton)

        def host_kernel(*_a, **_k):
            # A kernel of a host (CPU) graph, e.g. the optimizer's stacked step counters: its tensors are fake
            # (a real C++ kernel on them would write through fake data pointers); no host memory is estimated.
            emulation.kernels += 1
            return lambda *_args, **_kwargs: None

        for name in ("cpp", "cpp_pybinding", "cuda", "cutlass", "halide"):
            if hasattr(async_compile.AsyncCompile, name):
                setattr_saved(async_compile.AsyncCompile, name, lambda _self, *a, **k: host_kernel(*a, **k))
        from torch._inductor.constant_folding import ConstantFolder

        run_node = ConstantFolder.run_node

        def run_node_on_host(folder, node):
            with _HostForDevice():
                return run_node(folder, node)

        setattr_saved(ConstantFolder, "run_node", run_node_on_host)
        # Padding a misaligned GEMM is decided by benchmarking both on the GPU (`pad_mm._should_pad`): no GPU here,
        # the GEMM stays unpadded (a padded copy is at most the GEMM's operands, small where it happens).
        from torch._inductor.fx_passes import pad_mm

        setattr_saved(pad_mm, "_should_pad", lambda *_a, **_k: False)
        original_load = codecache.PyCodeCache.__dict__["load_by_key_path"].__func__

        def load_by_key_path(cls, *args, **kwargs):
            mod = original_load(cls, *args, **kwargs)
            if hasattr(mod, "empty_strided_cuda") and not getattr(mod, "_torchmem_emulated", False):
                emulation._emulate_wrapper(mod)
            return mod

        setattr_saved(codecache.PyCodeCache, "load_by_key_path", classmethod(load_by_key_path))
        stack.enter_context(
            iconfig.patch(
                {
                    "compile_threads": 1,
                    "fx_graph_cache": False,
                    "fx_graph_remote_cache": False,
                    "autotune_local_cache": False,
                    "autotune_remote_cache": False,
                    "max_autotune": False,
                    "max_autotune_gemm": False,
                    "max_autotune_pointwise": False,
                    "coordinate_descent_tuning": False,
                    "triton.cudagraphs": False,
                    "cpp_wrapper": False,
                }
            )
        )
        patches = {"enable_autograd_cache": False}
        if hasattr(fconfig, "force_non_lazy_backward_lowering"):
            # The backward is compiled with the forward, in this thread: under the same time bound.
            patches["force_non_lazy_backward_lowering"] = True
        stack.enter_context(fconfig.patch(patches))

    def _emulate_wrapper(self, mod) -> None:
        """The generated wrapper's device calls, on the emulated device (they call the CUDA allocator or the runtime
        directly, below the dispatcher)."""
        mod._torchmem_emulated = True

        def empty_strided_cuda(size, stride, dtype, *_a, **_k):
            return torch.empty_strided(size, stride, dtype=dtype, device="cuda")

        def reinterpret_tensor(t, size, stride, offset=0):
            return torch.as_strided(t, size, stride, offset)

        def empty_strided_cpu(size, stride, dtype, *_a, **_k):
            return torch.empty_strided(size, stride, dtype=dtype, device="cpu")

        mod.empty_strided_cuda = empty_strided_cuda
        mod.empty_strided_cpu = empty_strided_cpu
        mod.reinterpret_tensor = reinterpret_tensor
        mod.get_raw_stream = lambda *_a: 0
        if hasattr(mod, "copy_if_misaligned"):
            mod.copy_if_misaligned = lambda t: t
        if hasattr(mod, "extern_kernels"):
            mod.extern_kernels = _Extern(self, mod.extern_kernels)


class _HostForDevice(TorchDispatchMode):
    """Real (not fake) tensors made on "cuda" are made on the host: Inductor's constant folding computes a few real
    values while it compiles (`aten.scalar_tensor(0, device="cuda")` for uniform values), which on a GPU machine
    are tiny device tensors and here would need a driver. Fake tensors keep their device."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            if not any(isinstance(a, FakeTensor) for a in tree_flatten((args, kwargs))[0]):
                kwargs = {**kwargs, "device": torch.device("cpu")}
        return func(*args, **kwargs)


def _timed_out(e: BaseException) -> bool:
    seen = 0
    while e is not None and seen < 16:
        if isinstance(e, _CompileTimeout) or "_CompileTimeout" in str(e):
            return True
        e = getattr(e, "inner_exception", None) or e.__cause__ or e.__context__
        seen += 1
    return False


def _options(options: dict) -> dict:
    keep = dict(options)
    for k in ("max_autotune", "max_autotune_gemm", "triton.cudagraphs", "coordinate_descent_tuning"):
        keep.pop(k, None)
    return keep


def _reset_dynamo() -> None:
    """Forget compiled code of an earlier session (its kernels ran under another tracer). Nothing to forget where
    dynamo captured no graph: then `torch._dynamo.reset()` would only import Inductor (measured: 12 % of a GPT-2
    `generate` estimate's samples; FakeTensorMode imports dynamo, not Inductor)."""
    if "torch._dynamo" not in sys.modules or not _dynamo_compiled_anything():
        return
    try:
        torch._dynamo.reset()
    except Exception:  # noqa: BLE001 - nothing compiled yet
        pass


def _dynamo_compiled_anything() -> bool:
    """Whether dynamo may hold compiled code: it counted a captured graph, or Inductor's compiler is loaded."""
    counters = getattr(sys.modules.get("torch._dynamo.utils"), "counters", None)
    if counters is None:
        return True  # cannot tell: reset as before
    if any(counters.get("stats", {}).values()):
        return True
    return "torch._inductor.compile_fx" in sys.modules


def _patch_device_interface(setattr_saved) -> None:
    """Dynamo's CUDA device interface bound `torch.cuda`'s functions at import, before the emulated device's answers
    were installed: Inductor asks it for the device's properties, capability and streams."""
    from torch._dynamo.device_interface import CudaInterface

    cuda = torch.cuda
    for name, value in {
        "get_device_properties": lambda *_a, **_k: cuda.get_device_properties(0),
        "current_device": lambda: 0,
        "set_device": lambda *_a: None,
        "device_count": lambda: 1,
        "synchronize": lambda *_a: None,
        "is_bf16_supported": lambda *_a, **_k: cuda.get_device_capability()[0] >= 8,
        "get_raw_stream": lambda *_a: 0,
        "exchange_device": lambda *_a: 0,
        "maybe_exchange_device": lambda *_a: 0,
        "memory_allocated": lambda *_a, **_k: 0,
    }.items():
        setattr_saved(CudaInterface, name, staticmethod(value))
    compute = cuda.get_device_capability()
    setattr_saved(CudaInterface, "get_compute_capability", staticmethod(lambda *_a: compute[0] * 10 + compute[1]))


def _patch_triton_driver(setattr_saved, gpu) -> None:
    """Triton's active driver answers the emulated GPU's target (code generation asks it; no libcuda here)."""
    try:
        import importlib

        from triton.backends.compiler import GPUTarget

        driver_mod = importlib.import_module("triton.runtime.driver")
    except ImportError:
        return
    target = GPUTarget("cuda", gpu.major * 10 + gpu.minor, 32)

    class _Driver:
        def get_current_target(self):
            return target

        def get_current_device(self):
            return 0

        def get_current_stream(self, *_a):
            return 0

        def get_active_torch_device(self):
            return torch.device("cuda", 0)

        def get_device_interface(self):
            return torch.cuda

        def is_active(self):
            return True

    cfg = driver_mod.driver
    fake = _Driver()
    setattr_saved(cfg, "_active", fake)
    setattr_saved(cfg, "_default", fake)


@contextlib.contextmanager
def _deadline(seconds: float):
    """Raises _CompileTimeout in the main thread after `seconds` (SIGALRM; elsewhere no bound)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def on_alarm(_signum, _frame):
        raise _CompileTimeout

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
