"""The CTC emulation's two decisions that need no device (python/torchmem/estimator/_ctc.py): the longest target,
and whether torch would take cuDNN's kernel. Real CPU tensors stand for the program's; the estimate's end-to-end
runs are in tests/e2e/test_estimate_ctc.py."""

from __future__ import annotations

import torch
from torchmem.estimator._ctc import _uses_cudnn, longest_target


def test_the_longest_target_from_values_width_or_an_equal_split():
    concat = torch.zeros(60, dtype=torch.long)
    assert longest_target(concat, [10, 20, 30], 3) == (30, 30, "known")
    assert longest_target(concat, torch.tensor([10, 20, 30]), 3) == (30, 30, "known")
    assert longest_target(torch.zeros(3, 25, dtype=torch.long), None, 3) == (25, 25, "width")
    assert longest_target(concat, None, 3) == (20, 60, "assumed equal")
    assert longest_target(torch.zeros(61, dtype=torch.long), None, 3) == (21, 61, "assumed equal")


def test_cudnn_is_taken_only_as_torch_takes_it():
    lp = torch.zeros(50, 4, 20)
    int32 = torch.zeros(40, dtype=torch.int32)
    lengths32 = torch.full((4,), 10, dtype=torch.int32), torch.full((4,), 10, dtype=torch.int32)
    with torch.backends.cudnn.flags(enabled=True):
        # int32 targets and lengths: cuDNN when every target is under 256 and no longer than its input
        assert _uses_cudnn(lp, int32, *lengths32, 0) is True
        assert _uses_cudnn(lp, int32, torch.full((4,), 5, dtype=torch.int32), lengths32[1], 0) is False
        # int64 targets, another blank, 2-D targets, half log-probabilities: torch's own kernel
        assert _uses_cudnn(lp, int32.long(), *lengths32, 0) is False
        assert _uses_cudnn(lp, int32, *lengths32, 1) is False
        assert _uses_cudnn(lp, int32.view(4, 10), *lengths32, 0) is False
        assert _uses_cudnn(lp.half(), int32, *lengths32, 0) is False
        # lists of lengths: cuDNN only for targets on the CPU and inputs of full length
        assert _uses_cudnn(lp, int32, [50] * 4, [10] * 4, 0) is True
        assert _uses_cudnn(lp, int32, [49] + [50] * 3, [10] * 4, 0) is False
    with torch.backends.cudnn.flags(enabled=False):
        assert _uses_cudnn(lp, int32, *lengths32, 0) is False
