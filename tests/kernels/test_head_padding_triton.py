"""Head sizes that are not powers of two (Phi-3-mini's 96, 80, 48) in the Triton kernels: the
attention kernels pad the head dimension to the next power of two with masked loads and stores.
On CUDA or under TRITON_INTERPRET=1 with small grids, against the torch references.

The query, the caches and the output are views into wider buffers whose extra columns hold NaN
(inputs) or a sentinel (output): a kernel that read a lane past head_dim would return NaN, and
one that stored past it would overwrite the sentinel."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.attention.triton_backend import TritonAttentionBackend
from gpu_worker.layers.rotary import RotaryEmbedding
from kernels.paged_attention import paged_attention_ref
from kernels.triton import rms_norm as triton_rms_norm
from kernels.triton import rotary as triton_rotary
from kernels.triton.paged_attention import head_pad, paged_attention
from kernels.triton.paged_decode import paged_decode_split
from kernels.triton.write_kv import write_kv
from kernels.write_kv import write_kv_ref
from tests.kernels.paged_inputs import assert_close_to_reference, make_batch
from tests.kernels.test_triton_backend_decode import decode_step

_EXTRA = 16  # columns past head_dim in every wider buffer
_SENTINEL = 7.0
CAP = 2.0


def _widened(t: torch.Tensor, fill: float) -> torch.Tensor:
    """t as a view [..., :D] of a buffer [..., D + _EXTRA] whose extra columns hold fill."""
    buf = torch.full((*t.shape[:-1], t.shape[-1] + _EXTRA), fill, dtype=t.dtype, device=t.device)
    buf[..., : t.shape[-1]] = t
    return buf[..., : t.shape[-1]]


def _padded_run(batch: dict[str, torch.Tensor], run) -> torch.Tensor:
    """run(**inputs, out=out) on NaN-padded views of the batch's query and caches, writing into
    a sentinel-padded output view; asserts the sentinel survived and returns the output."""
    inputs = dict(batch)
    for name in ("query", "key_cache", "value_cache"):
        inputs[name] = _widened(batch[name], float("nan"))
    out = _widened(torch.empty_like(batch["query"]), _SENTINEL)
    run(**inputs, out=out)
    wide = out.as_strided((*out.shape[:-1], out.shape[-1] + _EXTRA), out.stride())
    assert (wide[..., out.shape[-1] :] == _SENTINEL).all(), "a store went past head_dim"
    assert not out.isnan().any(), "a load went past head_dim"
    return out


def test_head_pad():
    assert [head_pad(d) for d in (8, 16, 48, 64, 80, 96, 128, 136, 256)] == [
        16,
        16,
        64,
        64,
        128,
        128,
        128,
        256,
        256,
    ]


# (cached context, new queries): decodes, a prompt over several query tiles, a chunk after a
# context.
MIXED = [(20, 1), (0, 21), (9, 7)]


@pytest.mark.parametrize(
    "head_dim,dtype,window,soft_cap",
    [
        (96, torch.float32, None, None),
        (80, torch.float32, None, None),
        (48, torch.float32, None, None),
        (96, torch.float32, 5, CAP),
        (96, torch.bfloat16, None, None),
    ],
)
def test_one_pass_odd_head_sizes(head_dim, dtype, window, soft_cap, device):
    batch = make_batch(MIXED, 2, 2, head_dim, 16, dtype, seed=head_dim, device=device)
    scale = head_dim**-0.5
    expected = paged_attention_ref(
        **batch,
        scale=scale,
        out_dtype=torch.float32,
        sliding_window=window,
        logits_soft_cap=soft_cap,
    )

    def run(**inputs):
        paged_attention(
            **inputs,
            scale=scale,
            max_query_len=21,
            sliding_window=window,
            logits_soft_cap=soft_cap,
        )

    actual = _padded_run(batch, run)
    assert_close_to_reference(actual, expected, dtype)


@pytest.mark.parametrize(
    "head_dim,window,soft_cap", [(96, None, None), (80, None, None), (96, 20, CAP)]
)
def test_split_decode_odd_head_sizes(head_dim, window, soft_cap, device):
    # Four 16-token partitions for the longest request: the combine step reads padded rows too.
    batch = make_batch([(60, 1), (9, 1), (33, 1)], 1, 3, head_dim, 16, torch.float32, seed=5)
    batch = {name: t.to(device) for name, t in batch.items()}
    scale = head_dim**-0.5
    expected = paged_attention_ref(
        **batch,
        scale=scale,
        out_dtype=torch.float32,
        sliding_window=window,
        logits_soft_cap=soft_cap,
    )

    def run(**inputs):
        paged_decode_split(
            **inputs,
            scale=scale,
            max_seq_len=61,
            partition_size=16,
            sliding_window=window,
            logits_soft_cap=soft_cap,
        )

    actual = _padded_run(batch, run)
    assert_close_to_reference(actual, expected, torch.float32)


@pytest.mark.parametrize("head_dim,dtype", [(96, torch.float32), (48, torch.bfloat16)])
def test_write_kv_odd_head_sizes(head_dim, dtype, device):
    gen = torch.Generator().manual_seed(head_dim)
    num_tokens, num_kv_heads, block_size, num_blocks = 9, 2, 16, 4
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    kv_cache = kv_cache.to(dtype).to(device)
    expected = kv_cache.clone()
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::4] = -1
    slots = slots.to(device)

    write_kv(key, value, kv_cache[0], kv_cache[1], slots)
    write_kv_ref(key, value, expected[0], expected[1], slots)

    torch.testing.assert_close(kv_cache, expected, rtol=0, atol=0)


def test_rotary_head_96_full_width(device):
    # Phi-3-mini: rotary_dim == head_dim == 96 (48 lanes a half: padded to 64 in the kernel).
    tokens, heads, head_dim = 4, 3, 96
    gen = torch.Generator().manual_seed(96)
    rope = RotaryEmbedding(head_dim, 64, 10000.0)
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    cos, sin = rope.cos_sin(positions, torch.float32)
    qk = torch.randn(tokens, heads, head_dim + _EXTRA, generator=gen)
    qk[..., head_dim:] = _SENTINEL
    qk = qk.to(device)
    expected = rope.apply(qk[..., :head_dim].float().cpu(), cos, sin)

    triton_rotary.rotary_(qk[..., :head_dim], cos.to(device), sin.to(device))

    torch.testing.assert_close(qk[..., :head_dim].cpu(), expected, rtol=1e-5, atol=1e-6)
    assert (qk[..., head_dim:] == _SENTINEL).all()


def test_rms_norm_per_head_96(device):
    # q/k norms per head over 96 lanes (padded to 128 in the kernel).
    tokens, heads, head_dim = 3, 4, 96
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, heads, head_dim, generator=gen).to(device)
    weight = torch.randn(head_dim, generator=gen).to(device)
    out = triton_rms_norm.rms_norm(x, weight, 1e-6)
    expected = torch.nn.functional.rms_norm(x.cpu(), (head_dim,), weight.cpu(), 1e-6)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-6)


def test_backend_forward_head_96(device):
    # The Triton backend's step at Phi-3-mini's head size: write_kv, then the one-pass kernel.
    batch = make_batch([(40, 1), (9, 6)], 2, 2, 96, 16, torch.float32, seed=2, device=device)
    k, v, kv_cache, meta = decode_step(batch, device)
    expected_cache = kv_cache.clone()
    write_kv_ref(k, v, expected_cache[0], expected_cache[1], meta.slot_mapping)
    scale = 96**-0.5
    expected = paged_attention_ref(
        batch["query"],
        expected_cache[0],
        expected_cache[1],
        meta.block_table,
        meta.query_start_loc,
        meta.seq_lens,
        scale=scale,
        out_dtype=torch.float32,
    )

    out = TritonAttentionBackend().forward(batch["query"], k, v, kv_cache, meta, scale=scale)

    torch.testing.assert_close(kv_cache, expected_cache, rtol=0, atol=0)
    assert_close_to_reference(out, expected, torch.float32)
