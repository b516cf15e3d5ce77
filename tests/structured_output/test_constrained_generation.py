"""Constrained generation end to end on a tiny random model (with the default model's tokenizer):
whatever the weights, every output obeys its constraint, through n > 1, seeds, penalties,
logprobs, chunked prefill, preemption, prefix caching and async scheduling."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine_core.validation import InvalidRequestError
from frontend.llm import LLM
from protocol.sampling_params import SamplingParams, StructuredOutputsParams
from tests.tiny_models import make_tiny_model_with_tokenizer

# Bounded: a random model must end it (after the closing brace only EOS is allowed).
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
        "tag": {"type": "string", "pattern": "^[a-z]{1,4}$"},
    },
    "required": ["ok", "n", "color", "tag"],
}
JSON = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
REGEX = StructuredOutputsParams(regex=r"(cat|dog)-[0-9]{2}")
CHOICE = StructuredOutputsParams(choice=["alpha", "beta", "gamma delta"])
GRAMMAR = StructuredOutputsParams(grammar='root ::= "(" num ("+" num)? ")"\nnum ::= [1-9]')
DIGITS = StructuredOutputsParams(regex=r"[0-9]{40}")  # this tokenizer spells digits one by one


def valid(constraint: StructuredOutputsParams, text: str) -> bool:
    if constraint is JSON:
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if constraint is REGEX:
        return re.fullmatch(r"(cat|dog)-[0-9]{2}", text) is not None
    if constraint is CHOICE:
        return text in CHOICE.choice
    if constraint is DIGITS:
        return re.fullmatch(r"[0-9]{40}", text) is not None
    return re.fullmatch(r"\([1-9](\+[1-9])?\)", text) is not None


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_tiny_model_with_tokenizer(tmp_path_factory.mktemp("so") / "tiny"))


def _llm(model, **kwargs):
    kwargs.setdefault("kv_cache_memory", "16MiB")
    return LLM(model, engine_process=False, device="cpu", max_model_len=256, **kwargs)


def _params(constraint, **kwargs):
    kwargs.setdefault("max_tokens", 60)
    kwargs.setdefault("temperature", 1.0)
    return SamplingParams(structured_outputs=constraint, **kwargs)


def _check(outputs, constraints):
    for out, constraint in zip(outputs, constraints):
        assert out.outputs, out
        for completion in out.outputs:
            assert completion.finish_reason == "stop", (constraint.kind, completion.text)
            assert valid(constraint, completion.text), (constraint.kind, completion.text)


@pytest.fixture(scope="module")
def llm(model):
    return _llm(model)


def test_every_kind_obeys_its_constraint_with_n_seeds_penalties_and_logprobs(llm):
    constraints = [JSON, REGEX, CHOICE, GRAMMAR]
    params = [
        _params(c, n=3, seed=i, presence_penalty=0.5, repetition_penalty=1.2, logprobs=3)
        for i, c in enumerate(constraints)
    ]
    outputs = llm.generate(["Answer:"] * 4, params, use_tqdm=False)
    _check(outputs, constraints)
    for out in outputs:
        for completion in out.outputs:
            # The mask applies before sampling: every sampled token had a finite logprob.
            chosen = [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)]
            assert all(v > float("-inf") for v in chosen)


def test_greedy_regex_with_one_answer_is_that_answer(llm):
    constraint = StructuredOutputsParams(regex=r"hello, world")
    [out] = llm.generate(["x"], _params(constraint, temperature=0.0), use_tqdm=False)
    assert out.outputs[0].text == "hello, world" and out.outputs[0].finish_reason == "stop"


def test_max_tokens_cuts_with_length(llm):
    constraint = StructuredOutputsParams(regex=r"[a-z]{40}")
    [out] = llm.generate(["x"], _params(constraint, max_tokens=3), use_tqdm=False)
    assert out.outputs[0].finish_reason == "length"
    assert re.fullmatch(r"[a-z]+", out.outputs[0].text)


def test_constrained_and_free_requests_share_steps(llm):
    params = [
        _params(JSON, seed=1),
        SamplingParams(max_tokens=20, ignore_eos=True),
        _params(CHOICE, seed=2),
    ]
    outputs = llm.generate(["a", "b", "c"], params, use_tqdm=False)
    _check([outputs[0], outputs[2]], [JSON, CHOICE])
    assert len(outputs[1].outputs[0].token_ids) == 20


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {"max_num_batched_tokens": 16, "enable_prefix_caching": True},  # chunked prefill
        {
            "num_gpu_blocks_override": 16,
            "block_size": 16,
            "enable_prefix_caching": False,
        },  # preemption
        {"async_scheduling": True},
    ],
    ids=["chunked-prefill", "preemption", "async"],
)
def test_engine_features_keep_outputs_valid(model, engine_kwargs):
    llm = _llm(model, **engine_kwargs)
    prompt = list(range(100, 148))  # three full blocks of 16: the first output needs a fourth
    constraints = [JSON, REGEX, CHOICE, GRAMMAR, DIGITS, DIGITS]
    outputs = llm.generate(
        [prompt] * len(constraints),
        [_params(c, seed=i) for i, c in enumerate(constraints)],
        use_tqdm=False,
    )
    _check(outputs, constraints)
    if "num_gpu_blocks_override" in engine_kwargs:
        assert llm.engine_core.totals.num_preemptions > 0


def test_real_model_greedy_json_is_valid_and_equal_with_async_scheduling():
    """The default model (its logits have margins a random model's lack, so a different batch
    shape under async scheduling cannot flip a greedy token)."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    constraint = StructuredOutputsParams(json=schema)
    messages = [{"role": "user", "content": "Describe Alice, who is 30, as JSON."}]
    params = [
        SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=constraint),
        SamplingParams(max_tokens=8, temperature=0.0),
    ]
    runs = []
    for async_scheduling in (False, True):
        llm = LLM(
            engine_process=False,
            max_model_len=512,
            kv_cache_memory="64MiB",
            async_scheduling=async_scheduling,
        )
        outputs = llm.chat([messages, messages], params, use_tqdm=False)
        jsonschema.validate(json.loads(outputs[0].outputs[0].text), schema)
        runs.append([o.outputs[0].token_ids for o in outputs])
    assert runs[0] == runs[1]


