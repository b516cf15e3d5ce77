"""Rejection sampling of drafts keeps the target's output: greedy token for token, sampled rows in
distribution (chi-square), seeded rows independent of the batch; verification metadata equals
the plain sampler's at every position."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import pytest
import scipy.stats
import torch

from gpu_worker import staging
from gpu_worker.sampler import Sampler
from gpu_worker.sampling_metadata import SamplingMetadata
from gpu_worker.sampling_state import SamplingStates, build_sampling_metadata
from gpu_worker.spec_decode import rejection_sampler
from gpu_worker.spec_decode.rejection_sampler import RejectionOutput, RejectionSampler
from gpu_worker.spec_decode.verify_metadata import expand_metadata
from protocol.sampling_params import SamplingParams
from tests.worker.test_sampler import EOS, State, allowed_set, reference_adjusted, softmax64

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class HostRead(AssertionError):
    """A host read of a tensor that would live on the device."""


class DeviceTensor(torch.Tensor):
    """A CPU tensor the host may not read (test_no_host_reads.py's guard, without the runner)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in {"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__"}:
            raise HostRead(f"host read of a device tensor: Tensor.{name}")
        if name in {"__index__", "__array__"}:
            raise HostRead(f"host read of a device tensor: Tensor.{name}")
        return super().__torch_function__(func, types, args, kwargs or {})


def _guard(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(DeviceTensor)


@dataclass
class Req:
    params: SamplingParams
    drafts: list[int] = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)


class History:
    """The request state's token table by slot (prompt, then outputs), for bad words."""

    def __init__(self, reqs: list[Req], slots: list[int], width: int = 32) -> None:
        r = max(slots) + 1
        self.token_ids = torch.zeros((r, width), dtype=torch.int64, device=DEVICE)
        self.num_tokens_np = np.zeros(r, dtype=np.int64)
        self.prompt_len_np = np.zeros(r, dtype=np.int64)
        for req, slot in zip(reqs, slots):
            tokens = req.prompt + req.output
            self.token_ids[slot, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
            self.num_tokens_np[slot] = len(tokens)
            self.prompt_len_np[slot] = len(req.prompt)


def make_states(reqs: list[Req], slots: list[int], vocab: int) -> SamplingStates:
    states = SamplingStates(max([0, *slots]) + 1, vocab, EOS, DEVICE, staging.HostToDevice(DEVICE))
    for req, slot in zip(reqs, slots):
        states.add(slot, req.params, len(req.output))
    states.apply_staged_writes()
    for req, slot in zip(reqs, slots):
        states.set_penalty_tokens(
            slot,
            torch.tensor(req.prompt, dtype=torch.int64, device=DEVICE),
            torch.tensor(req.output, dtype=torch.int64, device=DEVICE),
        )
    return states


def verify_inputs(reqs: list[Req]) -> tuple[np.ndarray, torch.Tensor]:
    num_drafts_np = np.array([len(r.drafts) for r in reqs], dtype=np.int64)
    drafts = [t for r in reqs for t in [*r.drafts, -1]]
    return num_drafts_np, torch.tensor(drafts, dtype=torch.int64, device=DEVICE)


def expand(states, reqs, slots, history=None) -> tuple[SamplingMetadata, np.ndarray, torch.Tensor]:
    num_drafts_np, drafts = verify_inputs(reqs)
    slots_np = np.array(slots, dtype=np.int64)
    slots_dev = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    md = expand_metadata(states, slots_np, slots_dev, num_drafts_np, drafts, history)
    return md, num_drafts_np, drafts


def verify(logits: torch.Tensor, reqs: list[Req], slots: list[int] | None = None):
    """One verification step of reqs (slots: theirs in a fresh SamplingStates)."""
    slots = slots if slots is not None else list(range(len(reqs)))
    states = make_states(reqs, slots, logits.shape[-1])
    md, num_drafts_np, drafts = expand(states, reqs, slots)
    return RejectionSampler()(logits.clone().to(DEVICE), md, num_drafts_np, drafts)


def outputs(out: RejectionOutput) -> list[list[int]]:
    tokens, num = out.output_token_ids.cpu(), out.num_output.cpu()
    assert torch.all(tokens.gather(1, num.unsqueeze(1) - 1) >= 0)
    return [row[:n].tolist() for row, n in zip(tokens, num)]


# --- verification metadata --------------------------------------------------------------------

MIXED = [
    Req(SamplingParams(temperature=0.0), [3, 4, 5], [1, 2], [3]),
    Req(
        SamplingParams(temperature=0.8, presence_penalty=0.5, frequency_penalty=0.3, seed=11),
        [7, 7],
        [9],
        [7, 1],
    ),
    Req(SamplingParams(temperature=1.2, repetition_penalty=1.3, top_k=4, logprobs=2), [], [2, 8]),
    Req(SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[10], logit_bias={4: 1.0})),
    Req(SamplingParams(top_p=0.8, min_p=0.1, min_tokens=2, seed=5), [EOS, 6, 6], [], [0]),
    Req(SamplingParams(allowed_token_ids=[1, 2, 3, 12], logprobs=-1), [2]),
    Req(SamplingParams(temperature=0.0, bad_words_token_ids=[[2, 9], [4]]), [], [5], [6, 2]),
]
SLOTS = [6, 0, 3, 9, 1, 4, 7]  # out of order, with gaps


def assert_same(got, want, what: str) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want), what
    elif isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want), what
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{what}[{i}]")
    else:
        assert got == want, what


