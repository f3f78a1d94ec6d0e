"""An independent count of what autograd saved, for the breakdown's activation checks (tests/unit/test_breakdown.py
on the CPU, tests/gpu/test_gpu_breakdown.py on the H200): it walks the graph instead of hooking saved tensors."""

from __future__ import annotations

import torch


def storage_key(t: torch.Tensor) -> tuple[int, int]:
    """A storage's identity: (device index, -1 on the CPU; data pointer)."""
    return (t.get_device(), t.untyped_storage().data_ptr())


def keys_of(tensors) -> set:
    return {storage_key(t) for t in tensors}


def graph_saved_bytes(output, exclude: set, device: torch.device | None = None) -> int:
    """Walks the graph from `output` (a tensor, or a Hugging Face ModelOutput: its logits) and adds every node's
    saved tensors (`_saved_*` attributes; `saved_tensors` of custom Functions) once per storage, on `device` (None:
    every device), minus the storage keys in `exclude`. A Python number in an op (`h * 0.01`) is saved as a 0-dim
    float64 CPU tensor without going through saved-tensor hooks (PyTorch skips them for wrapped numbers): left out."""
    if not isinstance(output, torch.Tensor):
        output = output.logits
    seen_nodes, seen, total = set(), set(exclude), 0
    stack = [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen_nodes:
            continue
        seen_nodes.add(node)
        values = [getattr(node, n) for n in dir(node) if n.startswith("_saved_")]
        if hasattr(node, "saved_tensors"):
            values.append(node.saved_tensors)
        for v in values:
            for t in v if isinstance(v, (tuple, list)) else [v]:
                if not isinstance(t, torch.Tensor) or (device is not None and t.device != device):
                    continue
                if t.dim() == 0 and t.dtype == torch.float64 and not t.is_cuda:
                    continue
                nbytes, key = t.untyped_storage().nbytes(), storage_key(t)
                if nbytes and key not in seen:
                    seen.add(key)
                    total += nbytes
        stack.extend(f for f, _ in node.next_functions)
    return total
