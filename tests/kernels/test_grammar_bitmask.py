"""The grammar-bitmask kernel against its torch reference."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_binding
from kernels.grammar_bitmask import apply_token_bitmask, apply_token_bitmask_torch


def _bitmask(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    words = (vocab + 31) // 32
    mask = torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, generator=g)
    mask[:, ::3] = 0  # all forbidden
    mask[:, 1::5] = -1  # all allowed
    return mask


@pytest.mark.parametrize(
    "num_logits, rows, vocab", [(7, 3, 100), (5, 5, 33), (4, 2, 32), (64, 17, 49152), (3, 1, 1)]
)
def test_kernel_matches_reference(num_logits, rows, vocab):
    if not cpu_binding.available():
        pytest.skip("no C compiler")
    logits = torch.randn(num_logits, vocab)
    bitmask = _bitmask(rows, vocab, seed=vocab)
    index = torch.randperm(num_logits)[:rows]
    expected, got = logits.clone(), logits.clone()
    apply_token_bitmask_torch(expected, bitmask, index)
    apply_token_bitmask(got, bitmask, index)
    assert torch.equal(expected, got)
    untouched = torch.ones(num_logits, dtype=torch.bool)
    untouched[index] = False
    assert torch.equal(got[untouched], logits[untouched])


def test_reference_allows_exactly_the_set_bits():
    logits = torch.zeros(2, 40)
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 0] = (1 << 3) | -(1 << 31)  # bit 31 is the sign bit
    bitmask[0, 1] = 1 << 4  # token 36
    apply_token_bitmask_torch(logits, bitmask, torch.tensor([1]))
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [3, 31, 36]
    assert torch.isfinite(logits[0]).all()


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="does not cover"):
        apply_token_bitmask(
            torch.zeros(2, 65), torch.zeros(1, 2, dtype=torch.int32), torch.tensor([0])
        )
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask(
            torch.zeros(2, 64), torch.zeros(1, 2, dtype=torch.int64), torch.tensor([0])
        )