def assert_same_metadata(got: SamplingMetadata, want: SamplingMetadata) -> None:
    for f in dataclasses.fields(SamplingMetadata):
        g, w = getattr(got, f.name), getattr(want, f.name)
        if f.name == "generators":
            assert g.keys() == w.keys()
        elif f.name == "bad_words" and w is not None:
            # Different token tables: compare the entries and the tokens they gather.
            (g_table, g_batch), (w_table, w_batch) = g, w
            assert_same(g_batch.rows, w_batch.rows, "bad word rows")
            assert_same(g_batch.last_ids, w_batch.last_ids, "bad word ids")
            assert_same(g_batch.prefix, w_batch.prefix, "bad word prefixes")
            used = w_batch.prefix >= 0
            gathered = [
                t.view(-1)[b.history_index][used]
                for t, b in ((g_table, g_batch), (w_table, w_batch))
            ]
            assert_same(*gathered, "bad word history")
        elif f.name == "min_tokens_mask" and w is not None:
            # Banned ids matter on the rows still below min_tokens only.
            assert_same(g[0], w[0], "below min_tokens")
            assert_same(g[1][w[0]], w[1][w[0]], "banned ids")
        else:
            assert_same(g, w, f.name)


def test_expand_metadata_without_drafts_is_the_plain_metadata():
    reqs = [dataclasses.replace(r, drafts=[]) for r in MIXED]
    history = History(reqs, SLOTS)
    got, _, _ = expand(make_states(reqs, SLOTS, 16), reqs, SLOTS, history)
    slots_np = np.array(SLOTS, dtype=np.int64)
    fresh = make_states(reqs, SLOTS, 16)
    want = fresh.metadata(slots_np, torch.from_numpy(slots_np).to(DEVICE), history)
    assert want.bad_words is not None and want.min_tokens_mask is not None
    assert_same_metadata(got, want)


def test_expand_metadata_rows_are_the_plain_metadata_after_the_drafts():
    """Row j of a request equals the plain metadata of the request with drafts 1..j sampled."""
    history = History(MIXED, SLOTS)
    states = make_states(MIXED, SLOTS, 16)
    got, _, _ = expand(states, MIXED, SLOTS, history)
    rows = [
        State(r.params, r.prompt, r.output + r.drafts[:j])
        for r in MIXED
        for j in range(len(r.drafts) + 1)
    ]
    want = build_sampling_metadata(rows, DEVICE, 16, EOS)
    assert want.min_tokens_mask is not None and want.output_counts is not None
    assert_same_metadata(got, want)
    # Every row of a seeded request draws from that request's generator.
    row_slots = [s for r, s in zip(MIXED, SLOTS) for _ in range(len(r.drafts) + 1)]
    assert all(g is states.generators[row_slots[row]] for row, g in got.generators.items())


