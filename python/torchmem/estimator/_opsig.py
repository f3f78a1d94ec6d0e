"""Operator signatures for the workspace catalogue: what a CUDA library's choice inside an operator depends on
(the operator, its tensors' shapes, dtypes and memory layouts, its scalar arguments), as one string key with
the batch size kept apart, so a catalogue recorded at some batch sizes can answer for another.

Used on both sides of the catalogue, so they agree to the character: `scripts/gpu_op_workspaces.py` records
real CUDA calls under these keys on a GPU, and `_workspaces.py` looks the estimate's fake calls up by them.
This module imports nothing of torchmem (the recording script loads it by path on a machine without torchmem).
"""

from __future__ import annotations

# The operators whose CUDA kernels take library workspaces through the caching allocator that no fake kernel
# shows: cuDNN's convolution forward and backward (the engine heuristics pick an algorithm and its workspace
# per shape). Their first tensor argument's dim 0 is the batch.
CONV_OPS = ("aten.convolution.default", "aten.convolution_backward.default")


def layout_tag(t) -> str:
    """The layout: "c" (contiguous), "cl" (channels-last contiguous) or the strides."""
    if t.is_contiguous():
        return "c"
    import torch

    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
        return "cl"
    if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d):
        return "cl3d"
    return "s" + ",".join(str(s) for s in t.stride())


def _dtype(t) -> str:
    return str(t.dtype).replace("torch.", "")


def _tensor(t, *, batch_dim: bool) -> str:
    shape = list(t.shape)
    if batch_dim and shape:
        shape[0] = "N"
    return f"T[{','.join(str(s) for s in shape)}]{_dtype(t)}/{layout_tag(t)}"


def _value(v) -> str:
    if isinstance(v, (list, tuple)):
        return "(" + ",".join(_value(x) for x in v) + ")"
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "T" if v else "F"
    return str(v)


def signature(func_name: str, args, batched_args: tuple[int, ...] = (0, 1)) -> tuple[str, int] | None:
    """(key without the batch size, batch size) of a convolution call, or None for another operator.

    `batched_args`: positions of tensor arguments whose dim 0 is the batch (forward: the input; backward: the
    output gradient and the input). The weight never is."""
    if func_name not in CONV_OPS:
        return None
    import torch

    first = args[0]
    if not isinstance(first, torch.Tensor) or first.dim() < 3:
        return None
    batch = int(first.shape[0])
    parts = [func_name]
    batched = (0,) if func_name == CONV_OPS[0] else batched_args
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            parts.append(_tensor(a, batch_dim=i in batched))
        else:
            parts.append(_value(a))
    return "|".join(parts), batch
