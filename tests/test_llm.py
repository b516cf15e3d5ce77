"""The offline LLM API through the scheduler: greedy equality with transformers under chunked
prefill, preemption and prefix caching, and the sampling parameters' documented behaviour."""

from __future__ import annotations

import pytest

from frontend.llm import LLM
from protocol.sampling_params import SamplingParams
from tests.hf_reference import NEW_TOKENS, greedy, prompt_ids

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=NEW_TOKENS)


def _assert_matches_hf(llm: LLM, prompts: dict[str, list[int]]) -> None:
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts.values()], GREEDY, use_tqdm=False
    )
    wrong = [
        name
        for name, out in zip(prompts, outputs)
        if out.outputs[0].token_ids != greedy(tuple(prompts[name]))[0]
    ]
    assert not wrong, f"differ from transformers: {wrong}"


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=1024, kv_cache_memory="256MiB")


def test_chunked_prefill_matches_transformers():
    llm = LLM(
        max_model_len=1024, kv_cache_memory="256MiB", max_num_batched_tokens=48, max_num_seqs=8
    )
    _assert_matches_hf(llm, prompt_ids())


def test_preemption_matches_transformers():
    llm = LLM(
        max_model_len=512,
        num_gpu_blocks_override=40,
        enable_prefix_caching=False,
        engine_process=False,
    )
    _assert_matches_hf(llm, prompt_ids())
    assert llm.engine_core.totals.num_preemptions > 0, "the KV cache should force preemption"


def test_async_scheduling_matches_transformers():
    # Step N+1 is scheduled while step N runs on the model thread, with chunked prefill and
    # preemption in play.
    llm = LLM(
        max_model_len=512,
        num_gpu_blocks_override=40,
        enable_prefix_caching=False,
        max_num_batched_tokens=96,
        engine_process=False,
        async_scheduling=True,
    )
    _assert_matches_hf(llm, prompt_ids())
    assert llm.engine_core.totals.num_preemptions > 0, "the KV cache should force preemption"


def test_prefix_caching_matches_transformers():
    llm = LLM(max_model_len=1024, kv_cache_memory="256MiB", enable_prefix_caching=True)
    ids = prompt_ids()
    shared = ids["p14"]
    prompts = {f"s{i}": shared + ids[f"p{i}"] for i in range(4)}
    _assert_matches_hf(llm, {"s0": prompts["s0"]})  # fills the cache
    hits_before = llm.get_engine_stats()["prefix_cache_hits"]
    _assert_matches_hf(llm, prompts)
    totals = llm.get_engine_stats()
    # Every prompt finds at least the shared prefix's full blocks in the cache.
    assert totals["prefix_cache_hits"] - hits_before >= 4 * (len(shared) // 16) * 16
    assert totals["prefix_cache_queries"] >= totals["prefix_cache_hits"]


def test_n_returns_distinct_samples(llm):
    out = llm.generate(
        "Once upon a time", SamplingParams(n=4, temperature=1.0, max_tokens=12), use_tqdm=False
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4


def test_seeded_sampling_is_reproducible(llm):
    params = SamplingParams(temperature=0.9, seed=123, max_tokens=12)
    a = llm.generate("Tell me a story", params, use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate(["Other prompt", "Tell me a story"], params, use_tqdm=False)[1]
    assert a == b.outputs[0].token_ids


def test_stop_string_is_excluded_from_text(llm):
    base = (
        llm.generate(
            "The capital of France is", SamplingParams(temperature=0, max_tokens=20), use_tqdm=False
        )[0]
        .outputs[0]
        .text
    )
    assert "Paris" in base
    out = llm.generate(
        "The capital of France is",
        SamplingParams(temperature=0, max_tokens=20, stop=["Paris"]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.text == base[: base.index("Paris")]
    assert out.finish_reason == "stop" and out.stop_reason == "Paris"
    kept = llm.generate(
        "The capital of France is",
        SamplingParams(
            temperature=0, max_tokens=20, stop=["Paris"], include_stop_str_in_output=True
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == base[: base.index("Paris") + len("Paris")]


def test_stop_token_ids_min_tokens_and_max_tokens(llm):
    base = (
        llm.generate(
            "1, 2, 3, 5, 8, 13,",
            SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
    )
    stop_id = base[3]
    out = llm.generate(
        "1, 2, 3, 5, 8, 13,",
        SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )[0].outputs[0]
    first = base.index(stop_id)
    assert out.token_ids == base[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    later = llm.generate(
        "1, 2, 3, 5, 8, 13,",
        SamplingParams(
            temperature=0, max_tokens=10, stop_token_ids=[stop_id], min_tokens=first + 2
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(later.token_ids) >= first + 2
    capped = llm.generate(
        "1, 2, 3", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert len(capped.token_ids) == 5 and capped.finish_reason == "length"


def test_eos_ends_generation(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=64),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == 2 and out.stop_reason is None
    assert "Paris" in out.text


def test_outputs_keep_input_order_and_fields(llm):
    prompts = ["a b c", [1000, 1001, 1002], {"prompt": "hello"}]
    outs = llm.generate(
        prompts, [SamplingParams(temperature=0, max_tokens=n) for n in (3, 4, 5)], use_tqdm=False
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 4, 5]
    assert outs[0].prompt == "a b c" and outs[1].prompt_token_ids == [1000, 1001, 1002]
    assert outs[2].prompt == "hello" and all(o.finished for o in outs)


def test_logprobs_in_request_output(llm):
    out = llm.generate(
        "Hello",
        SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2),
        use_tqdm=False,
    )[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == 4
    for token, position in zip(comp.token_ids, comp.logprobs):
        # Greedy: the sampled token is the top-1, so the top-3 already include it.
        assert token in position and position[token].rank == 1 and len(position) == 3
        assert sorted(lp.rank for lp in position.values()) == [1, 2, 3]
    assert comp.cumulative_logprob == pytest.approx(
        sum(p[t].logprob for t, p in zip(comp.token_ids, comp.logprobs))
    )
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(n=0), "n must"),
        (dict(max_tokens=0), "max_tokens"),
    ],
)
def test_invalid_sampling_params_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_invalid_requests_raise_before_scheduling(llm):
    with pytest.raises(ValueError, match="maximum context length is 1024"):
        llm.generate([[5] * 1500], use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 2, 49152]], use_tqdm=False)
    with pytest.raises(ValueError, match="max_logprobs"):
        llm.generate("hi", SamplingParams(logprobs=50), use_tqdm=False)
    # A bad prompt in a batch schedules nothing: the engine is idle afterwards.
    with pytest.raises(ValueError):
        llm.generate(["fine", [1, 2, 10**6]], use_tqdm=False)
    assert llm.get_engine_stats()["num_unfinished_requests"] == 0
