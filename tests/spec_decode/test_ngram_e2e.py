"""Speculative decoding end to end with n-gram drafts (issue 33): whatever is drafted, the
engine's output is the target's own. Greedy token ids (and their logprobs) equal decoding
without speculation, with chunked prefill, preemption, length caps, penalties, stop strings,
structured outputs and n > 1; seeded sampling repeats; drafts are accepted on repetitive text
and counted with vLLM's metric names. A tiny random Llama on the CPU, in-process engines."""

from __future__ import annotations

import shutil

import pytest

from frontend.llm import LLM
from protocol.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_model

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}

# Repetitive prompts (the n-gram proposer finds their continuations) and plain ones.
PROMPTS = [
    [1, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7],
    [1, 40, 41, 42, 40, 41, 42, 40, 41],
    [1, 300, 17, 99, 250, 3, 77],
    [1, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 11, 12, 13, 14],
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from config.default_model import resolve_model_path

    path = make_tiny_model(tmp_path_factory.mktemp("spec") / "tiny", vocab_size=512)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(resolve_model_path(None) / name, path / name)
    return str(path)


def _llm(tiny: str, spec: dict | None, **kwargs) -> LLM:
    args = dict(device="cpu", max_model_len=128, kv_cache_memory="8MiB", block_size=8)
    args.update(kwargs)
    if spec is not None:
        args["speculative_config"] = spec
    return LLM(tiny, engine_process=False, **args)


def _ids(llm: LLM, prompts, params: SamplingParams) -> list[list[list[int]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


def _metric(llm: LLM, name: str) -> float:
    """A counter's value for this LLM's model (the snapshot is the process's: LLMs of other
    models add their own series; those of this model add to the same one, so compare
    before and after)."""
    model = llm.config.model.served_model_names[0]
    return sum(
        m.value for m in llm.get_metrics() if m.name == name and m.labels.get("model_name") == model
    )


def _accepted(llm: LLM) -> float:
    return _metric(llm, "vllm:spec_decode_num_accepted_tokens")


@pytest.fixture(scope="module")
def base(tiny):
    return _llm(tiny, None)


@pytest.fixture(scope="module")
def spec(tiny):
    return _llm(tiny, NGRAM)


GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def test_greedy_equals_decoding_without_speculation_and_drafts_are_accepted(base, spec) -> None:
    before = _accepted(spec)
    assert _ids(spec, PROMPTS, GREEDY) == _ids(base, PROMPTS, GREEDY)
    # A random model's greedy text falls into loops the n-gram proposer predicts.
    assert _accepted(spec) > before
    assert _metric(spec, "vllm:spec_decode_num_drafts") > 0


def test_fused_decode_stack_verifies_drafts(tmp_path) -> None:
    """head_dim 64: the CPU's fused decode stack runs the verification steps (their 1 + k
    tokens as one-token rows whose keys and values are all written before any row attends),
    and the plain decode steps; greedy ids equal decoding without speculation."""
    from config.default_model import resolve_model_path
    from gpu_worker.models import fused_decode

    path = make_tiny_model(
        tmp_path / "h64",
        vocab_size=512,
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(resolve_model_path(None) / name, path / name)
    rows: list[int] = []
    run = fused_decode.FusedDecode.run

    def counted(self, x, cos, sin):
        out = run(self, x, cos, sin)
        if out is not None:
            rows.append(x.shape[0])
        return out

    # The stack takes blocks of 16 tokens (and head_dim 64 or 128).
    want = _ids(_llm(str(path), None, block_size=16), PROMPTS, GREEDY)
    fused_decode.FusedDecode.run = counted
    try:
        got = _ids(_llm(str(path), NGRAM, block_size=16), PROMPTS, GREEDY)
    finally:
        fused_decode.FusedDecode.run = run
    assert got == want
    assert max(rows) > len(PROMPTS)  # a verification step ran fused (more rows than requests)


def test_one_request_at_a_time(base, spec) -> None:
    for prompt in PROMPTS:
        assert _ids(spec, [prompt], GREEDY) == _ids(base, [prompt], GREEDY)


def test_logprobs_equal(base, spec) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2, ignore_eos=True)
    got = spec.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    want = base.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert len(g.outputs[0].logprobs) == len(w.outputs[0].logprobs) == 24
        for gp, wp in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert gp.keys() == wp.keys()
            for t in gp:
                assert gp[t].logprob == pytest.approx(wp[t].logprob, abs=1e-4)
                assert gp[t].rank == wp[t].rank


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),  # length cap mid-draft
        SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, presence_penalty=0.5, frequency_penalty=0.3),
        SamplingParams(temperature=0.0, max_tokens=30, min_tokens=20, stop_token_ids=[41, 6]),
        SamplingParams(temperature=0.0, max_tokens=30, logit_bias={7: 3.0, 41: -2.0}),
    ],
    ids=["max_tokens", "repetition", "presence_frequency", "min_tokens_stop_ids", "logit_bias"],
)
def test_sampling_options_equal(base, spec, params) -> None:
    assert _ids(spec, PROMPTS, params) == _ids(base, PROMPTS, params)


