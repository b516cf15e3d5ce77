"""kernels/triton/mla_attention.py: the Triton latent attention and latent write (TRITON_INTERPRET=1
on the CPU, tests/conftest.py) against the torch reference, on scattered blocks with decodes,
prefill and chunks after cached context; and the reference against dense attention."""

from __future__ import annotations

import pytest
import torch

from kernels.mla_attention import mla_attention_ref
from kernels.triton.mla_attention import mla_attention, write_latent

LATENT, ROPE = 32, 16


def _batch(cached, new, block_size, num_blocks, gen):
    seq_lens = torch.tensor([c + n for c, n in zip(cached, new, strict=True)], dtype=torch.int32)
    max_blocks = int(-(-int(seq_lens.max()) // block_size))
    order = torch.randperm(num_blocks, generator=gen)
    table = order[: len(new) * max_blocks].view(len(new), max_blocks).to(torch.int32)
    qsl = torch.tensor([0, *torch.cumsum(torch.tensor(new), 0).tolist()], dtype=torch.int32)
    return table, qsl, seq_lens


@pytest.mark.parametrize(
    ("cached", "new", "heads", "block_size"),
    [
        ([0], [1], 4, 16),  # one token
        ([5, 0, 12, 30], [1, 9, 1, 4], 4, 16),  # decodes and chunks after cached context
        ([3, 8, 40], [1, 1, 1], 20, 8),  # decodes only, heads over two head blocks
        ([0, 0], [37, 3], 2, 32),  # prefill over several query tiles
    ],
)
def test_kernel_equals_reference(cached, new, heads, block_size):
    gen = torch.Generator().manual_seed(sum(new) + heads)
    num_blocks = 24
    cache = torch.randn(num_blocks, block_size, LATENT + ROPE, generator=gen)
    table, qsl, seq_lens = _batch(cached, new, block_size, num_blocks, gen)
    q = torch.randn(sum(new), heads, LATENT + ROPE, generator=gen)
    scale = 0.2
    expected = mla_attention_ref(q, cache, table, qsl, seq_lens, scale, LATENT)
    got = mla_attention(q, cache, table, qsl, seq_lens, scale, LATENT, max(new))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # Without the host's max_query_len: the prefill tile size for every request.
    got = mla_attention(q, cache, table, qsl, seq_lens, scale, LATENT)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_odd_sizes_are_padded():
    """A latent and rope part that are not powers of two (V3's are 512 and 64)."""
    gen = torch.Generator().manual_seed(5)
    latent, rope = 24, 8
    cache = torch.randn(8, 16, latent + rope, generator=gen)
    table, qsl, seq_lens = _batch([6, 0], [1, 5], 16, 8, gen)
    q = torch.randn(6, 3, latent + rope, generator=gen)
    expected = mla_attention_ref(q, cache, table, qsl, seq_lens, 0.3, latent)
    got = mla_attention(q, cache, table, qsl, seq_lens, 0.3, latent, 5)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_reference_is_dense_causal_attention():
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(4, 8, LATENT + ROPE, generator=gen)
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    q = torch.randn(5, 2, LATENT + ROPE, generator=gen)
    out = mla_attention_ref(
        q, cache, table, torch.tensor([0, 5]), torch.tensor([20], dtype=torch.int32), 0.5, LATENT
    )
    ctx = torch.cat([cache[2], cache[0], cache[3][:4]])  # positions 0..19
    for t in range(5):
        seen = ctx[: 16 + t]
        probs = (q[t] @ seen.T * 0.5).softmax(-1)
        torch.testing.assert_close(out[t], probs @ seen[:, :LATENT])


def test_write_latent_skips_padded_slots():
    cache = torch.zeros(3, 4, LATENT + ROPE)
    latent = torch.randn(3, LATENT + ROPE)
    write_latent(latent, cache, torch.tensor([5, -1, 0]))
    flat = cache.view(-1, LATENT + ROPE)
    torch.testing.assert_close(flat[5], latent[0])
    torch.testing.assert_close(flat[0], latent[2])
    assert flat[torch.tensor([1, 2, 3, 4, 6, 7, 8, 9, 10, 11])].abs().sum() == 0
