"""`copy.deepcopy` of a fake tensor that carries a real constant, under `torchmem estimate` (issue 23 item 1).

A tensor made from Python data (`torch.tensor(0)`: BatchNorm's `num_batches_tracked`; the `torch.tensor(default)`
of every Lightning `self.log` through torchmetrics' `add_state`) is a FakeTensor whose `__dict__` holds
`constant`, the REAL CPU tensor of that value. `Tensor.__deepcopy__` deep-copies the `__dict__`, so the constant's
storage was cloned while the fake mode was active, which fails ("Attempted to set the storage of a tensor on
device "meta" to a storage on different device "cpu""): every EMA of a CNN (`copy.deepcopy(model)`, timm's
ModelEmaV2/V3) and every LightningModule that logs stopped the estimate. The constant is copied outside the fake
mode first (`unset_fake_temporarily`) and put in the memo, so the tensor's own copy takes it from there.
"""

from __future__ import annotations

import copy
from typing import Any

_saved: list[Any] = []


def install() -> None:
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

    if _saved:
        return
    had = "__deepcopy__" in FakeTensor.__dict__
    original = FakeTensor.__deepcopy__

    def __deepcopy__(self, memo):
        const = self.__dict__.get("constant")
        if const is not None and id(const) not in memo:
            with unset_fake_temporarily():
                memo[id(const)] = copy.deepcopy(const)
        return original(self, memo)

    _saved.append((FakeTensor, had, original))
    FakeTensor.__deepcopy__ = __deepcopy__


def uninstall() -> None:
    while _saved:
        cls, had, original = _saved.pop()
        if had:
            cls.__deepcopy__ = original
        else:
            del cls.__deepcopy__