def test_expand_metadata_drops_min_tokens_once_the_drafts_reach_it():
    reqs = [Req(SamplingParams(min_tokens=2), [1, 2, 3], [], [4])]
    md, _, _ = expand(make_states(reqs, [0], 8), reqs, [0])
    assert md.min_tokens_mask[0].tolist() == [True, False, False, False]
    reqs = [Req(SamplingParams(min_tokens=2), [1, 2], [], [4, 4])]
    md, _, _ = expand(make_states(reqs, [0], 8), reqs, [0])
    assert md.min_tokens_mask is None


def test_expand_metadata_refuses_drafts_with_bad_words():
    reqs = [Req(SamplingParams(bad_words_token_ids=[[3]]), [1])]
    with pytest.raises(ValueError, match="bad words"):
        expand(make_states(reqs, [0], 8), reqs, [0], History(reqs, [0]))


# --- greedy -----------------------------------------------------------------------------------


def plain_greedy(logits: torch.Tensor, req: Req) -> list[int]:
    """The plain sampler's token at each verification row, the drafts before it sampled."""
    tokens = []
    for j in range(len(req.drafts) + 1):
        s = State(req.params, req.prompt, req.output + req.drafts[:j])
        md = build_sampling_metadata([s], DEVICE, logits.shape[-1], EOS)
        tokens.append(int(Sampler()(logits[j : j + 1].clone().to(DEVICE), md).sampled_token_ids))
    return tokens


def expected_output(plain: list[int], drafts: list[int]) -> list[int]:
    n = 0
    while n < len(drafts) and drafts[n] == plain[n]:
        n += 1
    return drafts[:n] + [plain[n]]


GREEDY_PARAMS = [
    SamplingParams(temperature=0.0),
    # Rows nearly alike: the drafts' counts decide the argmax of the later rows.
    SamplingParams(temperature=0.0, frequency_penalty=2.0),
    SamplingParams(temperature=0.0, repetition_penalty=3.0, presence_penalty=0.5),
    SamplingParams(temperature=0.0, min_tokens=3, logit_bias={1: 0.5}),
]


def chain(logits: torch.Tensor, req: Req, num_drafts: int) -> list[int]:
    """The drafts plain greedy decoding would produce (each accepted)."""
    drafts: list[int] = []
    for _ in range(num_drafts):
        drafts.append(plain_greedy(logits, dataclasses.replace(req, drafts=drafts))[-1])
    return drafts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("params", GREEDY_PARAMS, ids=["plain", "frequency", "repetition", "min"])
def test_greedy_is_plain_greedy_decoding(params, dtype):
    vocab, k = 24, 4
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(vocab, generator=gen) * 2
    base[EOS] = base.max() + 1.0
    logits = (base + 0.3 * torch.randn(k + 1, vocab, generator=gen)).to(dtype)
    req = Req(params, [], [8], [2])
    right = chain(logits, req, k)
    cases = [right, right[:2] + [(right[2] + 1) % vocab, right[3]], [(right[0] + 1) % vocab], []]
    cases += [right[:1], right[:3]]
    reqs = [dataclasses.replace(req, drafts=d) for d in cases]
    batch_logits = torch.cat([logits[: len(d) + 1] for d in cases])
    got = outputs(verify(batch_logits, reqs, slots=[5, 0, 3, 1, 2, 4]))
    want = [expected_output(plain_greedy(logits, r), r.drafts) for r in reqs]
    assert got == want
    assert got[0] == right + [plain_greedy(logits, reqs[0])[-1]]  # all accepted, then the bonus
    assert len(got[1]) == 3 and len(got[2]) == 1 and len(got[3]) == 1
    if params.frequency_penalty:
        assert len(set(right)) > 1  # the counts changed the argmax


def test_mixed_batch_of_0_1_3_drafts():
    vocab = 16
    logits = torch.randn(4 + 4 + 1 + 2, vocab, generator=torch.Generator().manual_seed(4))
    argmax = logits.argmax(dim=-1).tolist()
    reqs = [
        Req(SamplingParams(temperature=0.0), argmax[0:3]),  # all accepted: 4 tokens
        Req(SamplingParams(temperature=0.0), argmax[4:5] + [(argmax[5] + 1) % vocab, 0]),
        Req(SamplingParams(temperature=0.0), []),
        Req(SamplingParams(temperature=0.0), [(argmax[9] + 1) % vocab]),
    ]
    out = verify(logits, reqs)
    assert out.output_token_ids.dtype == out.num_output.dtype == torch.int64
    assert out.output_token_ids.shape == (4, 4) and out.logprobs is None
    assert out.num_output.tolist() == [4, 2, 1, 1]
    assert out.output_token_ids.tolist() == [
        argmax[0:4],
        [argmax[4], argmax[5], -1, -1],
        [argmax[8], -1, -1, -1],
        [argmax[9], -1, -1, -1],
    ]


