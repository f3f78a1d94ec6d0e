"""Allocator snapshots and Hugging Face (moved from tests/unit/test_snapshot.py, issue 27 item 5: the unit layer
does not import transformers): a real GPT-2 with gradient checkpointing turned on is found as the hazard that makes
`capture(stacks="python")` unsafe, and turned off is not."""

from __future__ import annotations

import pytest
from torchmem import snapshot as tsnap


def test_hugging_face_gradient_checkpointing_is_detected() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(cfg)
    assert tsnap.checkpointing_hazard() is None
    model.gradient_checkpointing_enable()
    found = tsnap.checkpointing_hazard()
    assert found is not None and found.startswith("GPT2")
    ctx, _, warning = tsnap._safe_context("python", "all")
    assert ctx is None and "gradient checkpointing" in warning
    model.gradient_checkpointing_disable()
    assert tsnap.checkpointing_hazard() is None
