"""The LLM class takes vLLM's inputs and request fields: the prompt_token_ids keyword and
TokensPrompt dicts, allowed_token_ids, bad words, truncate_prompt_tokens, and refuses a priority
the fcfs policy cannot honour. Through the real model runner (async scheduling too) on a tiny
random model."""

from __future__ import annotations

import pytest

from frontend.llm import LLM, TokensPrompt
from protocol.sampling_params import SamplingParams
from tests.test_beam_search import tiny_path  # noqa: F401 - a fixture

PROMPT = [1, 17, 300, 42, 7, 99]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(tiny_path, request):
    return LLM(
        str(tiny_path),
        device="cpu",
        max_model_len=64,
        kv_cache_memory="8MiB",
        async_scheduling=request.param,
        engine_process=False,
    )


def ids(llm, prompts, params=GREEDY, **kwargs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False, **kwargs)]


def test_prompt_token_ids_keyword_and_tokens_prompts(llm):
    expected = ids(llm, [TokensPrompt(prompt_token_ids=PROMPT)])
    assert ids(llm, None, prompt_token_ids=PROMPT) == expected
    assert ids(llm, None, prompt_token_ids=[PROMPT, PROMPT[:3]])[0] == expected[0]
    assert ids(llm, [PROMPT, {"prompt_token_ids": PROMPT}]) == expected * 2
    with pytest.raises(ValueError, match="prompts or prompt_token_ids"):
        llm.generate(PROMPT, GREEDY, prompt_token_ids=PROMPT)


def test_bad_words_ban_a_token_only_after_its_prefix(llm):
    greedy = ids(llm, [PROMPT])[0]
    after = ids(
        llm,
        [PROMPT],
        SamplingParams(
            temperature=0.0, max_tokens=8, ignore_eos=True, bad_words_token_ids=[greedy[1:3]]
        ),
    )[0]
    assert after[:2] == greedy[:2] and after[2] != greedy[2]
    first = ids(
        llm,
        [PROMPT],
        SamplingParams(
            temperature=0.0, max_tokens=8, ignore_eos=True, bad_words_token_ids=[[greedy[0]]]
        ),
    )[0]
    assert greedy[0] not in first
    # A prefix only the prompt ends with does not count (vLLM looks at the output).
    prompt_prefix = ids(
        llm,
        [PROMPT],
        SamplingParams(
            temperature=0.0,
            max_tokens=8,
            ignore_eos=True,
            bad_words_token_ids=[[PROMPT[-1], greedy[0]]],
        ),
    )[0]
    assert prompt_prefix == greedy


def test_allowed_token_ids(llm):
    allowed = [3, 30, 300]
    for params in (
        SamplingParams(temperature=0.0, max_tokens=6, allowed_token_ids=allowed),
        SamplingParams(temperature=1.0, seed=3, max_tokens=6, allowed_token_ids=allowed),
    ):
        assert set(ids(llm, [PROMPT], params)[0]) <= set(allowed)


def test_truncate_prompt_tokens(llm):
    out = llm.generate(
        [PROMPT],
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, truncate_prompt_tokens=3),
        use_tqdm=False,
    )[0]
    assert out.prompt_token_ids == PROMPT[-3:]
    assert out.outputs[0].token_ids == ids(llm, [PROMPT[-3:]])[0]
    with pytest.raises(ValueError, match="greater than max_model_len"):
        llm.generate([PROMPT], SamplingParams(truncate_prompt_tokens=65))


def test_refusals(llm):
    with pytest.raises(ValueError, match="Priority scheduling is not enabled"):
        llm.generate([PROMPT], GREEDY, priority=[1])
    with pytest.raises(ValueError, match="allowed_token_ids token id 512"):
        llm.generate([PROMPT], SamplingParams(allowed_token_ids=[512]))
    with pytest.raises(ValueError, match="allowed_token_ids must not be empty"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)


def _metric(llm, name: str):
    # The snapshot is the process's, as vLLM's: other LLMs' series are in it too.
    model = llm.config.model.served_model_name
    found = [m for m in llm.get_metrics() if m.name == name and m.labels["model_name"] == model]
    assert len(found) == 1, [m.name for m in llm.get_metrics()]
    return found[0]


def test_get_metrics_counts_prompt_and_generated_tokens(llm):
    from metrics.reader import Counter, Gauge, Histogram

    llm.generate([PROMPT], GREEDY, use_tqdm=False)  # so that every series exists
    before = _metric(llm, "vllm:prompt_tokens").value
    llm.generate(
        [PROMPT, PROMPT],
        SamplingParams(temperature=0.0, max_tokens=4, n=2, ignore_eos=True),
        use_tqdm=False,
    )
    prompt = _metric(llm, "vllm:prompt_tokens")
    assert isinstance(prompt, Counter) and prompt.value - before == 4 * len(PROMPT)
    assert isinstance(_metric(llm, "vllm:num_requests_running"), Gauge)
    n = _metric(llm, "vllm:request_params_n")
    assert isinstance(n, Histogram) and n.count >= 2 and n.buckets["2.0"] >= 2
    e2e = _metric(llm, "vllm:e2e_request_latency_seconds")
    assert e2e.count >= 4 and e2e.buckets["+Inf"] == e2e.count and e2e.sum > 0
    assert _metric(llm, "vllm:request_params_max_tokens").count >= 4


def test_collective_rpc_and_sleep_are_refused(llm):
    with pytest.raises(NotImplementedError, match="collective_rpc is not supported"):
        llm.collective_rpc("get_model")
    with pytest.raises(NotImplementedError, match="sleep is not supported"):
        llm.sleep(level=1)
    with pytest.raises(NotImplementedError, match="wake_up is not supported"):
        llm.wake_up()
