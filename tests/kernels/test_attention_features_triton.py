"""Sliding windows and sinks in the Triton attention kernels (the one-pass prefill/mixed kernel
and the split-context decode with its combine step) against paged_attention_ref, on CUDA or
under TRITON_INTERPRET=1 with small grids. Blocks wholly before every window of a request hold
NaN: a kernel that loaded them (even masked after loading) would return NaN."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.attention.metadata import DeviceBatch
from gpu_worker.attention.triton_backend import TritonAttentionBackend
from kernels.paged_attention import paged_attention_ref
from kernels.triton.paged_attention import paged_attention
from kernels.triton.paged_decode import SPLIT_MIN_SEQ_LEN, num_partitions, paged_decode_split
from tests.kernels.paged_inputs import assert_close_to_reference, make_batch


def _sinks(num_heads: int, device) -> torch.Tensor:
    return (torch.randn(num_heads, generator=torch.Generator().manual_seed(9)) * 2).to(device)


def _poison_before_windows(batch: dict[str, torch.Tensor], window: int | None) -> None:
    """NaN into every block of a request that lies wholly before its first query's window."""
    if window is None:
        return
    block_size = batch["key_cache"].shape[1]
    qsl, seq_lens = batch["query_start_loc"].tolist(), batch["seq_lens"].tolist()
    for i, seq_len in enumerate(seq_lens):
        oldest = seq_len - (qsl[i + 1] - qsl[i]) - window + 1
        blocks = batch["block_table"][i, : max(oldest, 0) // block_size].long()
        batch["key_cache"][blocks] = float("nan")
        batch["value_cache"][blocks] = float("nan")


def _expected(batch, window, sinks):
    scale = batch["query"].shape[-1] ** -0.5
    return paged_attention_ref(
        **batch, scale=scale, out_dtype=torch.float32, sliding_window=window, sinks=sinks
    )


def check_one_pass(batch, window, sinks, **kwargs) -> None:
    expected = _expected(batch, window, sinks)
    _poison_before_windows(batch, window)
    scale = batch["query"].shape[-1] ** -0.5
    actual = paged_attention(**batch, scale=scale, sliding_window=window, sinks=sinks, **kwargs)
    assert not actual.isnan().any(), "a block before the window was loaded"
    assert_close_to_reference(actual, expected, batch["query"].dtype)


def check_split(batch, window, sinks, partition_size) -> None:
    expected = _expected(batch, window, sinks)
    _poison_before_windows(batch, window)
    scale = batch["query"].shape[-1] ** -0.5
    actual = paged_decode_split(
        **batch,
        scale=scale,
        max_seq_len=int(batch["seq_lens"].max()),
        partition_size=partition_size,
        sliding_window=window,
        sinks=sinks,
    )
    assert not actual.isnan().any(), "a block before the window was loaded"
    assert_close_to_reference(actual, expected, batch["query"].dtype)


# (cached context, new queries): decodes, a fresh prompt over several query tiles, chunks after
# a context; 85 the longest.
MIXED = [(40, 1), (0, 37), (3, 1), (21, 19), (70, 1), (55, 30)]


@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("window", [None, 1, 5, 17, 64, 85, 200])
def test_one_pass_mixed_step(window, with_sinks, device):
    batch = make_batch(MIXED, 2, 3, 64, 16, torch.float32, seed=1, device=device)
    sinks = _sinks(6, device) if with_sinks else None
    check_one_pass(batch, window, sinks, max_query_len=37)


@pytest.mark.parametrize("group", [1, 4])
def test_one_pass_long_prefill_tiles_start_at_their_own_window(group, device):
    # BLOCK_Q rows a tile: the later tiles of a 150-token prompt skip the blocks before them.
    batch = make_batch([(0, 150), (100, 60)], 1, group, 32, 16, torch.float32, device=device)
    check_one_pass(batch, 24, _sinks(group, device))


def test_one_pass_decodes_gqa(device):
    requests = [(15, 1), (47, 1), (130, 1), (2, 1)]
    batch = make_batch(requests, 2, 5, 64, 32, torch.float32, device=device)
    check_one_pass(batch, 33, _sinks(10, device), max_query_len=1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_pass_half_precision(dtype, device):
    batch = make_batch(MIXED, 2, 2, 64, 16, dtype, seed=4, device=device)
    check_one_pass(batch, 20, _sinks(4, device).to(dtype))


@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("window", [None, 3, 64, 100, 129, 400])
def test_split_decode(window, with_sinks, device):
    # Partitions of 64: windows within one partition, across two or three, and past the context.
    lens = [1, 63, 64, 65, 150, 300]
    batch = make_batch([(n - 1, 1) for n in lens], 1, 3, 64, 16, torch.float32, device=device)
    check_split(batch, window, _sinks(3, device) if with_sinks else None, partition_size=64)


def test_split_decode_sinks_count_once_over_many_partitions(device):
    batch = make_batch([(16 * 30, 1), (5, 1)], 2, 2, 32, 16, torch.float32, device=device)
    check_split(batch, None, _sinks(4, device), partition_size=16)


def test_split_grid_covers_the_window_not_the_context():
    assert num_partitions(32768, 512) == 64
    assert num_partitions(32768, 512, sliding_window=128) == 2  # may straddle one boundary
    assert num_partitions(32768, 512, sliding_window=512) == 2
    assert num_partitions(32768, 512, sliding_window=4096) == 9
    assert num_partitions(100, 512, sliding_window=4096) == 1


def test_kernels_refuse_sinks_of_another_size(device):
    batch = make_batch([(5, 2)], 1, 2, 64, 16, torch.float32, device=device)
    with pytest.raises(AssertionError, match="sinks must be"):
        paged_attention(**batch, scale=0.1, sinks=torch.zeros(3, device=device))
    with pytest.raises(AssertionError, match="sliding_window must be"):
        paged_attention(**batch, scale=0.1, sliding_window=0)


def _backend_step(batch) -> DeviceBatch:
    q_lens = (batch["query_start_loc"][1:] - batch["query_start_loc"][:-1]).tolist()
    return DeviceBatch(
        query_start_loc=batch["query_start_loc"],
        seq_lens=batch["seq_lens"],
        block_table=batch["block_table"],
        slot_mapping=torch.full((batch["query"].shape[0],), -1, dtype=torch.int64),
        max_query_len=max(q_lens),
        max_seq_len=int(batch["seq_lens"].max()),
    )


def test_backend_takes_one_pass_for_a_short_window_in_a_split_step(device, monkeypatch):
    """A step long enough to split: a layer with a short window runs the one-pass kernel (its
    reads are the window's), a full or long-window layer the split kernels; both exact."""
    import gpu_worker.attention.triton_backend as tb

    calls: list[str] = []
    for name in ("paged_attention", "paged_decode_split"):
        real = getattr(tb, name)
        monkeypatch.setattr(
            tb, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k)
        )
    seq_len = SPLIT_MIN_SEQ_LEN + 5
    batch = make_batch([(seq_len - 1, 1)], 1, 2, 16, 64, torch.float32, device=device)
    backend = TritonAttentionBackend()
    meta = _backend_step(batch)
    assert backend.uses_split_decode(meta, 1, batch["query"].device)
    kv_cache = torch.stack([batch["key_cache"], batch["value_cache"]])
    empty = batch["query"].new_empty(1, 1, 16)
    for window, kernel in ((None, "paged_decode_split"), (64, "paged_attention")):
        out = backend.forward(
            batch["query"],
            empty,
            empty,
            kv_cache,
            meta,
            0.25,
            **({} if window is None else {"sliding_window": window}),
        )
        expected = paged_attention_ref(**batch, scale=0.25, sliding_window=window)
        assert_close_to_reference(out, expected, torch.float32)
        assert calls[-1] == kernel
