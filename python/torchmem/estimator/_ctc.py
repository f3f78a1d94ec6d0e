"""The CTC loss (`torch.ctc_loss`, so `F.ctc_loss` and `nn.CTCLoss`) on the emulated device (issue 23).

torch has no shape-only kernel for `aten._use_cudnn_ctc_loss` and `aten._ctc_loss`: without a GPU the fake mode fell
back to the real kernel and the estimate stopped ("no fake (shape-only) kernel"), on every HF CTC fine-tune
(`Wav2Vec2ForCTC`), the one script of the corpus that was refused. Here `torch.ctc_loss` is replaced, on fake CUDA
log-probabilities, by what CUDA's kernels request, in their order (aten/src/ATen/native/cuda/LossCTC.cu, torch 2.11):

* forward (`ctc_loss_gpu_template`): the target lengths, the input lengths and the targets' batch offsets copied to
  the device (B int64 each; freed as the call returns), then `log_alpha` (B, T, 2L+1) and the negative log
  likelihood (B), both kept by the autograd graph with the log-probabilities (L: the longest target);
* backward (`ctc_loss_backward_gpu_template`): the three small copies again, `log_beta` (as `log_alpha`), the
  gradient (T, B, C) filled with -inf; for a "large" problem (2T + 24B/10 + 2C/10 > 450, the kernel's own rule) the
  probabilities written into the gradient, the blanks' subtrahend from a logsumexp of alpha + beta at the blank
  positions (B, T, L+1), the scaling by the output gradient, and with `zero_infinity` a `where` that makes a new
  gradient;
* the composite's reductions (`zero_infinity`'s `where`, the mean over the target lengths clamped at 1, or the sum);
  under autocast the log-probabilities cast to float32 (`ctc_loss` is on autocast's float32 list).

The longest target L comes from the target lengths where their values are known (a list, or a small CPU tensor made
from Python numbers: the fake mode's host values); for padded 2-D targets (B, S) it is S when they are not (the
kernel requires S >= L); for concatenated 1-D targets of unknown lengths it is N / B (equal lengths, what a padded
batch flattened by a mask gives), and the interval's upper bound takes N (one target holding all N labels).

cuDNN's CTC (int32 targets and lengths, blank 0, float32, cuDNN enabled) sizes a workspace only cuDNN can tell
(`cudnnGetCTCLossWorkspaceSize_v8`): the estimate refuses it, naming the call and the way around it.
"""

from __future__ import annotations

import math

import torch

from . import _device

_MEAN, _SUM = 1, 2  # torch.nn._reduction's enum: 0 none, 1 mean, 2 sum


def _is_fake_cuda(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) and t.device.type == "cuda"


