"""LLM.beam_search against brute force on a tiny random model (vocabulary 512): every two-token
continuation enumerated with transformers' log-probabilities, and an independent beam search
recomputing each step from scratch (no KV cache, no engine)."""

from __future__ import annotations

import shutil

import pytest
import torch

from frontend.beam_search import BeamSearchParams, beam_search_score
from frontend.llm import LLM
from tests.tiny_models import make_tiny_model

PROMPTS = [[1, 17, 300, 42], [1, 99, 5]]
EOS = 2


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from config.default_model import resolve_model_path

    path = make_tiny_model(tmp_path_factory.mktemp("beam") / "tiny", vocab_size=512)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(resolve_model_path(None) / name, path / name)
    return path


@pytest.fixture(scope="module")
def hf_model(tiny_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(tiny_path):
    return LLM(str(tiny_path), device="cpu", max_model_len=64, kv_cache_memory="8MiB", block_size=8)


@torch.inference_mode()
def next_logprobs(model, sequences: list[list[int]]) -> torch.Tensor:
    """log p(next token | sequence) for equal-length sequences, recomputed from scratch."""
    logits = model(torch.tensor(sequences)).logits[:, -1].float()
    return logits.log_softmax(-1)


def reference_beam_search(model, prompt, width, max_tokens, length_penalty=1.0):
    """The same algorithm, independently: top 2*width candidates per beam, EOS beams set
    aside, the best width kept by length-penalised score."""

    def score(seq):
        return beam_search_score(seq[0], seq[1], EOS, length_penalty)

    beams, completed = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        lps = next_logprobs(model, [b[0] for b in beams])
        candidates = []
        for (tokens, cum), lp in zip(beams, lps):
            top = lp.topk(2 * width)
            for logprob, token in zip(top.values.tolist(), top.indices.tolist()):
                seq = (tokens + [token], cum + logprob)
                (completed if token == EOS else candidates).append(seq)
        beams = sorted(candidates, key=score, reverse=True)[:width]
    return sorted(completed + beams, key=score, reverse=True)[:width]


def test_two_tokens_match_the_enumeration_of_every_sequence(llm, hf_model):
    width = 3
    out = llm.beam_search(
        [{"prompt_token_ids": p} for p in PROMPTS],
        BeamSearchParams(beam_width=width, max_tokens=2, ignore_eos=True),
    )
    for prompt, result in zip(PROMPTS, out):
        first = next_logprobs(hf_model, [prompt])[0]
        second = next_logprobs(hf_model, [prompt + [t] for t in range(512)])
        # Every two-token continuation's log probability, [first token, second token].
        table = first.unsqueeze(1) + second
        kept_first = first.topk(width).indices
        allowed = torch.full_like(table, float("-inf"))
        allowed[kept_first] = table[kept_first]
        best = allowed.flatten().topk(width)
        expected = [[int(i) // 512, int(i) % 512] for i in best.indices]
        assert [s.tokens[len(prompt) :] for s in result.sequences] == expected
        for seq, value in zip(result.sequences, best.values.tolist()):
            assert seq.cum_logprob == pytest.approx(value, abs=1e-4)
        # The global best is found: its first token is the most likely first token here.
        assert result.sequences[0].tokens[len(prompt) :] == [
            int(table.argmax()) // 512,
            int(table.argmax()) % 512,
        ]


@pytest.mark.parametrize("length_penalty", [1.0, 0.5])
def test_longer_search_matches_an_independent_reference(llm, hf_model, length_penalty):
    params = BeamSearchParams(beam_width=4, max_tokens=5, length_penalty=length_penalty)
    out = llm.beam_search(PROMPTS, params)  # token-id prompts
    for prompt, result in zip(PROMPTS, out):
        expected = reference_beam_search(hf_model, prompt, 4, 5, length_penalty)
        assert [s.tokens for s in result.sequences] == [e[0] for e in expected]
        for seq, (_, cum) in zip(result.sequences, expected):
            assert seq.cum_logprob == pytest.approx(cum, abs=1e-3)
        assert result.sequences[0].text == llm.get_tokenizer().decode(result.sequences[0].tokens)


def test_width_one_is_greedy_and_beams_share_cached_blocks(llm):
    from protocol.sampling_params import SamplingParams

    greedy = (
        llm.generate(
            [{"prompt_token_ids": PROMPTS[0]}],
            SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
    )
    before = llm.get_engine_stats()
    out = llm.beam_search(
        [PROMPTS[0]], BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True)
    )
    after = llm.get_engine_stats()
    assert out[0].sequences[0].tokens[len(PROMPTS[0]) :] == greedy
    # Each step re-submits the beam: its earlier full blocks come from the prefix cache.
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] > 0


def test_bad_beam_search_params_raise():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
