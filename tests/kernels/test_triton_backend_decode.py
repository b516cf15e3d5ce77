"""TritonAttentionBackend sends decode-only steps that leave the device under-filled to the
split-context kernels, every other step to the one-pass kernel, and both give the reference's
attention."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.attention import triton_backend
from gpu_worker.attention.metadata import DeviceBatch
from gpu_worker.attention.triton_backend import TritonAttentionBackend
from kernels.paged_attention import paged_attention_ref
from kernels.triton.paged_decode import SPLIT_MIN_SEQ_LEN
from kernels.write_kv import write_kv_ref
from tests.kernels.paged_inputs import assert_close_to_reference, make_batch


def host_batch(num_seqs: int, seq_len: int, query_len: int = 1) -> DeviceBatch:
    """A DeviceBatch with the shapes and host values of num_seqs equal requests."""
    return DeviceBatch(
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32) * query_len,
        seq_lens=torch.full((num_seqs,), seq_len, dtype=torch.int32),
        block_table=torch.zeros(num_seqs, -(-seq_len // 16), dtype=torch.int32),
        slot_mapping=torch.zeros(num_seqs * query_len, dtype=torch.int64),
        max_query_len=query_len,
        max_seq_len=seq_len,
    )


def test_choice_follows_batch_and_context():
    choose = TritonAttentionBackend.uses_split_decode
    cpu = torch.device("cpu")  # decided as on a 132-SM GPU
    for num_kv_heads in (1, 2, 8):
        assert choose(host_batch(1, 32768), num_kv_heads, cpu)
        assert not choose(host_batch(64, 1024), num_kv_heads, cpu)
        assert not choose(host_batch(1, 32768, query_len=4), num_kv_heads, cpu)
    assert not choose(host_batch(64, 32768), 8, cpu)  # 512 programs fill 132 SMs


def decode_step(batch: dict[str, torch.Tensor], device: torch.device):
    """The step's new keys/values, a [2, N, bs, Hkv, D] cache and its DeviceBatch: the last
    query_len positions of each request are new."""
    key_cache, value_cache = batch["key_cache"], batch["value_cache"]
    block_size = key_cache.shape[1]
    starts, seq_lens = batch["query_start_loc"].tolist(), batch["seq_lens"].tolist()
    slots = []
    for i, seq_len in enumerate(seq_lens):
        for pos in range(seq_len - (starts[i + 1] - starts[i]), seq_len):
            block = int(batch["block_table"][i, pos // block_size])
            slots.append(block * block_size + pos % block_size)
    gen = torch.Generator().manual_seed(1)
    shape = (len(slots), *key_cache.shape[2:])
    k = torch.randn(shape, generator=gen).to(device)
    v = torch.randn(shape, generator=gen).to(device)
    meta = DeviceBatch(
        batch["query_start_loc"],
        batch["seq_lens"],
        batch["block_table"],
        torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(b - a for a, b in zip(starts, starts[1:])),
        max_seq_len=max(seq_lens),
    )
    return k, v, torch.stack([key_cache, value_cache]), meta


@pytest.mark.parametrize(
    "requests,split",
    [
        ([(SPLIT_MIN_SEQ_LEN + 99, 1), (700, 1)], True),
        ([(1000, 1), (700, 1)], False),  # short contexts
        ([(SPLIT_MIN_SEQ_LEN + 99, 1), (70, 5)], False),  # a prefill chunk in the step
    ],
)
def test_forward_takes_the_chosen_kernel(requests, split, monkeypatch, device):
    calls = []
    split_kernel = triton_backend.paged_decode_split
    monkeypatch.setattr(
        triton_backend,
        "paged_decode_split",
        lambda *a, **kw: calls.append(kw["max_seq_len"]) or split_kernel(*a, **kw),
    )
    batch = make_batch(requests, 1, 2, 64, 16, torch.float32, device=device)
    k, v, kv_cache, meta = decode_step(batch, device)
    expected_cache = kv_cache.clone()
    write_kv_ref(k, v, expected_cache[0], expected_cache[1], meta.slot_mapping)
    expected = paged_attention_ref(
        batch["query"],
        expected_cache[0],
        expected_cache[1],
        meta.block_table,
        meta.query_start_loc,
        meta.seq_lens,
        scale=0.125,
        out_dtype=torch.float32,
    )

    out = TritonAttentionBackend().forward(batch["query"], k, v, kv_cache, meta, scale=0.125)

    assert calls == ([meta.max_seq_len] if split else [])
    torch.testing.assert_close(kv_cache, expected_cache, rtol=0, atol=0)
    assert_close_to_reference(out, expected, torch.float32)
