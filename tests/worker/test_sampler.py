"""The sampler matches vLLM's semantics: greedy, seeded determinism, truncation, distribution,
penalties, logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import scipy.stats
import torch

from gpu_worker.penalties import apply_penalties
from gpu_worker.sampler import Sampler, SamplerOutput, compute_logprobs_tensors
from gpu_worker.sampling_state import build_sampling_metadata
from protocol.sampling_params import SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EOS = 5


@dataclass
class State:
    sampling_params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


def state(
    params: SamplingParams, prompt: list[int] | None = None, output: list[int] | None = None
) -> State:
    generator = None
    if params.seed is not None:
        generator = torch.Generator(DEVICE).manual_seed(params.seed)
    return State(params, prompt or [], output or [], generator)


def sample(logits: torch.Tensor, states: list[State]) -> SamplerOutput:
    metadata = build_sampling_metadata(states, DEVICE, logits.shape[-1], EOS)
    return Sampler()(logits.clone().to(DEVICE), metadata)


def draws(logits: torch.Tensor, params: SamplingParams, n: int) -> np.ndarray:
    """n independent samples of one logits row, as one batched call."""
    return (
        sample(logits.expand(n, -1), [state(params) for _ in range(n)])
        .sampled_token_ids.cpu()
        .numpy()
    )


# --- greedy -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax(dtype):
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0)).to(dtype)
    states = [state(SamplingParams(temperature=0.0)) for _ in range(8)]
    metadata = build_sampling_metadata(states, DEVICE, 50, EOS)
    assert metadata.argmax_only and metadata.temperature is None
    out = Sampler()(logits.to(DEVICE), metadata)
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids.cpu(), logits.float().argmax(dim=-1))
    assert out.logprobs is None


def reference_adjusted(logits: torch.Tensor, s: State) -> torch.Tensor:
    """Row-wise reference of logit bias, min_tokens and penalties, one token at a time."""
    p = s.sampling_params
    out = logits.double().clone()
    for t, b in (p.logit_bias or {}).items():
        out[t] += b
    if len(s.output_token_ids) < p.min_tokens:
        for t in set(p.stop_token_ids or ()) | {EOS}:
            out[t] = float("-inf")
    for t in set(s.prompt_token_ids) | set(s.output_token_ids):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(s.output_token_ids):
        count = s.output_token_ids.count(t)
        out[t] -= p.frequency_penalty * count + p.presence_penalty
    return out


MIXED_GREEDY = [
    (SamplingParams(temperature=0.0), [1, 2], [3]),
    (SamplingParams(temperature=0.0, presence_penalty=1.5), [], [7, 7, 2]),
    (SamplingParams(temperature=0.0, frequency_penalty=0.8), [4], [9, 9, 9, 1]),
    (SamplingParams(temperature=0.0, repetition_penalty=1.7), [0, 1, 2, 3, 11], [12]),
    (
        SamplingParams(
            temperature=0.0, presence_penalty=-0.5, frequency_penalty=0.3, repetition_penalty=0.8
        ),
        [5],
        [6, 6],
    ),
    (SamplingParams(temperature=0.0, logit_bias={8: 3.0, 2: -2.0}), [], []),
    (SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[10]), [], [1]),
]


def test_greedy_batch_with_mixed_penalties_row_by_row():
    gen = torch.Generator().manual_seed(1)
    states = [state(p, prompt, out) for p, prompt, out in MIXED_GREEDY]
    for _ in range(5):
        logits = torch.randn(len(states), 16, generator=gen) * 2
        batched = sample(logits, states).sampled_token_ids.cpu()
        for i, s in enumerate(states):
            assert batched[i] == sample(logits[i : i + 1], [s]).sampled_token_ids.item()
            assert batched[i] == reference_adjusted(logits[i], s).argmax()


# --- seeded determinism -----------------------------------------------------------------------


def test_seeded_request_ignores_the_rest_of_the_batch():
    vocab, steps = 64, 6
    target_params = SamplingParams(temperature=0.9, top_k=40, seed=1234)
    others = {
        "seeded": SamplingParams(temperature=1.1, seed=7),
        "unseeded": SamplingParams(temperature=1.0),
        "greedy": SamplingParams(temperature=0.0),
        "top_p": SamplingParams(temperature=0.5, top_p=0.8),
    }
    compositions = [
        [],
        ["seeded", "unseeded"],
        ["greedy", "unseeded", "top_p", "seeded", "seeded", "unseeded", "greedy"],
        ["top_p"] * 9,
    ]
    target_logits = [
        torch.randn(vocab, generator=torch.Generator().manual_seed(s)) for s in range(steps)
    ]

    sequences = []
    for layout, composition in enumerate(compositions):
        rows = [state(others[name]) for name in composition]
        target = state(target_params)
        position = layout % (len(rows) + 1)
        rows.insert(position, target)
        noise = torch.Generator().manual_seed(100 + layout)
        for step in range(steps):
            logits = torch.randn(len(rows), vocab, generator=noise)
            logits[position] = target_logits[step]
            tokens = sample(logits, rows).sampled_token_ids.cpu().tolist()
            for s, t in zip(rows, tokens):
                s.output_token_ids.append(t)
        sequences.append(target.output_token_ids)

    assert all(seq == sequences[0] for seq in sequences)
    assert len(set(sequences[0])) > 1


def test_same_seed_same_logits_same_token():
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(3)).expand(3, -1)
    rows = [state(SamplingParams(seed=99)), state(SamplingParams()), state(SamplingParams(seed=99))]
    tokens = sample(logits, rows).sampled_token_ids.cpu()
    assert tokens[0] == tokens[2]


# --- truncation never samples a masked token --------------------------------------------------


def softmax64(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


def allowed_set(
    logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float
) -> np.ndarray:
    """Boolean mask of tokens vLLM may sample: min-p, then top-k, then top-p on the renormalized
    rest."""
    x = logits.astype(np.float64) / temperature
    probs = softmax64(x)
    assert min_p == 0.0 or np.all(np.abs(probs / probs.max() - min_p) > 1e-4), (
        "min_p too close to a ratio"
    )
    x = np.where(probs >= min_p * probs.max(), x, -np.inf)
    if top_k:
        x = np.where(x >= np.sort(x)[::-1][top_k - 1], x, -np.inf)
    probs = softmax64(x)
    order = np.argsort(-probs, kind="stable")
    cum = np.cumsum(probs[order])
    assert top_p == 1.0 or np.all(np.abs(cum - top_p) > 1e-4), (
        "top_p too close to a cumulative mass"
    )
    keep = np.zeros_like(probs, dtype=bool)
    keep[order[: int(np.searchsorted(cum, top_p)) + 1]] = True
    return keep & (probs > 0)


FLAT = torch.randn(32, generator=torch.Generator().manual_seed(10)) * 0.5
PEAKED = torch.randn(32, generator=torch.Generator().manual_seed(11)) * 3.0


@pytest.mark.parametrize("logits", [FLAT, PEAKED], ids=["flat", "peaked"])
@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [
        (1.0, 5, 1.0, 0.0),
        (0.7, 1, 1.0, 0.0),
        (1.0, 0, 0.62, 0.0),
        (1.3, 0, 0.33, 0.0),
        (1.0, 0, 1e-9, 0.0),
        (1.0, 0, 1.0, 0.3),
        (0.8, 8, 0.71, 0.0),
        (1.0, 0, 0.51, 0.45),
        (1.0, 10, 0.87, 0.17),
    ],
)
def test_truncation_never_samples_a_masked_token(logits, temperature, top_k, top_p, min_p):
    torch.manual_seed(0)
    keep = allowed_set(logits.numpy(), temperature, top_k, top_p, min_p)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    tokens = draws(logits, params, 4000)
    assert keep[tokens].all()
    renormalized = softmax64(np.where(keep, logits.numpy() / temperature, -np.inf))
    assert set(np.flatnonzero(renormalized > 0.01)) <= set(tokens.tolist())


# --- distribution -----------------------------------------------------------------------------

CHI_LOGITS = torch.randn(20, generator=torch.Generator().manual_seed(20))
NUM_DRAWS = 20000


def chisquare_p(tokens: np.ndarray, probs: np.ndarray) -> float:
    observed = np.bincount(tokens, minlength=len(probs))
    support = probs > 0
    assert observed[~support].sum() == 0
    expected = probs[support] / probs[support].sum() * len(tokens)
    return scipy.stats.chisquare(observed[support], expected).pvalue


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_samples_follow_softmax_over_temperature(temperature):
    torch.manual_seed(1)
    tokens = draws(CHI_LOGITS, SamplingParams(temperature=temperature), NUM_DRAWS)
    assert chisquare_p(tokens, softmax64(CHI_LOGITS.numpy() / temperature)) > 1e-3


def test_top_p_samples_follow_the_renormalized_nucleus():
    torch.manual_seed(2)
    keep = allowed_set(CHI_LOGITS.numpy(), 1.0, 0, 0.8, 0.0)
    assert 2 < keep.sum() < 20
    tokens = draws(CHI_LOGITS, SamplingParams(top_p=0.8), NUM_DRAWS)
    assert chisquare_p(tokens, softmax64(np.where(keep, CHI_LOGITS.numpy(), -np.inf))) > 1e-3


def test_seeded_rows_follow_softmax():
    rows = [state(SamplingParams(temperature=1.3, seed=seed)) for seed in range(4000)]
    tokens = sample(CHI_LOGITS.expand(len(rows), -1), rows).sampled_token_ids.cpu().numpy()
    assert chisquare_p(tokens, softmax64(CHI_LOGITS.numpy() / 1.3)) > 1e-3


# --- penalties, bias, min_tokens --------------------------------------------------------------


def test_penalties_change_logits_exactly():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(len(MIXED_GREEDY), 16, generator=gen) * 2
    states = [state(p, prompt, out) for p, prompt, out in MIXED_GREEDY]
    md = build_sampling_metadata(states, DEVICE, 16, EOS)
    got = apply_penalties(
        logits.to(DEVICE),
        md.output_counts,
        md.prompt_mask,
        md.presence_penalties,
        md.frequency_penalties,
        md.repetition_penalties,
    ).cpu()
    for i, (p, prompt, out) in enumerate(MIXED_GREEDY):
        no_bias = state(SamplingParams(**{**_penalty_fields(p), "temperature": 0.0}), prompt, out)
        torch.testing.assert_close(
            got[i].double(), reference_adjusted(logits[i], no_bias), rtol=1e-6, atol=1e-6
        )


def _penalty_fields(p: SamplingParams) -> dict:
    return {
        k: getattr(p, k) for k in ("presence_penalty", "frequency_penalty", "repetition_penalty")
    }


@pytest.mark.parametrize(
    "logits,params,prompt,output,expected",
    [
        ([2.0, 1.5, 0.0], dict(presence_penalty=0.6), [], [0], 1),
        ([2.0, 1.5, 0.0], dict(presence_penalty=0.4), [], [0], 0),
        ([2.0, 1.5, 0.0], dict(frequency_penalty=0.2), [], [0, 0, 0], 1),
        ([2.0, 1.5, 0.0], dict(frequency_penalty=0.1), [], [0, 0, 0], 0),
        ([2.0, 1.5, 0.0], dict(repetition_penalty=1.5), [0], [], 1),
        ([2.0, 1.5, 0.0], dict(repetition_penalty=1.2), [], [0], 0),
        ([-1.0, -1.2, -3.0], dict(repetition_penalty=1.3), [0], [], 1),
        ([-1.0, -1.2, -3.0], dict(repetition_penalty=0.5), [1], [], 1),
        ([2.0, 1.5, 0.0], dict(logit_bias={1: 0.6}), [], [], 1),
        ([2.0, 1.5, 0.0], dict(logit_bias={0: -0.6}), [], [], 1),
        ([2.0, 1.5, 0.0], dict(logit_bias={99: 5.0, -1: 5.0}), [], [], 0),
        # Repetition before presence (vLLM): 1.0 / 2 - 0.5 = 0.0 < 0.1, whereas
        # (1.0 - 0.5) / 2 = 0.25 would win.
        ([1.0, 0.1, 0.0], dict(repetition_penalty=2.0, presence_penalty=0.5), [], [0], 1),
    ],
)
def test_penalty_and_bias_decide_greedy(logits, params, prompt, output, expected):
    s = state(SamplingParams(temperature=0.0, **params), prompt, output)
    assert sample(torch.tensor([logits]), [s]).sampled_token_ids.item() == expected


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_masks_eos_and_stop_ids_until_reached(ignore_eos):
    logits = torch.full((1, 10), -2.0)
    logits[0, EOS], logits[0, 3], logits[0, 7] = 5.0, 4.0, 3.0
    params = SamplingParams(
        temperature=0.0, min_tokens=3, stop_token_ids=[3], ignore_eos=ignore_eos
    )
    tokens = [
        sample(logits, [state(params, [], [1] * n)]).sampled_token_ids.item() for n in range(5)
    ]
    assert tokens == [7, 7, 7, EOS, EOS]

    torch.manual_seed(5)
    flat = torch.zeros(10)
    random_params = SamplingParams(min_tokens=2, stop_token_ids=[3], ignore_eos=ignore_eos)
    below = sample(flat.expand(2000, -1), [state(random_params, [], [1]) for _ in range(2000)])
    assert not np.isin(below.sampled_token_ids.cpu().numpy(), [EOS, 3]).any()
    reached = sample(flat.expand(2000, -1), [state(random_params, [], [1, 1]) for _ in range(2000)])
    assert np.isin(reached.sampled_token_ids.cpu().numpy(), [EOS, 3]).any()


# --- logprobs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_raw_sorted_and_ranked(dtype):
    vocab = 40
    logits = (torch.randn(4, vocab, generator=torch.Generator().manual_seed(6)) * 2).to(dtype)
    rows = [
        state(SamplingParams(temperature=0.0, logprobs=2, logit_bias={3: 50.0})),
        state(SamplingParams(temperature=0.7, logprobs=5, presence_penalty=1.0), [], [0, 1]),
        state(SamplingParams(temperature=0.0)),
        state(SamplingParams(temperature=1.0, top_k=3, logprobs=0)),
    ]
    out = sample(logits, rows)
    raw = torch.log_softmax(logits.float(), dim=-1)
    lp = out.logprobs
    ids, values, ranks = lp.token_ids.cpu(), lp.logprobs.cpu(), lp.ranks.cpu()
    assert ids.shape == values.shape == (4, 6) and ids.dtype == ranks.dtype == torch.int64
    assert values.dtype == torch.float32
    sampled = out.sampled_token_ids.cpu()
    assert sampled[0] == 3
    assert torch.equal(ids[:, 0], sampled)
    torch.testing.assert_close(values, raw.gather(1, ids))
    top = raw.topk(5, dim=-1)
    torch.testing.assert_close(values[:, 1:], top.values)
    assert torch.all(values[:, 1:-1] >= values[:, 2:])
    assert torch.equal(ranks, (raw > raw.gather(1, sampled[:, None])).sum(-1) + 1)


def test_ranks_with_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 2.0, 0.0]])
    rows = [state(SamplingParams(temperature=0.0, logprobs=1, logit_bias={4: 10.0}))]
    out = sample(logits, rows)
    assert out.sampled_token_ids.item() == 4
    assert out.logprobs.ranks.item() == 3

    logprobs = torch.log_softmax(logits.expand(6, -1), dim=-1)
    lt = compute_logprobs_tensors(logprobs, torch.arange(6), 2)
    assert lt.ranks.tolist() == [5, 1, 1, 3, 3, 6]
    assert lt.token_ids.shape == (6, 3)
    assert set(lt.token_ids[0, 1:].tolist()) == {1, 2}


def test_logprobs_minus_one_is_whole_vocabulary():
    vocab = 12
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(7))
    rows = [state(SamplingParams(temperature=0.0, logprobs=-1)), state(SamplingParams(logprobs=3))]
    out = sample(logits, rows).logprobs
    assert out.token_ids.shape == (2, vocab + 1)
    for row in out.token_ids.cpu()[:, 1:]:
        assert sorted(row.tolist()) == list(range(vocab))
    assert torch.all(out.logprobs[:, 1:-1] >= out.logprobs[:, 2:])
    lt = compute_logprobs_tensors(torch.log_softmax(logits, -1), torch.tensor([0, 1]), -1)
    assert lt.token_ids.shape == (2, vocab + 1)


# --- metadata flags ---------------------------------------------------------------------------


def test_metadata_flags_skip_unused_stages():
    md = build_sampling_metadata(
        [state(SamplingParams(temperature=0.0, top_k=5, top_p=0.5))], DEVICE, 10, EOS
    )
    assert md.all_greedy and md.no_top_k and md.no_top_p and md.no_min_p and md.no_penalties
    assert md.no_logit_bias and md.no_min_tokens and md.max_num_logprobs is None and md.argmax_only

    md = build_sampling_metadata(
        [
            state(SamplingParams(top_k=3)),
            state(SamplingParams(temperature=0.0, repetition_penalty=1.1)),
        ],
        DEVICE,
        10,
        EOS,
    )
    assert not md.all_greedy and not md.all_random and md.greedy_mask.tolist() == [False, True]
    assert (
        md.top_k.tolist() == [3, 10] and md.max_top_k == 3 and md.no_top_p and not md.no_penalties
    )