def test_accept_argmax_equals_the_sampler_on_argmax_only_rows():
    """The runner's fused path (argmax from the output projection, no logits) gives the
    rejection sampler's output for argmax-only greedy rows."""
    vocab = 16
    logits = torch.randn(4 + 4 + 1 + 2, vocab, generator=torch.Generator().manual_seed(4))
    argmax = logits.argmax(dim=-1)
    am = argmax.tolist()
    reqs = [
        Req(SamplingParams(temperature=0.0), am[0:3]),
        Req(SamplingParams(temperature=0.0), am[4:5] + [(am[5] + 1) % vocab, 0]),
        Req(SamplingParams(temperature=0.0), []),
        Req(SamplingParams(temperature=0.0), [(am[9] + 1) % vocab]),
    ]
    want = verify(logits, reqs)
    num_drafts_np, drafts = verify_inputs(reqs)
    got = rejection_sampler.accept_argmax(argmax.to(DEVICE), num_drafts_np, drafts)
    assert got.output_token_ids.tolist() == want.output_token_ids.tolist()
    assert got.num_output.tolist() == want.num_output.tolist() == [4, 2, 1, 1]
    assert got.logprobs is None


def test_no_drafts_at_all_is_the_plain_sampler():
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(5))
    reqs = [Req(SamplingParams(temperature=0.0, logit_bias={2: 9.0})), Req(SamplingParams())]
    out = verify(logits, reqs)
    assert out.output_token_ids.shape == (2, 1) and out.num_output.tolist() == [1, 1]
    assert out.output_token_ids[0, 0] == 2
    empty = verify(torch.zeros(0, 10), [])
    assert empty.output_token_ids.shape == (0, 1) and empty.num_output.shape == (0,)


# --- distribution -----------------------------------------------------------------------------

VOCAB = 12
NUM_REQUESTS = 30000


def target_probs(logits: torch.Tensor, params: SamplingParams, prompt, output) -> np.ndarray:
    """The plain sampler's distribution at one row, from test_sampler's host references."""
    adjusted = reference_adjusted(logits, State(params, prompt, output)).numpy()
    keep = allowed_set(adjusted, params.temperature, params.top_k, params.top_p, params.min_p)
    return softmax64(np.where(keep, adjusted / params.temperature, -np.inf))


