"""The Monitor itself does not look like the leak it warns about: 6,000 real in-process steps on the CPU, the Python
objects it holds flat from the first epoch to the third (moved from tests/unit/test_monitor.py, issue 27 item 5:
the unit layer keeps short tests)."""

from __future__ import annotations

import warnings

import torch
import torchmem
from torch import nn


def test_monitor_memory_stays_flat_over_many_steps():
    """The Monitor itself must not look like the leak it warns about: 3 epochs of 2,000 steps, no growth."""
    import tracemalloc

    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", torchmem.MemoryGrowthWarning)
        mon = torchmem.Monitor(model, opt, verbose=False)
        tracemalloc.start()
        sizes = []
        for _ in range(3):
            with mon.epoch():
                for _ in range(2000):
                    with mon.step():
                        model(x).sum().backward()
                        opt.step()
                        opt.zero_grad(set_to_none=True)
            sizes.append(tracemalloc.get_traced_memory()[0])
        tracemalloc.stop()
    mon.close()
    # Python objects the Monitor holds after epoch 1 vs after epoch 3: flat, not +8 markers per step.
    assert sizes[2] - sizes[0] < 256 * 1024, sizes
    assert mon.to_dict()["steps"] == 6000
