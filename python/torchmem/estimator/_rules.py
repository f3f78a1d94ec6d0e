"""CUDA semantics for the estimate's trace: the choices a real CUDA run makes that a fake trace on a machine
without a GPU would otherwise get wrong, and the memory CUDA libraries request outside any operator.

Every rule here was found by comparing the trace request by request with traces recorded on an H200 (torch
2.11; `bench/estimate/compare.py`, fixtures in `tests/fixtures/{sim,estimator}-h200/`):

* cuBLAS workspace: the first GEMM of a thread gets the handle's workspace through the caching allocator and
  keeps it for the process: 32 MiB on Hopper and later (`CUBLAS_WORKSPACE_CONFIG` default `:4096:8`), else
  `:4096:2:16:8` (8 MiB + 128 KiB); the first GEMM with a bias (addmm) also gets cuBLASLt's 1 MiB. Forward
  and backward run on different threads (the autograd engine's device thread), so a training step holds two.
* SDPA backend: without a GPU the fake CUDA stub answers "math" (the attention matrix materialised: +37 % on
  GPT-2). We make the choice CUDA makes for the target GPU (cuDNN attention first on sm90/sm100, then flash,
  memory-efficient, math, with each backend's dtype/shape limits) and call that backend's operator, so its
  outputs (output, logsumexp, RNG seed/offset) and its backward have CUDA's sizes and lifetimes. Under autocast,
  q/k/v are cast first, as autocast's CUDA kernel does (Llama's RoPE hands fp32 to a bf16 autocast region); a
  mask that needs a gradient (T5's position bias) rules out the memory-efficient kernel (math on the H200).
* Gradient accumulation in place, and CUDA's allocation order for dropout (mask first) and cuDNN attention
  (RNG seed/offset first), see the comments below.
* cuDNN attention backward: a transient workspace of 4 * B * H * S_q * (D + 1) + 256 bytes (the fp32 dQ
  accumulator and softmax statistics; exact on GPT-2 batch 4/8/16, Llama, ViT-B/16).
* cuDNN convolution workspaces: looked up in the catalogue recorded on the H200 (`_workspaces`), with the
  requests of the call in their recorded order.
* Layer norm of a non-contiguous input: CUDA's kernel copies it first (ConvNeXt's permuted LayerNorm).
"""

from __future__ import annotations

import math
import sys
import threading

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false as is_non_overlapping_and_dense
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.utils._pytree import tree_flatten

from ._opsig import CONV_OPS, signature
from ._workspaces import ConvCatalogue

_MIB = 2**20
_GEMM_OPS = {
    "aten.mm.default",
    "aten.addmm.default",
    "aten.bmm.default",
    "aten.baddbmm.default",
    "aten.addbmm.default",
    "aten._addmm_activation.default",
    "aten.addmv.default",
    "aten.mv.default",
    "aten._scaled_mm.default",
    "aten._int_mm.default",
}
# GEMMs with a bias epilogue go through cuBLASLt (its 1 MiB workspace comes with the first one; Llama's
# bias-free Linears never take it).
_LT_OPS = {"aten.addmm.default", "aten._addmm_activation.default"}
# Operators whose CUDA kernel allocates its outputs in another order than the meta kernel returns them.
_OUTPUT_ORDER = {"aten.native_dropout.default": (1, 0)}  # the mask, then the output
_LAYER_NORM_OPS = ("aten.native_layer_norm.default", "aten.native_layer_norm_backward.default")
# torch.nn.attention.SDPBackend values
_MATH, _FLASH, _EFFICIENT, _CUDNN = 0, 1, 2, 3
# Operators whose output size depends on values (a boolean mask's count): `masked_select`, `nonzero` and indexing
# with a boolean mask (`x[mask]`). Without values the estimate gives them their largest output: every element
# selected.
_SELECT_OPS = (torch.ops.aten.masked_select.default, torch.ops.aten.nonzero.default, torch.ops.aten.index.Tensor)
SELECT_NOTE = (
    "{op}: the output size depends on a mask's values, which an emulated device does not have; the estimate "
    "took the largest output (every element selected), so the peak may be over, never under, for these calls"
)


def _is_mask(ix) -> bool:
    return ix is not None and ix.dtype in (torch.bool, torch.uint8)