def test_stop_strings_equal(base, spec) -> None:
    text = base.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)[0]
    stop = text.outputs[0].text[8:11]
    if not stop.strip():
        pytest.skip("the tiny model's text has no stop string to pick")
    params = SamplingParams(temperature=0.0, max_tokens=40, stop=[stop])
    got = spec.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    want = base.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in want]


def test_seeded_sampling_repeats_and_n_gives_distinct_samples(spec) -> None:
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, seed=7, n=3)
    first = _ids(spec, PROMPTS[:2], params)
    assert first == _ids(spec, PROMPTS[:2], params)
    assert all(len(set(map(tuple, samples))) > 1 for samples in first)


@pytest.mark.parametrize("regex", ["(ab|cd){2,5}", "(tic tac toe ){6}(end|stop)"])
def test_structured_output_equal_with_drafts_checked_against_the_grammar(base, spec, regex) -> None:
    """A constrained request verifies drafts too: only those its grammar allows (checked in
    the scheduler), each verification row masked by the grammar's state after the drafts
    before it. A repetitive pattern gets drafts accepted."""
    from protocol.sampling_params import StructuredOutputsParams

    params = SamplingParams(
        temperature=0.0, max_tokens=48, structured_outputs=StructuredOutputsParams(regex=regex)
    )
    before = _accepted(spec)
    got = spec.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    want = base.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    if "toe" in regex:
        assert all(o.outputs[0].text.startswith("tic tac toe ") for o in got)
        assert _accepted(spec) > before


def test_chunked_prefill_and_preemption_equal(tiny, base) -> None:
    long_prompts = [p * 3 for p in PROMPTS]
    want = _ids(base, long_prompts, GREEDY)
    chunked = _llm(tiny, NGRAM, max_num_batched_tokens=16)
    assert _ids(chunked, long_prompts, GREEDY) == want
    # 24 blocks of 8 tokens: four requests growing to ~100 tokens cannot all stay resident.
    tight = _llm(tiny, NGRAM, num_gpu_blocks_override=24, enable_prefix_caching=True)
    before = _metric(tight, "vllm:num_preemptions")
    assert _ids(tight, long_prompts, GREEDY) == want
    assert _metric(tight, "vllm:num_preemptions") > before


def test_prefix_cache_reuse_equal(tiny, base) -> None:
    llm = _llm(tiny, NGRAM, enable_prefix_caching=True)
    want = _ids(base, PROMPTS, GREEDY)
    assert _ids(llm, PROMPTS, GREEDY) == want
    before = _metric(llm, "vllm:prefix_cache_hits")
    assert _ids(llm, PROMPTS, GREEDY) == want  # the second time from cached blocks
    assert _metric(llm, "vllm:prefix_cache_hits") > before


def test_tensor_parallel_equal(tiny, base) -> None:
    """TP=2 over gloo: rank 0 replies, every rank applies the same drafts and verdicts."""
    llm = _llm(tiny, NGRAM, tensor_parallel_size=2)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    before = _accepted(llm)
    assert _ids(llm, PROMPTS, params) == _ids(base, PROMPTS, params)
    assert _accepted(llm) > before
    seeded = SamplingParams(temperature=1.0, max_tokens=16, seed=3)
    assert _ids(llm, PROMPTS, seeded) == _ids(llm, PROMPTS, seeded)