def chisquare_p(tokens: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit of tokens to probs; tokens expected fewer than 5 times share one bin."""
    observed = np.bincount(tokens, minlength=len(probs)).astype(np.float64)
    assert observed[probs == 0].sum() == 0, "a token of probability 0 was sampled"
    expected = probs * len(tokens)
    small = expected < 5
    observed = np.append(observed[~small], observed[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    return float(scipy.stats.chisquare(observed, expected).pvalue)


DISTRIBUTION_CASES = {
    "temperature": (SamplingParams(temperature=0.7), [], []),
    "top_k": (SamplingParams(top_k=4), [], []),
    "top_p": (SamplingParams(temperature=0.9, top_p=0.75), [], []),
    "min_p": (SamplingParams(min_p=0.12), [], []),
    "penalties": (
        SamplingParams(presence_penalty=0.7, frequency_penalty=0.5, repetition_penalty=1.5),
        [1, 2],
        [3, 3],
    ),
    # Rows 0 and 1 are below min_tokens (1 and 2 outputs before them), the bonus row is not.
    "min_tokens": (SamplingParams(min_tokens=3, stop_token_ids=[7]), [], [1]),
    "logit_bias": (SamplingParams(logit_bias={2: 1.5, 9: -3.0, 4: 0.8}), [], []),
}
DIST_LOGITS = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(8))
DIST_LOGITS[:, EOS] += 1.5
DIST_LOGITS[:, 7] += 1.0


def draws_with_two_drafts(name: str) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """NUM_REQUESTS copies of one request (one slot) verifying two drafts, each the most likely
    token at its row: (output tokens [N, 3], num_output [N], the target's p at rows 0, 1, 2)."""
    params, prompt, output = DISTRIBUTION_CASES[name]
    drafts: list[int] = []
    probs = []
    for row in range(3):
        probs.append(target_probs(DIST_LOGITS[row], params, prompt, output + drafts))
        drafts.append(int(probs[-1].argmax()))
    req = Req(params, drafts[:2], prompt, output)
    states = make_states([req], [0], VOCAB)
    reqs, slots = [req] * NUM_REQUESTS, [0] * NUM_REQUESTS
    md, num_drafts_np, draft_ids = expand(states, reqs, slots)
    logits = DIST_LOGITS.repeat(NUM_REQUESTS, 1).to(DEVICE)
    out = RejectionSampler()(logits, md, num_drafts_np, draft_ids)
    return out.output_token_ids.cpu().numpy(), out.num_output.cpu().numpy(), probs


@pytest.mark.parametrize("name", list(DISTRIBUTION_CASES))
def test_outputs_follow_the_target_distribution(name):
    torch.manual_seed(9)
    tokens, num, probs = draws_with_two_drafts(name)
    d0, d1 = int(probs[0].argmax()), int(probs[1].argmax())
    assert chisquare_p(tokens[:, 0], probs[0]) > 1e-3
    # The second token follows p at row 1 given the first was d0 (always, when accepted).
    second = tokens[num >= 2, 1]
    assert (tokens[:, 0] == d0).sum() == len(second) > 2000
    assert chisquare_p(second, probs[1]) > 1e-3
    third = tokens[num == 3, 2]
    assert (tokens[num >= 2, 1] == d1).sum() == len(third) > 1000
    assert chisquare_p(third, probs[2]) > 1e-3
    if name == "min_tokens":
        assert not np.isin(tokens[:, :2], [EOS, 7]).any()
        assert probs[2][EOS] > 0.1 and np.isin(third, [EOS, 7]).any()
    if name == "penalties":  # the first draft's count moved the second row's distribution
        plain = target_probs(DIST_LOGITS[1], *DISTRIBUTION_CASES[name][:2], [3, 3])
        assert abs(plain[d0] - probs[1][d0]) > 0.05


def test_the_chi_square_sees_a_recovered_token_that_keeps_the_draft(monkeypatch):
    """Drawing the token after a rejection from p itself (the draft left in) over-weights the
    draft; the distribution test must catch it."""
    monkeypatch.setattr(rejection_sampler, "_without_draft", lambda probs, *_: probs)
    torch.manual_seed(9)
    tokens, _, probs = draws_with_two_drafts("temperature")
    assert chisquare_p(tokens[:, 0], probs[0]) < 1e-6


# --- seeds ------------------------------------------------------------------------------------


def test_seeded_request_ignores_the_rest_of_the_batch():
    vocab, steps = 10, 4
    target = Req(SamplingParams(temperature=1.0, seed=1234), [1, 2, 3])
    others = [
        Req(SamplingParams(temperature=0.9, seed=7), [4, 4]),
        Req(SamplingParams(temperature=1.0), [1]),
        Req(SamplingParams(temperature=0.0), [0, 1, 2]),
        Req(SamplingParams(top_p=0.7), []),
    ]
    # Flat logits: each draft is accepted with probability about 0.3-0.5.
    step_logits = [
        torch.randn(4, vocab, generator=torch.Generator().manual_seed(s)) * 0.3
        for s in range(steps)
    ]
    compositions = [[], [0, 1], [2, 1, 3, 0, 0, 1, 2], [3] * 9]
    runs = []
    for layout, composition in enumerate(compositions):
        reqs = [others[i] for i in composition]
        position = layout % (len(reqs) + 1)
        reqs.insert(position, target)
        slots = [(5 * i + layout) % 23 for i in range(len(reqs))]
        states = make_states(reqs, slots, vocab)  # kept across steps: the generators advance
        noise = torch.Generator().manual_seed(100 + layout)
        run = []
        for step in range(steps):
            blocks = [
                step_logits[step]
                if r is target
                else torch.randn(len(r.drafts) + 1, vocab, generator=noise)
                for r in reqs
            ]
            md, num_drafts_np, draft_ids = expand(states, reqs, slots)
            out = RejectionSampler()(torch.cat(blocks).to(DEVICE), md, num_drafts_np, draft_ids)
            run.append(outputs(out)[position])
        runs.append(run)
    assert all(run == runs[0] for run in runs)
    assert len({len(tokens) for tokens in runs[0]}) > 1 or len({t[-1] for t in runs[0]}) > 1


def test_same_seed_same_outputs_and_other_seeds_differ():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(12)) * 0.3
    reqs = [Req(SamplingParams(seed=s), [4, 5]) for s in [99, 1, 99, *range(2, 30)]]
    got = outputs(verify(logits.repeat(len(reqs), 1), reqs))
    assert got[0] == got[2]
    assert len({tuple(t) for t in got}) > 3


# --- logprobs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_the_raw_logprobs_of_the_output_tokens(dtype):
    vocab = 20
    gen = torch.Generator().manual_seed(13)
    logits = (torch.randn(4 + 3 + 1, vocab, generator=gen) * 2).to(dtype)
    top = logits.float().argmax(dim=-1).tolist()
    reqs = [
        Req(SamplingParams(temperature=0.0, logprobs=2, logit_bias={3: 50.0}), [3, 3, 1]),
        Req(SamplingParams(temperature=0.7, logprobs=5, presence_penalty=1.0), top[4:6], [], [0]),
        Req(SamplingParams(temperature=0.0), []),
    ]
    out = verify(logits, reqs)
    lp = out.logprobs
    assert lp.token_ids.shape == lp.logprobs.shape == (8, 6)
    raw = torch.log_softmax(logits.float(), dim=-1)
    # Each request's rows up to its last output: the tokens it outputs there.
    rows = [0, 4, 7]
    for i, tokens in enumerate(outputs(out)):
        r = torch.arange(rows[i], rows[i] + len(tokens))
        assert lp.token_ids[r, 0].tolist() == tokens
        torch.testing.assert_close(lp.logprobs[r, 0], raw[r, tokens])
        torch.testing.assert_close(lp.logprobs[r, 1:], raw[r].topk(5, dim=-1).values)
        want_ranks = (raw[r] > raw[r, tokens].unsqueeze(1)).sum(-1) + 1
        assert lp.ranks[r].tolist() == want_ranks.tolist()
    assert outputs(out)[0][:2] == [3, 3]  # the biased (processed) argmax, raw logprobs


# --- no host reads ----------------------------------------------------------------------------


def test_a_verification_step_never_reads_the_device(monkeypatch):
    """expand_metadata and the sampler run on guarded tensors: every host read raises."""
    with pytest.raises(HostRead):
        bool(_guard(torch.ones(1)))
    states = make_states(MIXED, SLOTS, 16)
    for name in ("floats", "ints", "num_output", "output_counts", "prompt_mask", "ban_ids"):
        setattr(states, name, _guard(getattr(states, name)))
    history = History(MIXED, SLOTS)
    history.token_ids = _guard(history.token_ids)
    real_copy = staging.HostToDevice.copy
    monkeypatch.setattr(
        staging.HostToDevice, "copy", lambda self, *a: [_guard(t) for t in real_copy(self, *a)]
    )
    num_drafts_np, drafts = verify_inputs(MIXED)
    slots_np = np.array(SLOTS, dtype=np.int64)
    slots = _guard(torch.from_numpy(slots_np).to(DEVICE))
    md = expand_metadata(states, slots_np, slots, num_drafts_np, _guard(drafts), history)
    assert md.bad_words is not None and md.min_tokens_mask is not None
    logits = torch.randn(len(drafts), 16, generator=torch.Generator().manual_seed(14))
    logits = _guard(logits.to(DEVICE))
    out = RejectionSampler()(logits, md, num_drafts_np, _guard(drafts))
    # The outputs are written into fresh tensors (plain here); the logprobs derive from logits.
    assert out.logprobs is not None and isinstance(out.logprobs.logprobs, DeviceTensor)
