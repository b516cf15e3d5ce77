"""Structured outputs after the reasoning (SamplingParams.reasoning_end_token_ids): on a tiny
random model, greedy, the tokens up to and including the reasoning's end are the unconstrained
model's own (no mask applied), and the answer after it obeys the grammar."""

from __future__ import annotations

import re

import pytest

from engine_core.structured_output.reasoning_gate import ReasoningGate
from engine_core.validation import InvalidRequestError
from frontend.llm import LLM
from protocol.sampling_params import SamplingParams, StructuredOutputsParams
from tests.tiny_models import make_tiny_model_with_tokenizer

DIGITS = StructuredOutputsParams(regex=r"[0-9]{6}")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_tiny_model_with_tokenizer(tmp_path_factory.mktemp("gate") / "tiny"))


def _llm(model, **kwargs):
    return LLM(
        model,
        engine_process=False,
        device="cpu",
        max_model_len=256,
        kv_cache_memory="16MiB",
        **kwargs,
    )


def _free(llm, prompt, n=24):
    [out] = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False
    )
    return out.outputs[0].token_ids


def test_gate_ends_on_any_sequence_and_stays_ended():
    gate = ReasoningGate([[7], [3, 4, 5]])
    for t in (1, 3, 4):
        gate.feed(t)
        assert not gate.ended
    gate.feed(5)
    assert gate.ended
    single = ReasoningGate([[7]])
    single.feed(7)
    assert single.ended


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_mask_applies_only_after_the_reasoning_ends(model, async_scheduling):
    llm = _llm(model, async_scheduling=async_scheduling)
    free = _free(llm, "Question:")
    # The end of the "reasoning": a token the free output first emits at position k >= 3.
    k = next(i for i in range(3, len(free)) if free[i] not in free[:i])
    params = SamplingParams(
        temperature=0.0,
        max_tokens=40,
        structured_outputs=DIGITS,
        reasoning_end_token_ids=[[free[k]]],
    )
    [out] = llm.generate(["Question:"], params, use_tqdm=False)
    ids = out.outputs[0].token_ids
    # Before and at the end token the model ran free: the same greedy tokens (which the
    # grammar would have refused).
    assert not re.fullmatch(r"[0-9]*", llm.tokenizer.decode(free[: k + 1]))
    assert ids[: k + 1] == free[: k + 1]
    answer = llm.tokenizer.decode(ids[k + 1 :], skip_special_tokens=True)
    assert re.fullmatch(r"[0-9]{6}", answer), answer
    assert out.outputs[0].finish_reason == "stop"
    # Without the gate the mask applies from the first token.
    [plain] = llm.generate(
        ["Question:"],
        [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=DIGITS)],
        use_tqdm=False,
    )
    assert re.fullmatch(r"[0-9]{6}", plain.outputs[0].text)


def test_reasoning_that_never_ends_is_unconstrained(model):
    llm = _llm(model)
    free = _free(llm, "Question:", n=16)
    never = next(t for t in range(1000, 2000) if t not in free)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=16,
        ignore_eos=True,
        structured_outputs=DIGITS,
        reasoning_end_token_ids=[[never, never]],
    )
    [out] = llm.generate(["Question:"], params, use_tqdm=False)
    assert out.outputs[0].token_ids == free
    assert out.outputs[0].finish_reason == "length"


def test_out_of_vocabulary_end_ids_are_refused(model):
    llm = _llm(model)
    params = SamplingParams(structured_outputs=DIGITS, reasoning_end_token_ids=[[10**9]])
    with pytest.raises(InvalidRequestError, match="reasoning_end token id"):
        llm.generate(["x"], params, use_tqdm=False)
    with pytest.raises(ValueError, match="non-empty"):
        SamplingParams(reasoning_end_token_ids=[[]])
