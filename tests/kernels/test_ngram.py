"""kernels.ngram: the torch ops, the C kernel and the Triton kernel (under the interpreter without a
GPU) against a plain Python reference of vLLM's prompt-lookup rule."""

from __future__ import annotations

import random

import pytest
import torch

from kernels import cpu_binding
from kernels.ngram import ngram_propose_cpu, ngram_propose_for, ngram_propose_torch
from kernels.triton.ngram import ngram_propose_triton
from tests.kernels.paged_inputs import DEVICE


def reference(tokens: list[int], min_n: int, max_n: int, limit: int) -> list[int]:
    """The tokens after the earliest earlier occurrence of the longest suffix n-gram (n from
    max_n down to min_n); an occurrence must leave at least one token after it."""
    total = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        suffix = tokens[total - n :]
        for s in range(total - n):  # s + n <= total - 1
            if tokens[s : s + n] == suffix:
                return tokens[s + n : s + n + max(limit, 0)]
    return []


def test_reference_follows_vllm_rule() -> None:
    # vLLM's own example (ngram_proposer.py): [4, 2, 3] misses, [2, 3] matches at the start.
    assert reference([1, 2, 3, 4, 2, 3], 2, 3, 4) == [4, 2, 3]
    # The longest n wins over an earlier, shorter match; among equal n, the earliest.
    seq = [1, 2, 9, 3, 1, 2, 8, 3, 1, 2]
    assert reference(seq, 2, 3, 2) == [8, 3]
    assert reference(seq, 1, 2, 2) == [9, 3]
    assert reference([7, 7, 7, 7], 1, 3, 5) == [7]  # overlapping the suffix itself


IMPLEMENTATIONS = [
    pytest.param(ngram_propose_torch, "cpu", id="torch"),
    pytest.param(
        ngram_propose_cpu,
        "cpu",
        id="c",
        marks=pytest.mark.skipif(not cpu_binding.available(), reason="no C compiler"),
    ),
    pytest.param(ngram_propose_triton, DEVICE, id="triton"),
]


def _run(fn, device: str, rows: list[list[int]], limits: list[int], min_n: int, max_n: int, k: int):
    """Rows planted at shuffled slots of a table whose unknown columns hold random tokens (a
    kernel reading past num_tokens would pick them up)."""
    gen = torch.Generator().manual_seed(len(rows))
    width = max(len(r) for r in rows) + 8
    table = torch.randint(0, 5, (len(rows) + 3, width), generator=gen)
    slots = torch.randperm(len(rows) + 3, generator=gen)[: len(rows)]
    for slot, r in zip(slots.tolist(), rows):
        table[slot, : len(r)] = torch.tensor(r, dtype=torch.int64)
    num_tokens = torch.tensor([len(r) for r in rows])
    out = torch.full((len(rows), k), 12345, dtype=torch.int64)
    tensors = [t.to(device) for t in (table, slots, num_tokens, torch.tensor(limits), out)]
    fn(*tensors[:4], min_n, max_n, tensors[4])
    return tensors[4].cpu().tolist()


def _expected(rows, limits, min_n, max_n, k):
    out = []
    for r, limit in zip(rows, limits):
        drafts = reference(r, min_n, max_n, min(limit, k))
        out.append(drafts + [-1] * (k - len(drafts)))
    return out


EDGE_CASES = [
    # (tokens, limit, min_n, max_n, k)
    ([5], 4, 1, 3, 4),  # one token: nothing earlier
    ([5, 6], 4, 3, 3, 4),  # shorter than n
    ([1, 2, 3, 4, 5, 6], 4, 1, 3, 4),  # no match
    ([5, 6, 7, 5, 6], 5, 2, 2, 5),  # match near the end: 3 tokens, fewer than k
    ([5, 6, 7, 5, 6], 0, 2, 2, 5),  # max_drafts 0
    ([5, 6, 7, 5, 6], -3, 2, 2, 5),  # past max_model_len
    ([5, 6, 7, 5, 6], 9, 2, 2, 2),  # limit above k
    ([1, 2, 9, 3, 1, 2, 8, 3, 1, 2], 3, 2, 3, 3),  # longest n wins
    ([1, 2, 9, 3, 1, 2, 8, 3, 1, 2], 3, 1, 2, 3),  # equal n: earliest wins
    ([7, 7, 7, 7], 5, 1, 3, 5),  # occurrence overlapping the suffix
    ([3, 3], 2, 1, 1, 2),  # shortest possible match
    ([4, 1, 2, 3, 1, 2, 3], 4, 3, 5, 4),  # n = 3 < max_n overlapping nothing
]