def known_values(x) -> list[int] | None:
    """The integer values of `x` (a list, a tuple, an int, or a tensor whose values the fake mode keeps), or None."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(x, int):
        return [x]
    if isinstance(x, (list, tuple)) and all(isinstance(v, int) for v in x):
        return list(x)
    if isinstance(x, torch.Tensor):
        if not isinstance(x, FakeTensor):
            return [int(v) for v in x.reshape(-1).tolist()]
        constant = getattr(x, "constant", None)
        if constant is not None:
            return [int(v) for v in constant.reshape(-1).tolist()]
    return None


def longest_target(targets: torch.Tensor, target_lengths, batch: int) -> tuple[int, int, str]:
    """(point, upper, how) of the longest target: "known" (its lengths' values), "width" (padded 2-D targets), or
    "assumed equal" (concatenated targets of unknown lengths: N / B, at most N)."""
    values = known_values(target_lengths)
    if values:
        return max(values), max(values), "known"
    if targets.dim() == 2:
        return targets.size(1), targets.size(1), "width"
    n = targets.numel()
    return math.ceil(n / max(batch, 1)), n, "assumed equal"


def _uses_cudnn(log_probs, targets, input_lengths, target_lengths, blank: int) -> bool | None:
    """Whether `ctc_loss` takes cuDNN's kernel (`_use_cudnn_ctc_loss` and its Tensor variant, torch 2.11): True,
    False, or None where that depends on length values the estimate does not have."""
    if not (
        torch.backends.cudnn.enabled
        and blank == 0
        and targets.dim() == 1
        and log_probs.dim() == 3
        and log_probs.dtype == torch.float32
        and targets.dtype == torch.int32
        and targets.is_contiguous()
    ):
        return False
    tensors = isinstance(input_lengths, torch.Tensor) or isinstance(target_lengths, torch.Tensor)
    if tensors:
        if not all(isinstance(x, torch.Tensor) and x.dtype == torch.int32 for x in (input_lengths, target_lengths)):
            return False
    elif targets.device.type != "cpu":
        return False
    il, tl = known_values(input_lengths), known_values(target_lengths)
    if il is None or tl is None:
        return None
    if not tensors and any(i != log_probs.size(0) for i in il):
        return False
    return all(t < 256 and t <= i for t, i in zip(tl, il, strict=False))


class _CtcLoss(torch.autograd.Function):
    """`aten._ctc_loss` and its backward, as CUDA allocates them, on fake tensors."""

    @staticmethod
    def forward(ctx, spec, log_probs, targets):  # noqa: D401
        batch, longest = spec["batch"], spec["longest"]
        device = log_probs.device
        # target lengths, input lengths, batch offsets: host arrays copied to the device for the kernel
        small = [torch.empty(batch, dtype=torch.int64, device=device) for _ in range(3)]
        log_alpha = log_probs.new_empty((batch, log_probs.size(0), 2 * longest + 1))
        spec["mark_uncertain"](log_alpha)
        nll = log_probs.new_empty((batch,))
        while small:  # freed as the call returns, the last made first
            small.pop()
        ctx.spec = spec
        ctx.save_for_backward(log_probs, targets, nll, log_alpha)
        ctx.mark_non_differentiable(log_alpha)
        ctx.set_materialize_grads(False)  # as for `_ctc_loss`: no zeros for log_alpha's gradient
        return nll, log_alpha

    @staticmethod
    def backward(ctx, grad_out, _grad_log_alpha):
        if grad_out is None:
            return None, None, None
        log_probs, targets, nll, log_alpha = ctx.saved_tensors
        spec = ctx.spec
        batch, longest, blank = spec["batch"], spec["longest"], spec["blank"]
        device = log_probs.device
        small = [torch.empty(batch, dtype=torch.int64, device=device) for _ in range(3)]
        log_beta = torch.empty_like(log_alpha)
        spec["mark_uncertain"](log_beta)
        grad = torch.full_like(log_probs, -math.inf)
        t_len, n_labels = log_probs.size(0), log_probs.size(2)
        if (2 * t_len + (24 * batch) // 10 + (2 * n_labels) // 10) > 450:
            torch.exp(log_probs, out=grad)
            strided = (batch, log_alpha.size(1), longest + 1)
            strides = (log_alpha.stride(0), log_alpha.stride(1), log_alpha.stride(2) * 2)
            both = log_alpha.as_strided(strided, strides) + log_beta.as_strided(strided, strides)
            blanks = torch.logsumexp(both, 2, True)
            del both
            blanks = blanks.permute(1, 0, 2).add_(nll.view(1, batch, 1)).sub_(log_probs.narrow(2, blank, 1)).exp_()
            grad.narrow(2, blank, 1).sub_(blanks)
            del blanks
            grad *= grad_out.view(1, batch, 1)
            if spec["zero_infinity"]:
                grad = torch.where(nll.view(1, batch, 1) == math.inf, torch.zeros((), device=device), grad)
        del log_beta
        while small:
            small.pop()
        return None, grad, None


class CtcEmulation:
    """Installs the `torch.ctc_loss` replacement for fake CUDA log-probabilities."""

    def __init__(self, tracer) -> None:
        self.tracer = tracer
        self._original = None
        self.calls = 0

    def install(self) -> None:
        self._original = torch.ctc_loss
        torch.ctc_loss = self._wrap(self._original)

    def uninstall(self) -> None:
        if self._original is not None:
            torch.ctc_loss = self._original
            self._original = None

    def _wrap(self, original):
        emulation = self

        def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, reduction=_MEAN, zero_infinity=False):
            if not _is_fake_cuda(log_probs):
                return original(log_probs, targets, input_lengths, target_lengths, blank, reduction, zero_infinity)
            return emulation._ctc_loss(log_probs, targets, input_lengths, target_lengths, blank, reduction,
                                       zero_infinity)  # fmt: skip

        ctc_loss.__wrapped__ = original
        return ctc_loss

    def _ctc_loss(self, log_probs, targets, input_lengths, target_lengths, blank, reduction, zero_infinity):
        if torch.is_autocast_enabled("cuda") and log_probs.dtype in (torch.float16, torch.bfloat16):
            log_probs = log_probs.float()
        if _uses_cudnn(log_probs, targets, input_lengths, target_lengths, blank) is not False:
            raise _device.EstimateUnsupported(
                "the program calls torch.ctc_loss with int32 targets and lengths (blank 0, float32), where PyTorch "
                "may run cuDNN's CTC loss, whose workspace only cuDNN can size on a real GPU. For the estimate, pass "
                "int64 targets and lengths (PyTorch's own CTC kernel, the same loss) or call it under "
                "`torch.backends.cudnn.flags(enabled=False)`"
            )
        batched = log_probs.dim() == 3
        if not batched:  # unbatched: (T, C), targets (S,), scalar lengths
            log_probs = log_probs.unsqueeze(1)
            targets = targets.unsqueeze(0)
            if isinstance(target_lengths, torch.Tensor):
                target_lengths = target_lengths.reshape(1)
        batch = log_probs.size(1)
        longest, upper, how = longest_target(targets, target_lengths, batch)
        self.calls += 1
        spec = {
            "batch": batch,
            "longest": longest,
            "blank": blank,
            "zero_infinity": bool(zero_infinity),
            "mark_uncertain": self._marker(log_probs, longest, upper, how),
        }
        nll, _log_alpha = _CtcLoss.apply(spec, log_probs, targets)
        del _log_alpha
        res = nll
        if zero_infinity:
            res = torch.where(res == math.inf, torch.zeros((), device=res.device, dtype=res.dtype), res)
        if reduction == _MEAN:
            if isinstance(target_lengths, torch.Tensor):
                lengths = target_lengths.clamp_min(1)
            else:  # a list: `at::tensor(target_lengths, res.options()).clamp_min(1)`
                lengths = torch.tensor(known_values(target_lengths), device=res.device, dtype=res.dtype).clamp_min(1)
            res = (res / lengths).mean()
        elif reduction == _SUM:
            res = res.sum()
        elif not batched:
            res = res.squeeze(0)
        return res

    def _marker(self, log_probs, longest: int, upper: int, how: str):
        """Marks `log_alpha` / `log_beta` as as large as the upper bound's longest target, where it is not known."""
        tracer = self.tracer
        if upper <= longest:
            return lambda _t: None
        from ._rules import _program_site

        batch, t_len = log_probs.size(1), log_probs.size(0)
        per_target = batch * t_len * log_probs.element_size()
        reason = {
            "kind": "ctc_target_length",
            "what": f"CTC loss: the longest of {batch} concatenated targets ({how}: {longest} labels, at most {upper})",
            "op": "aten._ctc_loss",
            "shapes": f"log_probs {tuple(log_probs.shape)}",
            "site": _program_site(),
        }

        def mark(t: torch.Tensor) -> None:
            addr = tracer.addr_of(t)
            if addr:
                point = t.untyped_storage().nbytes()
                tracer.uncertain(reason, upper_bytes=per_target * (2 * upper + 1), addr=addr, point_bytes=point)

        return mark
