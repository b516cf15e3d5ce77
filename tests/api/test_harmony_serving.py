"""The chat answer of a gpt-oss model (serving_chat's _ChatAnswer with a HarmonyChat) from the
engine deltas of completions harmony rendered: reasoning apart from content, calls as OpenAI
tool calls with finish_reason tool_calls, a stream's chunks putting back together the whole
answer; and the request fields harmony cannot serve refused with 400."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
import pytest

from frontend.chat_args import ChatOptions
from frontend.errors import ApiError
from frontend.openai_protocol import ChatCompletionRequest, ChatMessage
from frontend.serving import ServingContext
from frontend.serving_chat import _ChatAnswer
from frontend.serving_harmony import HarmonyChat, check_request, refuse_constraint
from frontend.tool_parsers.tool_choice import ToolChoice
from protocol.sampling_params import StructuredOutputsParams
from protocol.tokenizer import RequestDelta
from tests.api.harmony_vocab import encoding
from tests.api.test_harmony_output import ARGS, CASES, FINAL, REASONING, completion


def _ctx() -> ServingContext:
    enc = encoding()
    chat = HarmonyChat(enc, tuple(enc.stop_tokens_for_assistant_actions()))
    return ServingContext("gpt-oss", 256, 201088, None, None, harmony=chat)  # type: ignore[arg-type]


def _request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[ChatMessage(role="user", content="Hi")], **fields)


async def _deltas(tokens: list[int], reason: str, chunk: int):
    stop = tokens[-1] if reason == "stop" else None
    for i in range(0, len(tokens), chunk):
        last = i + chunk >= len(tokens)
        yield (
            0,
            RequestDelta(
                "chatcmpl-1",
                token_ids=tokens[i : i + chunk],
                finish_reason=reason if last else None,
                stop_reason=stop if last else None,
                num_prompt_tokens=10,
            ),
        )


def _respond(req, tokens, reason="stop", chunk=4) -> dict[str, Any]:
    answer = _ChatAnswer(_ctx(), req, ToolChoice(parallel=req.parallel_tool_calls), "chatcmpl-1")
    response = asyncio.run(answer.response(_deltas(tokens, reason, chunk)))
    return json.loads(msgspec.json.encode(response))


def _stream(req, tokens, reason="stop", chunk=4) -> list[dict[str, Any]]:
    answer = _ChatAnswer(_ctx(), req, ToolChoice(parallel=req.parallel_tool_calls), "chatcmpl-1")

    async def run():
        return [
            json.loads(msgspec.json.encode(c))
            async for c in answer.chunks(_deltas(tokens, reason, chunk))
        ]

    return asyncio.run(run())


def _reassembled(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """A stream's deltas put together as the message a whole answer carries."""
    out: dict[str, Any] = {"content": "", "reasoning": "", "reasoning_content": "", "calls": {}}
    finish = None
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            for name in ("content", "reasoning", "reasoning_content"):
                out[name] += delta.get(name) or ""
            for call in delta.get("tool_calls") or []:
                entry = out["calls"].setdefault(call["index"], {"name": None, "arguments": ""})
                if "id" in call:
                    assert call["id"].startswith("call_") and call["type"] == "function"
                    entry["name"] = call["function"]["name"]
                entry["arguments"] += call["function"].get("arguments", "")
            finish = choice.get("finish_reason") or finish
    out["finish_reason"] = finish
    return out


@pytest.mark.parametrize("chunk", [1, 5])
def test_reasoning_and_content_apart(chunk):
    tokens = completion(*CASES["analysis+final"])
    whole = _respond(_request(), tokens)["choices"][0]
    message = whole["message"]
    assert message["content"] == FINAL
    assert message["reasoning"] == message["reasoning_content"] == REASONING
    assert message["tool_calls"] is None and whole["finish_reason"] == "stop"
    streamed = _reassembled(_stream(_request(stream=True), tokens, chunk=chunk))
    assert streamed == {
        "content": FINAL,
        "reasoning": REASONING,
        "reasoning_content": REASONING,
        "calls": {},
        "finish_reason": "stop",
    }


@pytest.mark.parametrize("chunk", [1, 6])
def test_a_call_is_a_tool_call(chunk):
    tokens = completion(*CASES["analysis+call"])
    whole = _respond(_request(), tokens)["choices"][0]
    assert whole["finish_reason"] == "tool_calls"
    (call,) = whole["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": ARGS}
    assert whole["message"]["content"] is None
    assert whole["message"]["reasoning"] == REASONING
    streamed = _reassembled(_stream(_request(stream=True), tokens, chunk=chunk))
    assert streamed["calls"] == {0: {"name": "get_weather", "arguments": ARGS}}
    assert streamed["finish_reason"] == "tool_calls" and streamed["content"] == ""


