"""Request decoding and refusals, without a server."""

from __future__ import annotations

import msgspec
import pytest

from frontend.api_server import openapi_schema
from frontend.errors import ApiError, from_decode_error
from frontend.openai_protocol import ChatCompletionRequest, CompletionRequest, check_unsupported
from frontend.serving_chat import chat_messages


def _param(body: bytes, struct) -> str | None:
    with pytest.raises(msgspec.MsgspecError) as info:
        msgspec.json.decode(body, type=struct)
    return from_decode_error(info.value).param


def test_decode_errors_name_the_field():
    assert _param(b'{"prompt": "x", "max_tokens": "a"}', CompletionRequest) == "max_tokens"
    assert _param(b'{"prompt": "x", "tools": []}', CompletionRequest) == "tools"
    assert _param(b'{"messages": [{"role": 1}]}', ChatCompletionRequest) == "messages[0].role"
    assert (
        _param(b'{"messages": [{"role": "user", "x": 1}]}', ChatCompletionRequest)
        == "messages[0].x"
    )
    assert _param(b'{"max_tokens": 3}', CompletionRequest) == "prompt"
    assert _param(b'{"messages": [{"content": "x"}]}', ChatCompletionRequest) == "messages[0].role"


@pytest.mark.parametrize(
    "body,param",
    [
        (dict(prompt="x", suffix="y"), "suffix"),
        (dict(prompt="x", best_of=2), "best_of"),
        (dict(prompt="x", logit_bias={"5": 101}), "logit_bias"),
        (dict(prompt="x", stream_options={"include_usage": True}), "stream_options"),
    ],
)
def test_unsupported_completion_fields(body, param):
    req = msgspec.convert(body, CompletionRequest)
    with pytest.raises(ApiError) as info:
        check_unsupported(req)
    assert info.value.status == 400 and info.value.param == param


@pytest.mark.parametrize(
    "extra,param",
    [
        (dict(functions=[]), "functions"),
        (dict(function_call="auto"), "function_call"),
        (dict(prediction={"type": "content", "content": "x"}), "prediction"),
    ],
)
def test_unsupported_chat_fields(extra, param):
    req = msgspec.convert(
        dict(messages=[{"role": "user", "content": "hi"}], **extra), ChatCompletionRequest
    )
    with pytest.raises(ApiError) as info:
        check_unsupported(req)
    assert info.value.param == param


def test_chat_messages():
    req = msgspec.convert(
        dict(
            messages=[
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ]
        ),
        ChatCompletionRequest,
    )
    assert chat_messages(req.messages)[1]["content"] == [
        {"type": "text", "text": "a"},
        {"type": "text", "text": "b"},
    ]
    for bad, param in [
        ({"role": "function", "content": "x"}, "messages[0].role"),
        ({"role": "user", "content": "x", "tool_call_id": "c"}, "messages[0].tool_call_id"),
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": {}}]},
            "messages[0].content[0].type",
        ),
    ]:
        req = msgspec.convert(dict(messages=[bad]), ChatCompletionRequest)
        with pytest.raises(ApiError) as info:
            chat_messages(req.messages)
        assert info.value.param == param


def test_openapi_describes_every_endpoint():
    schema = openapi_schema()
    assert {
        "/health",
        "/version",
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
        "/tokenize",
        "/detokenize",
    } <= set(schema["paths"])
    assert "CompletionRequest" in schema["components"]["schemas"]