def test_a_bad_constraint_is_refused_before_anything_runs(llm):
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed"))
    with pytest.raises(ValueError, match="invalid structured_outputs.regex"):
        llm.generate(["x", "y"], [SamplingParams(), bad], use_tqdm=False)
    from protocol.engine_core import EngineCoreRequest

    with pytest.raises(InvalidRequestError, match="invalid structured_outputs.regex"):
        llm.engine_core.add_request(EngineCoreRequest("bad", [1, 2, 3], bad))


def test_equal_constraints_share_one_compile(llm):
    manager = llm.engine_core.scheduler.structured_output
    assert manager is not None
    a, b = (
        manager.request_grammar(JSON),
        manager.request_grammar(
            StructuredOutputsParams(json=json.dumps(SCHEMA), disable_any_whitespace=True)
        ),
    )
    assert a.compiled is b.compiled
    assert manager.request_grammar(REGEX).compiled is not a.compiled


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"enum": ["Paris", "Oslo"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city", "days"],
            },
        },
    }
]
TOOLS_TEMPLATE = (
    "{% if tools %}Tools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
    "{% if mood %}Mood: {{ mood }}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
)


def test_chat_renders_tools_and_template_kwargs_and_a_constrained_call_validates(llm):
    parameters = TOOLS[0]["function"]["parameters"]
    params = _params(StructuredOutputsParams(json=parameters, disable_any_whitespace=True))
    [out] = llm.chat(
        [{"role": "user", "content": "Weather in Paris?"}],
        params,
        tools=TOOLS,
        chat_template=TOOLS_TEMPLATE,
        chat_template_kwargs={"mood": "sunny"},
        use_tqdm=False,
    )
    prompt = llm.get_tokenizer().decode(out.prompt_token_ids)
    assert "Tools: get_weather" in prompt and "Mood: sunny" in prompt
    jsonschema.validate(json.loads(out.outputs[0].text), parameters)


def test_whitespace_between_json_tokens_is_bounded(llm):
    """Any whitespace is allowed (vLLM's default), but not without end: a random model, which
    would otherwise fill max_tokens with blanks, must close the object."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    constraint = StructuredOutputsParams(json=schema)
    outputs = llm.generate(
        ["x"] * 3, [_params(constraint, seed=i, max_tokens=400) for i in range(3)], use_tqdm=False
    )
    for out in outputs:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
