"""The C kernels (kernels/cpu/) against plain references: paged attention reading blocks in
place, fused SiLU*mul, residual add + RMSNorm, and in-place rotary embedding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.layers.rotary import RotaryEmbedding
from kernels import activation, argmax, cpu_binding, rms_norm
from kernels import linear as cpu_linear
from kernels.paged_attention import paged_attention_cpu, paged_attention_ref
from kernels.rotary import qk_norm_rotary_cpu_, rotary_cpu_
from kernels.write_kv import write_kv_cpu, write_kv_ref
from tests.kernels.library_env import library_env
from tests.kernels.test_paged_attention import make_batch

pytestmark = pytest.mark.skipif(not cpu_binding.available(), reason="no C compiler on this machine")


def _cpu_batch(requests, num_kv_heads, group, head_dim, block_size, seed=0):
    batch = make_batch(requests, num_kv_heads, group, head_dim, block_size, torch.float32, seed)
    return {name: t.cpu() for name, t in batch.items()}


def _cpu_layout(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """[N, bs, Hkv, D] caches -> the CPU kernels' keys [N, Hkv, D, bs] and values
    [N, Hkv, bs, D]."""
    return key_cache.permute(0, 2, 3, 1).contiguous(), value_cache.permute(0, 2, 1, 3).contiguous()


def _check_attention(batch, threads: int = 2) -> None:
    scale = batch["query"].shape[-1] ** -0.5
    expected = paged_attention_ref(**batch, scale=scale)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        actual = paged_attention_cpu(
            batch["query"],
            *_cpu_layout(batch["key_cache"], batch["value_cache"]),
            batch["block_table"],
            batch["query_start_loc"],
            batch["seq_lens"],
            scale,
        )
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(actual, expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_decodes_and_chunks_match_reference(head_dim: int, group: int) -> None:
    # (cached context, new queries): decodes at block boundaries, a fresh prompt spanning
    # several query tiles, and a chunk after a long context.
    requests = [(0, 1), (15, 1), (16, 1), (47, 1), (0, 70), (130, 37), (33, 2)]
    _check_attention(_cpu_batch(requests, 2, group, head_dim, 16))


@pytest.mark.parametrize("block_size", [32, 64])
def test_blocks_larger_than_the_chunk(block_size: int) -> None:
    requests = [(0, 1), (40, 1), (0, 45), (77, 19)]
    _check_attention(_cpu_batch(requests, 3, 3, 64, block_size, seed=1))


def test_single_thread_and_many_threads_agree() -> None:
    batch = _cpu_batch([(100, 1)] * 5 + [(0, 33)], 3, 3, 64, 16, seed=2)
    _check_attention(batch, threads=1)
    _check_attention(batch, threads=4)


def test_queries_may_be_a_strided_view() -> None:
    """The model hands q as a view into its fused qkv rows."""
    batch = _cpu_batch([(20, 1), (0, 9)], 3, 3, 64, 16, seed=3)
    q = batch["query"]
    wide = torch.randn(q.shape[0], q.shape[1] + 6, q.shape[2])
    wide[:, : q.shape[1]] = q
    batch["query"] = wide[:, : q.shape[1]]
    assert not batch["query"].is_contiguous()
    _check_attention(batch)


def test_attention_refuses_what_it_would_misread() -> None:
    batch = _cpu_batch([(0, 4)], 1, 1, 64, 16)
    args = [
        *_cpu_layout(batch["key_cache"], batch["value_cache"]),
        batch["block_table"],
        batch["query_start_loc"],
        batch["seq_lens"],
        0.125,
    ]
    for head_dim, block_size in ((32, 16), (64, 8)):
        small = _cpu_batch([(0, 4)], 1, 1, head_dim, block_size)
        with pytest.raises(ValueError, match="head_dim 64 or 128 and a block_size"):
            paged_attention_cpu(
                small["query"], *_cpu_layout(small["key_cache"], small["value_cache"]), *args[2:]
            )
    with pytest.raises(ValueError, match="float32"):
        paged_attention_cpu(batch["query"].double(), *args)
    with pytest.raises(ValueError, match="int32"):
        paged_attention_cpu(batch["query"], args[0], args[1], args[2].long(), *args[3:])
    heads = _cpu_batch([(0, 4)], 1, 3, 64, 16)
    query = heads["query"].transpose(1, 2).contiguous().transpose(1, 2)  # heads not packed
    with pytest.raises(ValueError, match="contiguous"):
        paged_attention_cpu(
            query,
            *_cpu_layout(heads["key_cache"], heads["value_cache"]),
            *[heads[k] for k in ("block_table", "query_start_loc", "seq_lens")],
            0.125,
        )
    with pytest.raises(ValueError, match="does not match caches"):
        paged_attention_cpu(batch["query"], batch["key_cache"], batch["value_cache"], *args[2:])


def test_write_kv_matches_reference_then_attention_reads_it() -> None:
    gen = torch.Generator().manual_seed(4)
    num_blocks, block_size, kv_heads, head_dim = 6, 16, 3, 64
    k, v = torch.randn(2, 40, kv_heads, head_dim, generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:40]
    slots[[3, 17]] = -1  # padding tokens are skipped
    key_ref = torch.zeros(num_blocks, block_size, kv_heads, head_dim)
    value_ref = torch.zeros_like(key_ref)
    write_kv_ref(k, v, key_ref, value_ref, slots)
    key_cache, value_cache = _cpu_layout(torch.zeros_like(key_ref), torch.zeros_like(value_ref))
    write_kv_cpu(k, v, key_cache, value_cache, slots)
    expected_k, expected_v = _cpu_layout(key_ref, value_ref)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)
    with pytest.raises(ValueError, match="int64"):
        write_kv_cpu(k, v, key_cache, value_cache, slots.int())


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_silu_and_mul(rows: int) -> None:
    y = torch.randn(2, rows, 2 * 96) * 4
    gate, up = y.chunk(2, dim=-1)
    torch.testing.assert_close(
        activation.silu_and_mul_cpu(y), F.silu(gate) * up, rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("rows", [1, 300])
def test_add_rms_norm_updates_residual_in_place(rows: int) -> None:
    x, residual, weight = torch.randn(rows, 576), torch.randn(rows, 576), torch.rand(576) + 0.5
    total = x + residual
    expected = F.rms_norm(total, (576,), weight, 1e-5)
    out, res = rms_norm.add_rms_norm_cpu(x, residual, weight, 1e-5)
    assert res is residual
    torch.testing.assert_close(residual, total)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="shapes differ"):
        rms_norm.add_rms_norm_cpu(x, residual[:, :100].contiguous(), weight, 1e-5)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_in_place_matches_rotate_half(head_dim: int) -> None:
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0)
    positions = torch.tensor([0, 1, 5, 1000, 4095, 17])
    cos, sin = rotary.cos_sin(positions, torch.float32)
    qkv = torch.randn(6, 12 * head_dim)  # 6 tokens; q and k heads are the first 8 of 12
    qk = qkv[:, : 8 * head_dim].view(6, 8, head_dim)
    expected = rotary.apply(qk, cos, sin)
    rest = qkv[:, 8 * head_dim :].clone()
    assert rotary_cpu_(qk, cos, sin) is qk
    torch.testing.assert_close(qk, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, 8 * head_dim :], rest)  # v untouched


@pytest.mark.parametrize("head_dim,tokens", [(64, 6), (128, 6), (64, 300)])
def test_qk_norm_rotary_matches_norms_then_rotation(head_dim: int, tokens: int) -> None:
    """Qwen3's per-head q/k norms and the rotation in one pass equal torch's rms_norm of q and of k
    (each with its weight) then rotate-half; v, after q and k in the row, is untouched."""
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0)
    positions = torch.randint(0, 4096, (tokens,))
    cos, sin = rotary.cos_sin(positions, torch.float32)
    qkv = torch.randn(tokens, 12 * head_dim)  # 6 q heads, 2 k heads, then 4 heads of v
    q_weight, k_weight = torch.rand(head_dim) + 0.5, torch.rand(head_dim) + 0.5
    qk = qkv[:, : 8 * head_dim].view(tokens, 8, head_dim)
    norm = torch.nn.functional.rms_norm
    expected = torch.cat(
        [
            rotary.apply(norm(qk[:, :6], (head_dim,), q_weight, 1e-6), cos, sin),
            rotary.apply(norm(qk[:, 6:], (head_dim,), k_weight, 1e-6), cos, sin),
        ],
        dim=1,
    )
    rest = qkv[:, 8 * head_dim :].clone()
    assert qk_norm_rotary_cpu_(qk, 6, q_weight, k_weight, 1e-6, cos, sin) is qk
    torch.testing.assert_close(qk, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, 8 * head_dim :], rest)
    with pytest.raises(ValueError, match="q_weight"):
        qk_norm_rotary_cpu_(qk, 6, q_weight[:-1], k_weight, 1e-6, cos, sin)


def test_disabled_by_environment() -> None:
    from gpu_worker.attention.select import attention_backend

    assert attention_backend(torch.device("cpu"), torch.float32, 64).name == "cpu"
    assert attention_backend(torch.device("cpu"), torch.float32, 80).name == "torch"
    assert attention_backend(torch.device("cpu"), torch.bfloat16, 64).name == "torch"
    assert attention_backend(torch.device("cpu"), torch.float32, 64, block_size=8).name == "torch"
    with library_env(ENGINE_CPU_KERNELS="0"):
        assert not cpu_binding.available()
        assert attention_backend(torch.device("cpu"), torch.float32, 64).name == "torch"
    assert cpu_binding.available()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 11, 12, 13, 29, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_matmul(rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 77, generator=gen)  # an odd K; N = 3 blocks of 32
    b = torch.randn(96, generator=gen) if bias else None
    x = torch.randn(rows, 77, generator=gen)
    blocked = cpu_linear.block_weight(weight)
    assert blocked.shape == (3, 77, 32)
    torch.testing.assert_close(
        cpu_linear.linear(x, blocked, b), F.linear(x, weight, b), rtol=1e-5, atol=1e-4
    )


def test_linear_takes_views_and_batches() -> None:
    weight = torch.randn(64, 40)
    blocked = cpu_linear.block_weight(weight)
    wide = torch.randn(7, 50)
    x = wide[:, 5:45]  # rows 50 apart
    torch.testing.assert_close(cpu_linear.linear(x, blocked), x @ weight.t(), rtol=1e-5, atol=1e-4)
    x3 = torch.randn(2, 3, 40)
    torch.testing.assert_close(
        cpu_linear.linear(x3, blocked), x3 @ weight.t(), rtol=1e-5, atol=1e-4
    )
    assert cpu_linear.linear(torch.empty(0, 40), blocked).shape == (0, 64)


def test_linear_writes_into_out() -> None:
    weight, x = torch.randn(64, 40), torch.randn(5, 40)
    blocked = cpu_linear.block_weight(weight)
    buffer = torch.full((8, 64), float("nan"))
    y = cpu_linear.linear(x, blocked, out=buffer[:5])
    assert y.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(buffer[:5], x @ weight.t(), rtol=1e-5, atol=1e-4)
    assert buffer[5:].isnan().all()
    with pytest.raises(ValueError, match="contiguous"):
        cpu_linear.linear(x, blocked, out=torch.empty(5, 128)[:, :64])
    with pytest.raises(ValueError, match="contiguous"):
        cpu_linear.linear(x, blocked, out=torch.empty(6, 64))


@pytest.mark.parametrize("cols", [1, 7, 512, 513, 49152])
def test_argmax_rows_matches_torch(cols: int) -> None:
    gen = torch.Generator().manual_seed(cols)
    wide = torch.randn(9, cols + 3, generator=gen)
    x = wide[:, 2 : cols + 2]  # rows cols + 3 apart
    x[1] = float("-inf")  # every logit masked: index 0, as torch
    x[2] = 1.5  # all equal: the first
    if cols > 600:
        x[3, 600] = x[3, 10] = x[3].max() + 1  # a tie across chunks: the earlier one
    x[4, cols - 1] = 1e30  # the last column
    torch.testing.assert_close(argmax.argmax_rows(x), x.argmax(-1), rtol=0, atol=0)
    assert argmax.argmax_rows(x[:0]).shape == (0,)
    with pytest.raises(ValueError, match="packed columns"):
        argmax.argmax_rows(wide.t())


@pytest.mark.parametrize("rows,threads", [(1, 1), (7, 2), (256, 2), (13, 3)])
def test_linear_argmax_is_linear_then_argmax(rows: int, threads: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(32 * 37, 24, generator=gen)
    x = torch.randn(rows, 24, generator=gen)
    blocked = cpu_linear.block_weight(weight)
    weight[100] = weight[900] = weight[5] * 0  # ties at 0 across thread ranges for some rows
    blocked = cpu_linear.block_weight(weight)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        logits = cpu_linear.linear(x, blocked)
        for vocab in (32 * 37, 1000, 33):
            want = logits[:, :vocab].argmax(-1)
            assert torch.equal(cpu_linear.linear_argmax(x, blocked, vocab), want), vocab
    finally:
        torch.set_num_threads(previous)
    with pytest.raises(ValueError, match="vocab"):
        cpu_linear.linear_argmax(x, blocked, 32 * 37 + 1)


def test_linear_refuses_what_it_would_misread() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_linear.block_weight(torch.randn(48, 16))
    blocked = cpu_linear.block_weight(torch.randn(64, 16))
    with pytest.raises(ValueError, match="does not match the blocked weight"):
        cpu_linear.linear(torch.randn(3, 17), blocked)
    with pytest.raises(ValueError, match="bias"):
        cpu_linear.linear(torch.randn(3, 16), blocked, torch.randn(63))
    with pytest.raises(ValueError, match="float32"):
        cpu_linear.linear(torch.randn(3, 16, dtype=torch.float64), blocked)


def test_model_linears_use_the_blocked_layout(tmp_path) -> None:
    """After loading, every fp32 CPU linear layer is re-laid for the kernel and its original
    weight freed (except the output projection tied to the embedding)."""
    from gpu_worker.layers.cpu_linear import BlockedLinearMethod, SwiGLUPairsLinearMethod
    from gpu_worker.layers.linear import Linear
    from tests.tiny_models import make_tiny_model
    from tests.worker.runner_utils import make_runner

    model_dir = make_tiny_model(tmp_path / "tiny", "llama", tie_word_embeddings=True)
    runner, _ = make_runner(model_dir, kv_cache_memory="4MiB")
    mlps = [layer.mlp for layer in runner.model.model.layers]
    fused = cpu_linear.fused_swiglu_pays()
    assert all(
        isinstance(mlp.gate_up_proj.method, SwiGLUPairsLinearMethod) == fused for mlp in mlps
    )
    gate_ups = {id(mlp.gate_up_proj) for mlp in mlps} if fused else set()
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    assert linears and all(
        isinstance(m.method, BlockedLinearMethod) for m in linears if id(m) not in gate_ups
    )
    assert all(m.weight is None for m in linears if m is not runner.model.lm_head)
    assert runner.model.lm_head.weight is runner.model.model.embed_tokens.weight


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 13, 64])
def test_swiglu_matches_silu_of_gate_times_up(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(128, 45, generator=gen) * 0.3  # I = 64: two pairs of blocks; odd K
    x = torch.randn(rows, 45, generator=gen)
    pairs = cpu_linear.block_weight_pairs(gate_up)
    assert pairs.shape == (2, 2, 45, 32)
    expected = F.silu(x @ gate_up[:64].t()) * (x @ gate_up[64:].t())
    torch.testing.assert_close(cpu_linear.swiglu(x, pairs), expected, rtol=1e-5, atol=1e-5)
    x3 = x.reshape(1, rows, 45)
    torch.testing.assert_close(cpu_linear.swiglu(x3, pairs), expected[None], rtol=1e-5, atol=1e-5)


def test_swiglu_refuses_what_it_would_misread() -> None:
    with pytest.raises(ValueError, match="twice a multiple of 32"):
        cpu_linear.block_weight_pairs(torch.randn(96, 8))
    pairs = cpu_linear.block_weight_pairs(torch.randn(64, 8))
    with pytest.raises(ValueError, match="does not match the paired weight"):
        cpu_linear.swiglu(torch.randn(2, 9), pairs)


def test_library_builds_into_the_engine_cache(tmp_path) -> None:
    """A fresh cache directory gets one built library; a second load reuses it."""
    from kernels import cpu_library

    with library_env(ENGINE_CACHE_DIR=str(tmp_path)):
        assert cpu_library.load() is not None
        built = list((tmp_path / "kernels").glob("libenginecpu-*.so"))
        assert len(built) == 1
        mtime = built[0].stat().st_mtime_ns
        cpu_library.load.cache_clear()
        assert cpu_library.load() is not None
        assert built[0].stat().st_mtime_ns == mtime


def test_loading_the_library_leaves_the_process_floats_alone() -> None:
    """-ffast-math at link time would add crtfastmath.o, whose constructor sets flush-to-zero for
    the whole process: a user's (and hypothesis's) subnormal floats would read as 0."""
    import subprocess
    import sys

    code = (
        "from kernels import cpu_library\nassert cpu_library.load() is not None\n"
        "print(repr(5e-324 * 1.0), repr(1e-310 / 2))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["5e-324", "5e-311"]


def test_a_failing_compiler_means_the_torch_path(tmp_path, caplog) -> None:
    from gpu_worker.attention.select import attention_backend
    from kernels import cpu_library

    # `false` exits 1 without compiling anything.
    with library_env(ENGINE_CACHE_DIR=str(tmp_path), CC="false"):
        with caplog.at_level("WARNING", logger="kernels.cpu_library"):
            assert cpu_library.load() is None
        assert "could not be built" in caplog.text
        assert attention_backend(torch.device("cpu"), torch.float32, 64).name == "torch"