@pytest.mark.parametrize("fn,device", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", range(len(EDGE_CASES)))
def test_edge_cases(fn, device, case: int) -> None:
    tokens, limit, min_n, max_n, k = EDGE_CASES[case]
    got = _run(fn, device, [tokens], [limit], min_n, max_n, k)
    assert got == _expected([tokens], [limit], min_n, max_n, k)


def _random_rows(num: int, seed: int, max_len: int) -> tuple[list[list[int]], list[int]]:
    """Random rows with planted repeats: some from a tiny vocabulary (matches everywhere), some
    from a large one with a copied span ending the row (one long match), some with none."""
    rng = random.Random(seed)
    rows, limits = [], []
    for i in range(num):
        length = rng.randint(1, max_len)
        kind = i % 3
        if kind == 0:
            row = [rng.randrange(4) for _ in range(length)]
        else:
            row = [rng.randrange(50000) for _ in range(length)]
            if kind == 1 and length > 4:
                span = rng.randint(1, min(8, length // 2))
                at = rng.randrange(length - span)
                row += row[at : at + span]
        rows.append(row)
        limits.append(rng.choice([0, 1, 3, 5, 7]))
    return rows, limits


@pytest.mark.parametrize("fn,device", IMPLEMENTATIONS)
@pytest.mark.parametrize("num_reqs", [1, 64])
@pytest.mark.parametrize("min_n,max_n,k", [(1, 3, 5), (2, 5, 4), (3, 3, 7)])
def test_random_rows(fn, device, num_reqs: int, min_n: int, max_n: int, k: int) -> None:
    for seed in range(3 if num_reqs == 1 else 1):
        rows, limits = _random_rows(num_reqs, seed * 100 + min_n + max_n + k, 300)
        got = _run(fn, device, rows, limits, min_n, max_n, k)
        assert got == _expected(rows, limits, min_n, max_n, k)


@pytest.mark.parametrize("fn,device", IMPLEMENTATIONS)
def test_rows_longer_than_a_block(fn, device) -> None:
    """Triton walks rows in blocks of 1024 ends: a match in a later block, one in the first
    block beaten by a longer one later, and ties across blocks (the earliest wins)."""
    rng = random.Random(7)
    base = [rng.randrange(1000, 50000) for _ in range(2600)]
    late = base + base[2100:2103]  # only occurrence in the third block
    beaten = list(base)
    beaten[10:12] = [1, 2]
    beaten[1500:1503] = [9, 1, 2]
    beaten += [9, 1, 2]  # n = 2 in block 0, n = 3 in block 1
    tie = list(base)
    tie[20:22] = [1, 2]
    tie[2000:2002] = [1, 2]
    tie += [1, 2]
    rows = [late, beaten, tie]
    got = _run(fn, device, rows, [4, 4, 4], 1, 3, 4)
    assert got == _expected(rows, [4, 4, 4], 1, 3, 4)
    assert got[0] == base[2103:2107] and got[1] == beaten[1503:1507] and got[2] == tie[22:26]


@pytest.mark.skipif(not cpu_binding.available(), reason="no C compiler on this machine")
def test_c_binding_checks_layouts() -> None:
    table = torch.zeros((2, 8), dtype=torch.int64)
    slots = torch.tensor([0, 1])
    counts = torch.tensor([3, 4])
    out = torch.empty((2, 3), dtype=torch.int64)
    with pytest.raises(ValueError, match="int64"):
        ngram_propose_cpu(table.int(), slots, counts, counts, 1, 2, out)
    with pytest.raises(ValueError, match="do not match"):
        ngram_propose_cpu(table, slots, counts[:1], counts, 1, 2, out)


def test_each_device_gets_its_kernel() -> None:
    assert ngram_propose_for(torch.device("cuda")) is ngram_propose_triton
    expected = ngram_propose_cpu if cpu_binding.available() else ngram_propose_torch
    assert ngram_propose_for(torch.device("cpu")) is expected


def test_triton_kernel_compiles_for_cuda() -> None:
    """The interpreter runs Python the compiler may refuse (the while loop's carried scalars,
    its condition): compile the kernel to sm_90 code here, no GPU needed."""
    pytest.importorskip("triton.backends.nvidia", reason="Triton's CUDA backend")
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from kernels.triton import ngram as module

    kernel = module._ngram_kernel
    fn = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)
    signature = {
        name: "constexpr" if name.isupper() else "i64" if name == "token_stride" else "*i64"
        for name in fn.arg_names
    }
    constexprs = {"MIN_N": 2, "MAX_N": 5, "K": 5, "BLOCK_K": 8, "BLOCK": module._BLOCK}
    compiled = triton_compile(
        ASTSource(fn, signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32)
    )
    assert ".entry _ngram_kernel" in compiled.asm["ptx"]