def cublas_workspace_bytes(major: int) -> int:
    if major >= 9:
        return 4096 * 1024 * 8
    return 4096 * 1024 * 2 + 16 * 1024 * 8


CUBLASLT_WORKSPACE_BYTES = 1 * _MIB


class CudaRules:
    """Per-session rule state (which threads already have a cuBLAS workspace, ...)."""

    def __init__(self, gpu) -> None:
        self.gpu = gpu
        self._cublas_threads: set[int] = set()
        self._cublaslt = False
        self._lock = threading.Lock()
        # What the run touched, for the context overhead NVML adds (cuDNN / half-precision kernels).
        self.used_half = False
        self.used_conv = False
        # cuDNN convolution workspaces from the recorded catalogue (`_workspaces`), and how each call was found.
        self._conv_catalogue = None
        self.conv_calls = {"exact": 0, "interpolated": 0, "unknown": 0}
        self.conv_unknown: dict[str, int] = {}

    # ------------------------------------------------------------------ dispatch-level rules
    def before(self, tracer, func, args, kwargs):
        # Under `torch.inference_mode()` the read arrives as `aten.item` (decomposed inside the fake mode, below
        # this one), elsewhere as `aten._local_scalar_dense`.
        if func is torch.ops.aten._local_scalar_dense.default or func is torch.ops.aten.item.default:
            try:
                return (func(*args, **kwargs),)  # the fake mode knows constants (CPU scalars such as `step`)
            except DataDependentOutputException:
                tracer.note("a tensor value was read (.item() or similar); the estimate used 0 for it")
                return (0,)
        if func in _SELECT_OPS:
            return self._select(tracer, func, args, kwargs)
        name = str(func)
        if name in CONV_OPS:
            return self._convolution(tracer, func, name, args, kwargs)
        if name in _LAYER_NORM_OPS and tracer.enabled:
            return self._layer_norm(tracer, func, name, args, kwargs)
        if name in _REDUCTION_OPS and tracer.enabled:
            replaced = self._reduction(tracer, func, name, args, kwargs)
            if replaced is not None:
                return replaced
        if name == "aten.add.Tensor" and self._accumulates_in_place(args, kwargs):
            return (args[0].add_(args[1]),)
        if name == "aten._scaled_dot_product_cudnn_attention_backward.default":
            q = args[1]
            b, h, s, d = q.shape
            size = 4 * b * h * s * (d + 1) + 256
            out = func(*args, **kwargs)
            for t in out:
                tracer.track(t, name)
            addr = tracer.alloc(size, "cuDNN attention backward workspace")
            tracer.free(addr, size)
            return (out,)
        elif name in _OUTPUT_ORDER:
            out = func(*args, **kwargs)
            for i in _OUTPUT_ORDER[name]:
                tracer.track(out[i], name)
            return (out,)
        elif name == "aten._scaled_dot_product_cudnn_attention.default":
            return (self._cudnn_attention(tracer, func, args, kwargs),)
        return None

    def _select(self, tracer, func, args, kwargs):
        """A value-dependent selection (see `_SELECT_OPS`): as is when its size is known (host values, no boolean
        index), else with every element selected."""
        if func is torch.ops.aten.index.Tensor and not any(_is_mask(ix) for ix in args[1]):
            return None
        try:
            return (func(*args, **kwargs),)
        except DynamicOutputShapeException:
            pass
        x = args[0]
        if func is torch.ops.aten.masked_select.default:
            n = torch.broadcast_shapes(x.shape, args[1].shape).numel()
            out = torch.empty(n, dtype=x.dtype, device=x.device)
        elif func is torch.ops.aten.nonzero.default:
            out = torch.empty((x.numel(), x.dim()), dtype=torch.long, device=x.device)
        else:  # x[mask]: a boolean index of k dimensions is k long indices of its element count
            indices = []
            for ix in args[1]:
                if _is_mask(ix):
                    indices += [torch.zeros(ix.numel(), dtype=torch.long, device=ix.device)] * ix.dim()
                else:
                    indices.append(ix)
            out = func(x, indices)
        tracer.note(SELECT_NOTE.format(op=func))
        if tracer.enabled:
            tracer.track(out, str(func))
        return (out,)

    def after(self, tracer, func, args, kwargs, out) -> None:
        # The output is allocated before the library call that gets the handle (and its workspace).
        name = str(func)
        if name in _GEMM_OPS:
            self._gemm_workspaces(tracer, lt=name in _LT_OPS)
            if args and isinstance(args[-1], torch.Tensor) and args[-1].dtype in (torch.float16, torch.bfloat16):
                self.used_half = True
        elif "convolution" in name:  # (transposed / other convolution operators than CONV_OPS)
            self.used_conv = True
        elif "cudnn_attention" in name:
            self.used_half = True

    def _reduction(self, tracer, func, name, args, kwargs):
        """A sum/mean whose CUDA kernel stages partial sums: its output, then the staging buffer and the
        semaphores, freed in the call (`reduction_staging_bytes`); None when the kernel needs none."""
        g = self.gpu
        dims = args[1] if len(args) > 1 else None
        sms, tps = g.multi_processor_count, max_threads_per_sm(g.major, g.minor)
        staging = reduction_staging_bytes(args[0], dims, sms, tps)
        if staging is None:
            upper = reduction_staging_upper(args[0], dims, sms, tps)
            if upper is None:
                return None
            # A layout the rule does not model: no staging in the point estimate, its bound in the upper one.
            out = func(*args, **kwargs)
            tracer.track(out, name)
            x = args[0]
            reason = {
                "kind": "reduction staging buffer",
                "what": "a sum/mean over a layout the staging rule does not model (the reduced dimensions innermost, "
                "or a strided input): CUDA's reduction kernel may stage partial sums in a global buffer (upper bound "
                "from its launch configuration's limits, `reduction_staging_upper`)",
                "op": name,
                "shapes": f"{list(x.shape)} {str(x.dtype).replace('torch.', '')} over dims {list(dims)}",
                "site": _program_site() or "(autograd engine)",
            }
            tracer.uncertain(reason, upper_bytes=upper)
            return (out,)
        out = func(*args, **kwargs)
        tracer.track(out, name)
        buf = tracer.alloc(staging[0], "reduction staging buffer")
        sem = tracer.alloc(staging[1], "reduction semaphores")
        tracer.free(sem, staging[1])
        tracer.free(buf, staging[0])
        return (out,)

    def _layer_norm(self, tracer, func, name, args, kwargs):
        """CUDA's layer norm makes its input contiguous first (`expect_contiguous`: a copy of a permuted input,
        ConvNeXt's channels-last LayerNorm), before the outputs; the backward copies the input first and the
        output gradient after its outputs. The copies are freed at the end of the call (H200 recordings)."""
        backward = name.endswith("backward.default")
        x = args[1] if backward else args[0]
        x_copy = self._copy_of(tracer, x)
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                tracer.track(t, name)
        if backward:
            dy_copy = self._copy_of(tracer, args[0])
            if dy_copy is not None:
                tracer.free(*dy_copy)
        if x_copy is not None:
            tracer.free(*x_copy)
        return (out,)

    @staticmethod
    def _copy_of(tracer, t):
        if not isinstance(t, torch.Tensor) or t.device.type != "cuda" or t.is_contiguous():
            return None
        size = t.numel() * t.element_size()
        return tracer.alloc(size, "contiguous copy of a layer norm input"), size

    def conv_catalogue(self) -> ConvCatalogue:
        if self._conv_catalogue is None:
            self._conv_catalogue = ConvCatalogue.load()
        return self._conv_catalogue

    def _convolution(self, tracer, func, name, args, kwargs):
        """A convolution with the requests cuDNN makes in the call on the H200 (outputs, workspaces, the bias
        gradient's reduction buffers), in their order; without a recording of its key, the outputs only. What
        the catalogue does not say exactly (an unrecorded key, an interpolated batch, another GPU) goes to the
        tracer's upper bound (`_conv_upper`)."""
        self.used_conv = True
        out = func(*args, **kwargs)
        if not tracer.enabled:
            return (out,)
        sig = signature(name, args) if not kwargs else None
        cat = self.conv_catalogue()
        found = cat.lookup(*sig) if sig is not None else None
        flat, _ = tree_flatten(out)
        site = self._conv_site(name, args)
        if found is None:
            self.conv_calls["unknown"] += 1
            if sig is not None:
                self.conv_unknown[sig[0]] = self.conv_unknown.get(sig[0], 0) + 1
            for t in flat:
                if isinstance(t, torch.Tensor):
                    tracer.track(t, name)
            self._conv_upper(tracer, name, sig, args, flat, site, "unrecorded convolution", None)
            return (out,)
        template, how = found
        self.conv_calls[how] += 1
        addrs: dict[int, tuple[int, int]] = {}
        largest: tuple[int, int] | None = None  # (addr, bytes) of the call's largest workspace
        for pos, (kind, a, _b) in enumerate(template):
            if kind == "o":  # ["o", output index, bytes]
                if a < len(flat) and isinstance(flat[a], torch.Tensor):
                    tracer.track(flat[a], name)
            elif kind == "t":  # ["t", bytes, 0]
                addrs[pos] = (tracer.alloc(a, "cuDNN convolution workspace"), a)
                if largest is None or a > largest[1]:
                    largest = addrs[pos]
            else:
                tracer.free(*addrs.pop(a))
        for t in flat:  # outputs the recording did not allocate (none on the H200); tracked once
            if isinstance(t, torch.Tensor):
                tracer.track(t, name)
        if self.gpu.name != cat.header["device_name"]:
            self._conv_upper(tracer, name, sig, args, flat, site, "cuDNN choice on another GPU", largest)
        elif how == "interpolated":
            upper = cat.interpolation_upper(*sig)
            self._conv_upper(tracer, name, sig, args, flat, site, "interpolated convolution workspace", largest, upper)
        return (out,)

    def _conv_upper(self, tracer, name, sig, args, flat, site, kind, largest, upper=None) -> None:
        """Records the most workspace this call could take (`ConvCatalogue.workspace_bound` unless `upper` is
        given) for the upper bound: the call's largest workspace widened, or one added after its outputs."""
        if upper is None:
            ratio, const = self.conv_catalogue().workspace_bound(name)
            io = sum(_nbytes(t) for t in list(args) + list(flat) if isinstance(t, torch.Tensor))
            upper = math.ceil(ratio * io) + const
        what = {
            "unrecorded convolution": "cuDNN workspace of a convolution not in the workspace catalogue (no workspace "
            "in the point estimate; the upper bound takes the catalogue's worst workspace for its size)",
            "cuDNN choice on another GPU": "cuDNN workspace recorded on the "
            f"{self.conv_catalogue().header['device_name']}; the {self.gpu.name}'s cuDNN may pick another "
            "algorithm (upper bound: the catalogue's worst workspace for its size)",
            "interpolated convolution workspace": "cuDNN workspace interpolated between recorded batch sizes (upper "
            "bound: the larger neighbour's workspace per sample times the batch)",
        }[kind]
        shapes = f"{sig[0].split('|', 1)[1]} at batch {sig[1]}" if sig is not None else _shapes_of(args)
        reason = {"kind": kind, "what": what, "op": name, "shapes": shapes, "site": site}
        if largest is not None:
            tracer.uncertain(reason, addr=largest[0], point_bytes=largest[1], upper_bytes=max(upper, largest[1]))
        else:
            tracer.uncertain(reason, upper_bytes=upper)

    def _conv_site(self, name: str, args) -> str:
        """The program's line that made the convolution (the first frame outside torch); a backward call (on
        the autograd engine's thread, no Python frame) names its forward's line."""
        key = None
        try:
            if name == CONV_OPS[0]:
                x, w = args[0], args[1]
                key = (tuple(x.shape[1:]), tuple(w.shape), x.dtype, tuple(args[3]), tuple(args[4]), args[8])
            else:
                x, w = args[1], args[2]
                key = (tuple(x.shape[1:]), tuple(w.shape), x.dtype, tuple(args[4]), tuple(args[5]), args[9])
        except (IndexError, TypeError, AttributeError):
            pass
        sites = self.__dict__.setdefault("_conv_sites", {})
        if name == CONV_OPS[0]:
            site = _program_site()
            if key is not None and site:
                sites[key] = site
            return site
        site = _program_site()
        if site:
            return site
        fwd = sites.get(key) if key is not None else None
        return f"backward of {fwd}" if fwd else "(autograd engine: a backward convolution)"

    def conv_summary(self) -> dict:
        cat = self.conv_catalogue() if any(self.conv_calls.values()) else None
        return {
            "calls": dict(self.conv_calls),
            "unknown_shapes": len(self.conv_unknown),
            "catalogue": None
            if cat is None
            else {
                "device": cat.header["device_name"],
                "torch": cat.header["torch_version"],
                "cudnn": cat.header["cudnn_version"],
                "excluded_archs": list(cat.exclude_archs),
                "unknown_keys": sorted(self.conv_unknown)[:20],
            },
        }

    def conv_notes(self) -> list[str]:
        c = self.conv_calls
        total = sum(c.values())
        if not total:
            return []
        cat = self.conv_catalogue()
        h = cat.header
        notes = []
        if c["unknown"]:
            notes.append(
                f"{c['unknown']} of {total} convolution calls ({len(self.conv_unknown)} shapes) are not in the cuDNN "
                f"workspace catalogue ({h['device_name']}, torch {h['torch_version']}): their workspaces are not in "
                "the point estimate; the upper bound takes the catalogue's worst workspace for their size "
                "(uncertainty, docs/estimator.md)"
            )
        if c["interpolated"]:
            notes.append(
                f"{c['interpolated']} of {total} convolution calls took cuDNN workspaces interpolated from other "
                "batch sizes of the same shape"
            )
        if self.gpu.name != h["device_name"]:
            notes.append(
                f"cuDNN workspaces are the {h['device_name']}'s (recorded there); the {self.gpu.name}'s may differ "
                "(the upper bound takes the catalogue's worst workspace for each call's size)"
            )
        return notes

    # The autograd engine sums two gradients for one input in place when it holds the only reference to the
    # first (InputBuffer::accumulate); it never does for a tensor subclass, and a FakeTensor is one, so a fake
    # trace would allocate a new buffer per accumulation (every residual connection) that CUDA never does.
    # An `add.Tensor` the engine itself calls (no Python frame on the stack), with grad mode off, two tensors of
    # one layout and the first referenced only by the engine (use count at the calibrated baseline) is one.
    accumulate_use_count: int | None = None

    def _accumulates_in_place(self, args, kwargs) -> bool:
        if len(args) != 2 or kwargs.get("alpha", 1) != 1 or torch.is_grad_enabled():
            return False
        a, b = args
        if not isinstance(b, torch.Tensor) or a is b or a.device.type != "cuda":
            return False
        if a.shape != b.shape or a.dtype != b.dtype or a.stride() != b.stride():
            return False
        if not a.is_contiguous() and not is_non_overlapping_and_dense(a):
            return False
        if not _called_from_cpp():
            return False
        base = CudaRules.accumulate_use_count
        if base is None:
            return False
        return a._use_count() <= base

    def _gemm_workspaces(self, tracer, *, lt: bool) -> None:
        tid = threading.get_ident()
        with self._lock:
            new_thread = tid not in self._cublas_threads
            self._cublas_threads.add(tid)
            first_lt = lt and not self._cublaslt
            self._cublaslt = self._cublaslt or lt
        if new_thread:
            tracer.alloc(cublas_workspace_bytes(self.gpu.major), "cuBLAS workspace (kept)")
        if first_lt:
            tracer.alloc(CUBLASLT_WORKSPACE_BYTES, "cuBLASLt workspace (kept)")

    def _cudnn_attention(self, tracer, func, args, kwargs):
        # Outputs (with the RNG seed/offset on the device) come from the fake kernel; cuDNN's forward also takes
        # a 256-byte workspace for the call.
        out = func(*args, **kwargs)
        name = str(func)
        for i in (6, 7, 0, 1, 2, 3, 4, 5, 8):  # seed and offset first, as the CUDA kernel allocates them
            if isinstance(out[i], torch.Tensor):
                tracer.track(out[i], name)
        addr = tracer.alloc(256, "cuDNN attention forward workspace")
        tracer.free(addr, 256)
        return out

    # ------------------------------------------------------------------ Python-level rules
    def sdpa_backend(self, q, k, v, attn_mask, dropout_p, is_causal, enable_gqa) -> int:
        """The backend CUDA's `_fused_sdp_choice` picks on the target GPU (torch 2.11 order on sm90/sm100:
        cuDNN, flash, efficient, math; elsewhere flash, efficient, math, cuDNN), honouring the sdpa_kernel /
        torch.backends.cuda switches."""
        import torch.backends.cuda as bc

        major = self.gpu.major
        dtype = q.dtype
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.is_nested:
            return _MATH
        d_qk, d_v = q.shape[-1], v.shape[-1]
        half = dtype in (torch.float16, torch.bfloat16)
        gqa = q.shape[1] != k.shape[1]
        if gqa and not enable_gqa:
            return _MATH

        def cudnn_ok() -> bool:
            return (
                bc.cudnn_sdp_enabled()
                and major >= 9
                and half
                and d_qk == d_v
                and d_qk % 8 == 0
                and d_qk <= 128
                and not gqa
                and attn_mask is None
            )

        def flash_ok() -> bool:
            return bc.flash_sdp_enabled() and major >= 8 and half and attn_mask is None and d_qk == d_v and d_qk <= 256

        def efficient_ok() -> bool:
            ok_dtype = dtype in (torch.float32, torch.float16) or (dtype == torch.bfloat16 and major >= 8)
            # A mask that needs a gradient (T5's position bias) sent the H200 to the math path.
            mask_grad = attn_mask is not None and attn_mask.requires_grad and torch.is_grad_enabled()
            return (
                bc.mem_efficient_sdp_enabled()
                and ok_dtype
                and not gqa
                and not mask_grad
                and d_qk % 8 == 0
                and d_v % 8 == 0
            )

        order = (_CUDNN, _FLASH, _EFFICIENT, _MATH) if major in (9, 10) else (_FLASH, _EFFICIENT, _MATH, _CUDNN)
        checks = {_CUDNN: cudnn_ok, _FLASH: flash_ok, _EFFICIENT: efficient_ok, _MATH: bc.math_sdp_enabled}
        for backend in order:
            if checks[backend]():
                return backend
        return _MATH


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _shapes_of(args) -> str:
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return ", ".join(f"{list(a.shape)} {str(a.dtype).replace('torch.', '')}" for a in tensors)


