"""paged_decode_split (split-context decode kernels) must match paged_attention_ref, and the
choice between it and the one-pass kernel must follow host values only."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_attention import paged_attention_ref
from kernels.triton.paged_decode import (
    PARTITION_SIZE,
    SPLIT_MIN_SEQ_LEN,
    num_partitions,
    paged_decode_split,
    use_split_decode,
)
from tests.kernels.paged_inputs import assert_close_to_reference, cuda_only, make_batch


def check(batch: dict[str, torch.Tensor], partition_size: int | None = None) -> None:
    scale = batch["query"].shape[-1] ** -0.5
    expected = paged_attention_ref(**batch, scale=scale, out_dtype=torch.float32)
    max_seq_len = int(batch["seq_lens"].max())
    actual = paged_decode_split(
        **batch, scale=scale, max_seq_len=max_seq_len, partition_size=partition_size
    )
    assert_close_to_reference(actual, expected, batch["query"].dtype)


def decode(seq_lens: list[int]) -> list[tuple[int, int]]:
    """Decode requests: seq_len - 1 cached tokens and one new query token each."""
    return [(n - 1, 1) for n in seq_lens]


@pytest.mark.parametrize("group", [1, 3, 8])
def test_partition_boundaries_gqa(group, device):
    # Small partitions so that lengths at, before and after partition edges stay cheap here.
    lens = [1, 63, 64, 65, 150]
    check(
        make_batch(decode(lens), 1, group, 64, 16, torch.float32, seed=group, device=device),
        partition_size=64,
    )


@pytest.mark.parametrize("block_size", [16, 64])
def test_partition_of_one_block(block_size, device):
    # A partition as small as a block: one key tile per program, many partitions to combine.
    lens = [block_size * 40 + 3, 5]
    check(
        make_batch(decode(lens), 1, 2, 32, block_size, torch.float32, device=device),
        partition_size=block_size,
    )


@pytest.mark.parametrize(
    "seq_lens,num_kv_heads,group,block_size",
    [
        ([32768], 2, 1, 16),  # partitions divide the context evenly
        ([30001, 8192], 1, 3, 16),  # uneven last partition, two lengths, padded group
        ([8191, 16385], 1, 8, 64),  # a token short of a partition edge, a token past one
    ],
)
def test_long_contexts(seq_lens, num_kv_heads, group, block_size, device):
    # 4096-token partitions keep the interpreter's grid at 8 programs per sequence and kv head.
    batch = make_batch(
        decode(seq_lens),
        num_kv_heads,
        group,
        64,
        block_size,
        torch.float32,
        seed=len(seq_lens),
        device=device,
    )
    check(batch, partition_size=4096)


def test_padding_rows_and_max_seq_len_above_every_length(device):
    # A request with no query token (a padded batch row) and a host max_seq_len that overstates
    # the longest sequence: the extra partitions must write nothing and be read by no one.
    batch = make_batch([(90, 1), (40, 0), (7, 1)], 1, 2, 64, 16, torch.float32, device=device)
    scale = 0.125
    expected = paged_attention_ref(**batch, scale=scale, out_dtype=torch.float32)
    out = torch.full_like(batch["query"], float("nan"))
    result = paged_decode_split(**batch, scale=scale, max_seq_len=400, out=out, partition_size=32)
    assert result is out
    assert_close_to_reference(out, expected, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype, device):
    # On the CPU the interpreter upcasts 16-bit operands; CUDA runs the 16-bit tl.dot.
    check(make_batch(decode([300, 77]), 2, 4, 128, 16, dtype, device=device), partition_size=128)


@cuda_only(
    "16-bit tl.dot on tensor cores at the default partition size, too large for the interpreter"
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_default_partitions_on_cuda(dtype, device):
    lens = [16384, 9000, 513, 512, 1, 2049, 12000, 4097]
    check(make_batch(decode(lens), 8, 4, 128, 16, dtype, seed=5, device=device))


def test_num_partitions_from_host_length():
    assert num_partitions(1, 512) == 1
    assert num_partitions(512, 512) == 1
    assert num_partitions(513, 512) == 2
    assert num_partitions(32768) == 32768 // PARTITION_SIZE
    assert num_partitions(0) == 1


def test_rejects_partition_smaller_than_block(device):
    batch = make_batch(decode([40]), 1, 1, 64, 32, torch.float32, device=device)
    with pytest.raises(AssertionError, match="partition_size must be a power of two"):
        paged_decode_split(**batch, scale=0.1, max_seq_len=40, partition_size=16)


H100_SMS = 132


def test_split_choice():
    # Batch 1 at 32k: 8 programs for 132 SMs in the one-pass kernel, so split.
    assert use_split_decode(1, 1, 8, 32768, H100_SMS)
    # Batch 64 at 1k: short contexts, one pass.
    assert not use_split_decode(1, 64, 8, 1024, H100_SMS)
    assert not use_split_decode(1, 64, 1, 1024, H100_SMS)
    # Enough (sequence, kv head) programs to fill the device: one pass even at 32k.
    assert not use_split_decode(1, 64, 8, 32768, H100_SMS)
    assert use_split_decode(1, 16, 8, 32768, H100_SMS)
    # Any prefill token in the step: one pass.
    assert not use_split_decode(2, 1, 8, 32768, H100_SMS)
    assert use_split_decode(1, 1, 1, SPLIT_MIN_SEQ_LEN, H100_SMS)
    assert not use_split_decode(1, 1, 1, SPLIT_MIN_SEQ_LEN - 1, H100_SMS)