def test_parallel_tool_calls_false_keeps_the_first_call():
    tokens = completion(*CASES["preamble+two calls"])
    whole = _respond(_request(parallel_tool_calls=False), tokens)["choices"][0]
    assert [c["function"]["name"] for c in whole["message"]["tool_calls"]] == ["get_weather"]
    assert whole["message"]["content"] == "Let me look that up."
    streamed = _reassembled(_stream(_request(stream=True, parallel_tool_calls=False), tokens))
    assert list(streamed["calls"]) == [0]


def test_length_mid_analysis_keeps_the_partial_reasoning():
    tokens = completion(*CASES["analysis+final"])
    cut = tokens[: tokens.index(200008) + 6]  # five tokens into the analysis message
    whole = _respond(_request(), cut, reason="length")["choices"][0]
    assert whole["finish_reason"] == "length" and whole["message"]["content"] is None
    assert REASONING.startswith(whole["message"]["reasoning"])
    streamed = _reassembled(_stream(_request(stream=True), cut, reason="length", chunk=1))
    assert streamed["reasoning"] == whole["message"]["reasoning"]
    assert streamed["finish_reason"] == "length"


def test_include_reasoning_false_drops_it():
    tokens = completion(*CASES["analysis+final"])
    message = _respond(_request(include_reasoning=False), tokens)["choices"][0]["message"]
    assert message["reasoning"] is None and message["content"] == FINAL
    streamed = _reassembled(_stream(_request(stream=True, include_reasoning=False), tokens))
    assert streamed["reasoning"] == "" and streamed["content"] == FINAL


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"continue_final_message": True, "add_generation_prompt": False},
            "continue_final_message",
        ),
        ({"chat_template": "{{ messages }}"}, "chat_template"),
        ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
        ({"use_beam_search": True}, "use_beam_search"),
    ],
)
def test_what_harmony_cannot_serve_is_refused(fields, param):
    with pytest.raises(ApiError) as e:
        check_request(_request(**fields))
    assert e.value.status == 400 and e.value.param == param
    assert "not supported for gpt-oss" in e.value.message


def test_the_tool_parser_flag_must_fit_the_model():
    """--tool-call-parser openai (vLLM's for gpt-oss) only for gpt-oss; gpt-oss no other."""
    ChatOptions(auto_tool_parser="openai").check_model_type("gpt_oss")
    ChatOptions().check_model_type("gpt_oss")
    ChatOptions(auto_tool_parser="hermes").check_model_type("qwen3")
    with pytest.raises(ValueError, match="reads gpt-oss's harmony tool calls"):
        ChatOptions(auto_tool_parser="openai").check_model_type("llama")
    with pytest.raises(ValueError, match="--tool-call-parser hermes cannot read"):
        ChatOptions(auto_tool_parser="hermes").check_model_type("gpt_oss")


def test_a_grammar_is_refused():
    with pytest.raises(ApiError, match="response_format and structured_outputs"):
        refuse_constraint(StructuredOutputsParams(json_object=True))
    refuse_constraint(None)


def test_reasoning_fields_for_other_models():
    """reasoning_effort reaches another model's template as a variable (vLLM's rule), is
    checked for every model; assistant messages' reasoning reaches the template."""
    from frontend.serving_chat import _generate_request, _validated_messages
    from protocol.sampling_params import SamplingParams

    ctx = ServingContext("llama", 256, 512, None, None)  # type: ignore[arg-type]
    req = _request(reasoning_effort="high", chat_template_kwargs={"enable_thinking": True})
    messages = _validated_messages(ctx, req)
    request = _generate_request(ctx, req, None, messages, SamplingParams(), ToolChoice())  # type: ignore[arg-type]
    assert request.chat_template_kwargs == {"enable_thinking": True, "reasoning_effort": "high"}
    with pytest.raises(ApiError, match="reasoning_effort must be one of low, medium, high"):
        _validated_messages(ctx, _request(reasoning_effort="max"))
    history = ChatCompletionRequest(
        messages=[
            ChatMessage(role="user", content="Hi"),
            ChatMessage(role="assistant", content="Hello", reasoning_content="Greet."),
        ]
    )
    assert _validated_messages(ctx, history)[1]["reasoning_content"] == "Greet."
    with pytest.raises(ApiError, match="only assistant messages carry reasoning"):
        _validated_messages(
            ctx, ChatCompletionRequest(messages=[ChatMessage(role="user", reasoning="x")])
        )


def test_without_the_generation_prompt_the_completion_opens_its_turn():
    tokens = encoding().encode("<|start|>assistant", allowed_special="all") + completion(
        *CASES["analysis+final"]
    )
    req = _request(add_generation_prompt=False)
    message = _respond(req, tokens)["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == (REASONING, FINAL)
    streamed = _reassembled(_stream(_request(add_generation_prompt=False, stream=True), tokens))
    assert (streamed["reasoning"], streamed["content"]) == (REASONING, FINAL)