_SITE_SKIP = ("torchmem/estimator/", "/torch/", "/torchvision/", "/site-packages/", "/dist-packages/", "<frozen")


def _program_site() -> str:
    """`file:line (function)` of the innermost frame of the program itself (not torch, torchmem or a library)."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if not any(s in name for s in _SITE_SKIP):
            return f"{name}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return ""


_REDUCTION_OPS = ("aten.sum.dim_IntList", "aten.mean.dim")


def max_threads_per_sm(major: int, minor: int) -> int:
    """`maxThreadsPerMultiProcessor` of a compute capability (CUDA programming guide, table of technical
    specifications): 2048 on sm_80, sm_90, sm_100; 1536 on sm_86/87/89 and sm_120; 1024 on sm_75."""
    if (major, minor) == (7, 5):
        return 1024
    if (major == 8 and minor in (6, 7, 9)) or major >= 11:
        return 1536
    return 2048


def _last_pow2(n: int) -> int:
    return max(1, 1 << (n.bit_length() - 1)) if n > 0 else 1


def reduction_staging_bytes(x, dims, sms: int, threads_per_sm: int = 2048) -> tuple[int, int] | None:
    """(staging buffer, semaphores) in bytes that CUDA's reduction kernel (ATen `Reduce.cuh`) allocates for a
    sum/mean over the *outer* dimensions of a dense tensor (the kept dimensions innermost in memory: a Linear's
    bias gradient, a channels-last sum over N, H, W), when its launch configuration splits each output's
    reduction across blocks; None when it does not (or for another layout, not modelled).

    The launch configuration, as `setReduceConfig` computes it for this case: outputs vectorized by 4 (2, 1 when
    the count is not divisible), `block_width = min(pow2(outputs / vec), 32)`, `block_height = min(pow2(rows),
    (512 / vec) / block_width)`; each output's rows split over `ctas = max(min(ceil(target / grid_x), ceil(vpt /
    16)), ceil(vpt / 256))` blocks when `vpt = ceil(rows / block_height) >= 256`, target = SMs * threads_per_sm /
    threads per block. Buffer = acc bytes * outputs * ctas * block_width * vec; semaphores = 4 * grid_x. Checked
    against all 71 reductions recorded on the H200 (`tests/test_conv_workspaces.py`)."""
    import math

    if not isinstance(x, torch.Tensor) or x.device.type != "cuda" or x.dim() == 0 or dims is None:
        return None
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        return None
    nd = x.dim()
    red = sorted({d % nd for d in (dims if isinstance(dims, (list, tuple)) else [dims])})
    kept = [d for d in range(nd) if d not in red]
    if not red or not kept or not is_non_overlapping_and_dense(x):
        return None
    # Memory order (outermost first); the kept dims must be the innermost, contiguous among themselves.
    sizes, strides = x.shape, x.stride()
    order = sorted((d for d in range(nd) if sizes[d] != 1), key=lambda d: -strides[d])
    kept_order = [d for d in order if d in kept]
    if not kept_order or order[-len(kept_order) :] != kept_order:
        return None
    outputs = math.prod(sizes[d] for d in kept)
    rows = math.prod(sizes[d] for d in red)
    if outputs <= 1 or rows <= 1:
        return None
    acc = 8 if x.dtype == torch.float64 else 4
    vec = 4 if outputs % 4 == 0 else 2 if outputs % 2 == 0 else 1
    max_threads = 512 // vec
    dim0 = outputs // vec

    def pow2(n: int) -> int:
        return _last_pow2(n) if n < 512 else 512

    bw = min(pow2(dim0), 32)
    bh = min(pow2(rows), max_threads // bw)
    bw = min(pow2(dim0), max_threads // bh)
    if bh <= 1:
        return None
    grid_x = -(-outputs // (bw * vec))
    vpt = -(-rows // bh)
    target = sms * (threads_per_sm // (bw * bh))
    if vpt < 256 or grid_x > target:
        return None
    ctas = max(min(-(-target // grid_x), -(-vpt // 16)), -(-vpt // 256))
    if ctas <= 1:
        return None
    return acc * outputs * ctas * bw * vec, 4 * grid_x


# Below this many reduced values per output, no launch configuration of `Reduce.cuh` splits an output across
# blocks (values per thread = rows / block.x >= 256 is needed, block.x >= 32).
_SPLIT_MIN_ROWS = 256 * 32


def reduction_staging_upper(x, dims, sms: int, threads_per_sm: int = 2048) -> int | None:
    """An upper bound of the staging buffer + semaphores of a sum/mean that `reduction_staging_bytes` does not
    model (its layout: the reduced dimensions innermost, a full reduction, a strided input); None where that rule
    decides, or where no split across blocks is possible (fewer than `_SPLIT_MIN_ROWS` values per output).

    `Reduce.cuh` stages acc * outputs * ctas_per_output bytes (times block.x * vec when block.x does not reduce)
    and 4 bytes per grid column. A split needs grid.x <= target (SMs * threads_per_SM / threads per block, 32
    threads at least), so outputs * ctas <= 16 * target + numel / 8192 (ctas from the target, at most 16 outputs
    per block row, or ceil(values per thread / 256)): bound = acc * (SMs * threads_per_SM / 2 + numel / 8192 +
    outputs) + 4 * outputs."""
    import math

    if not isinstance(x, torch.Tensor) or x.device.type != "cuda" or x.dim() == 0 or dims is None:
        return None
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        return None
    if reduction_staging_bytes(x, dims, sms, threads_per_sm) is not None:
        return None
    nd = x.dim()
    red = sorted({d % nd for d in (dims if isinstance(dims, (list, tuple)) else [dims])}) or list(range(nd))
    kept = [d for d in range(nd) if d not in red]
    if kept and is_non_overlapping_and_dense(x):
        order = sorted((d for d in range(nd) if x.shape[d] != 1), key=lambda d: -x.stride()[d])
        kept_order = [d for d in order if d in kept]
        if kept_order and order[-len(kept_order) :] == kept_order:
            return None  # the modelled layout: `reduction_staging_bytes` said no split
    rows = math.prod(x.shape[d] for d in red)
    outputs = math.prod(x.shape[d] for d in kept)
    if rows < _SPLIT_MIN_ROWS:
        return None
    acc = 8 if x.dtype == torch.float64 else 4
    return acc * (sms * threads_per_sm // 2 + -(-x.numel() // 8192) + outputs) + 4 * outputs


def _called_from_cpp() -> bool:
    """True when no Python code outside torch's dispatch machinery is on this thread's stack (the caller is
    C++: the autograd engine)."""
    import sys

    f = sys._getframe(2)
    while f is not None:
        if not any(part in f.f_code.co_filename for part in _DISPATCH_FILES):
            return False
        f = f.f_back
    return True


_DISPATCH_FILES = (
    "torchmem/estimator/",
    "torch/utils/_python_dispatch",
    "torch/_subclasses/",
    "torch/_dynamo/",
    "torch/_compile.py",
    "torch/_ops.py",
)


def calibrate_accumulation(session_mode) -> None:
    """Measures the use count the engine's sole-owner accumulation shows in a dispatch (run once, in the
    session's modes): `w` used twice, the second gradient is summed into the first."""
    if CudaRules.accumulate_use_count is not None:
        return
    seen: list[int] = []
    original = CudaRules._accumulates_in_place

    def probe(self, args, kwargs):
        if len(args) == 2 and isinstance(args[1], torch.Tensor) and _called_from_cpp():
            seen.append(args[0]._use_count())
        return False

    CudaRules._accumulates_in_place = probe
    try:
        w = torch.ones(4, device="cuda", requires_grad=True)
        (w * 2 + w * 3).sum().backward()
    finally:
        CudaRules._accumulates_in_place = original
    CudaRules.accumulate_use_count = min(seen) if seen else None


def sdpa_wrapper(rules: CudaRules, original):
    """`F.scaled_dot_product_attention` routed to the backend CUDA would pick on the target GPU. Installed as
    the module attribute, not a TorchFunctionMode: the mode stack is per thread, and activation checkpointing
    recomputes the forward on the autograd engine's thread, where a mode would be missing (the recomputation
    then took the math path and saved other tensors than the forward: CheckpointError)."""

    def scaled_dot_product_attention(query, key, value, *args, **kwargs):
        if isinstance(query, torch.Tensor) and query.device.type == "cuda":
            if torch.is_autocast_enabled("cuda"):
                # SDPA is on autocast's lower-precision list: CUDA casts q, k, v (and a float mask) first, then
                # picks the backend for the cast dtype (Llama's RoPE hands it fp32 under bf16 autocast).
                dt = torch.get_autocast_dtype("cuda")

                def cast(t):
                    eligible = isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
                    return t.to(dt) if eligible and t.dtype != dt else t

                cq, ck, cv = cast(query), cast(key), cast(value)
                cargs = tuple(cast(a) for a in args)
                ckwargs = {k: cast(v) for k, v in kwargs.items()}
                with torch.autocast("cuda", enabled=False):
                    out = _sdpa(rules, cq, ck, cv, *cargs, **ckwargs)
            else:
                out = _sdpa(rules, query, key, value, *args, **kwargs)
            if out is not None:
                return out
        return original(query, key, value, *args, **kwargs)

    scaled_dot_product_attention.__doc__ = original.__doc__
    return scaled_dot_product_attention


def _sdpa(rules, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    backend = rules.sdpa_backend(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    aten = torch.ops.aten
    if backend == _CUDNN:
        return aten._scaled_dot_product_cudnn_attention(
            query, key, value, attn_mask, grad, dropout_p, is_causal, False, scale=scale
        )[0]
    if backend == _FLASH:
        d = query.shape[-1]
        pad = (8 - d % 8) % 8
        sc = scale if scale is not None else 1.0 / (d**0.5)
        if pad:
            query, key, value = (torch.nn.functional.pad(t, (0, pad)) for t in (query, key, value))
        out = aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False, scale=sc)[0]
        return out[..., :d] if pad else out
    if backend == _EFFICIENT:
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = torch.where(attn_mask, 0.0, float("-inf")).to(query.dtype)
        if attn_mask is not None:
            last = attn_mask.shape[-1]
            pad = (16 - last % 16) % 16
            if pad:
                attn_mask = torch.nn.functional.pad(attn_mask, (0, pad))[..., :last]
            attn_mask = attn_mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        return aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask, grad, dropout_p, is_causal, scale=scale
        )[0]
    return None
