"""allowed_token_ids and bad_words in the sampler, against row-by-row references of vLLM's rules."""

from __future__ import annotations

import torch

from protocol.sampling_params import SamplingParams
from tests.worker.test_sampler import EOS, sample, state

V = 40


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed))


def reference_bad_words(
    logits: torch.Tensor, words: list[list[int]], output: list[int]
) -> torch.Tensor:
    """vLLM's _apply_bad_words_single_batch: the output so far (not the prompt) must end with
    the word's prefix."""
    out = logits.clone()
    for word in words:
        if len(word) > len(output) + 1:
            continue
        prefix = word[:-1]
        if not prefix or output[-len(prefix) :] == prefix:
            out[word[-1]] = float("-inf")
    return out


def test_allowed_token_ids_restrict_greedy_and_random_rows():
    logits = _logits(4)
    allowed = [3, 17, 29]
    params = [
        SamplingParams(temperature=0.0, allowed_token_ids=allowed),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=1, allowed_token_ids=allowed),
        SamplingParams(temperature=0.0, allowed_token_ids=[7]),
    ]
    out = sample(logits, [state(p) for p in params]).sampled_token_ids.cpu()
    assert out[0] == allowed[int(logits[0, allowed].argmax())]
    assert out[1] == logits[1].argmax()
    assert int(out[2]) in allowed
    assert out[3] == 7
    many = sample(
        logits[2:3].expand(200, -1),
        [state(SamplingParams(temperature=2.0, allowed_token_ids=allowed)) for _ in range(200)],
    ).sampled_token_ids.cpu()
    assert set(many.tolist()) <= set(allowed) and len(set(many.tolist())) > 1


def test_allowed_token_ids_keep_raw_logprobs():
    logits = _logits(1)
    out = sample(
        logits, [state(SamplingParams(temperature=0.0, allowed_token_ids=[5, 6], logprobs=2))]
    )
    raw = logits.log_softmax(-1)
    chosen = int(out.sampled_token_ids[0])
    assert chosen in (5, 6)
    assert torch.allclose(out.logprobs.logprobs[0, 0].cpu(), raw[0, chosen])


def test_bad_words_follow_vllm_rules_row_by_row():
    logits = _logits(6, seed=3)
    top = logits.argmax(-1).tolist()
    cases = [
        ([[top[0]]], [1, 2], []),  # a one-token word: always banned
        ([[9, top[1]]], [9], []),  # the prefix is in the prompt only: not banned
        ([[9, top[2]]], [], [4, 9]),  # the output ends with the prefix: banned
        ([[4, 9, top[3]]], [], [4, 8]),  # a mismatch: not banned
        ([[9, 4, top[4]], [top[4]]], [], [1, 9, 4]),  # two words ban the same token
        ([[1, 2, 3, top[5]]], [], [2, 3]),  # longer than the output allows: not banned
    ]
    states = [
        state(SamplingParams(temperature=0.0, bad_words_token_ids=w), prompt, output)
        for w, prompt, output in cases
    ]
    out = sample(logits, states).sampled_token_ids.cpu().tolist()
    for row, (words, _, output) in enumerate(cases):
        expected = int(reference_bad_words(logits[row], words, output).argmax())
        assert out[row] == expected, (row, words)
    assert out[0] != top[0] and out[1] == top[1] and out[2] != top[2] and out[3] == top[3]
    assert out[4] != top[4] and out[5] == top[5]


def test_bad_words_and_allowed_ids_together_with_eos():
    logits = _logits(1, seed=5)
    params = SamplingParams(
        temperature=0.0, allowed_token_ids=[EOS, 11], bad_words_token_ids=[[EOS]]
    )
    assert sample(logits, [state(params)]).sampled_token_ids.tolist() == [11]
