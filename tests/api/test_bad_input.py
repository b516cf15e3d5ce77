"""Hostile and malformed bodies: each gets a 4xx in OpenAI's error shape
{"error": {"message", "type", "param", "code"}} (never a 5xx, never a hang), and the server
keeps serving afterwards."""

from __future__ import annotations

import http.client
import json
import socket
import urllib.parse

import pytest

from tests.api.conftest import API_KEY, MAX_BODY, MODEL

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Hi"}]


def _post(
    server, path: str, raw: bytes, content_type: str = "application/json", timeout: float = 30
) -> tuple[int, bytes]:
    """POST raw bytes on a fresh connection; (status, body). A hang fails by the timeout."""
    url = urllib.parse.urlsplit(server.api_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    try:
        conn.request(
            "POST",
            path,
            body=raw,
            headers={
                "Content-Type": content_type,
                "Authorization": f"Bearer {API_KEY}",
                "Connection": "close",
            },
        )
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _js(obj) -> bytes:
    return json.dumps(obj).encode()


def _deep(obj, depth: int) -> bytes:
    """obj as JSON with its "DEEP" string replaced by {"a": {"a": ... 1}} depth levels deep
    (json.dumps itself would recurse too deep)."""
    return _js(obj).replace(b'"DEEP"', b'{"a": ' * depth + b"1" + b"}" * depth)


CASES = {
    # not JSON / not an object
    "empty body": (COMPLETIONS, b""),
    "malformed json": (COMPLETIONS, b'{"model": "tiny", "prompt": '),
    "trailing garbage": (COMPLETIONS, _js({"model": MODEL, "prompt": PROMPT}) + b"xyz"),
    "json array": (COMPLETIONS, _js([{"model": MODEL, "prompt": PROMPT}])),
    "json string": (CHAT, _js("hello")),
    "json null": (CHAT, b"null"),
    "non-utf8 body": (COMPLETIONS, b'{"model": "tiny", "prompt": "\xff\xfe\x80"}'),
    "non-utf8 bare": (CHAT, b"\xff\xfe\xfd\x00\x01"),
    "nan literal": (COMPLETIONS, b'{"model": "tiny", "prompt": "x", "temperature": NaN}'),
    # wrong types
    "max_tokens string": (
        COMPLETIONS,
        _js({"model": MODEL, "prompt": PROMPT, "max_tokens": "ten"}),
    ),
    "messages not a list": (CHAT, _js({"model": MODEL, "messages": "hello"})),
    "messages of strings": (CHAT, _js({"model": MODEL, "messages": ["hello"]})),
    "message without role": (CHAT, _js({"model": MODEL, "messages": [{"content": "x"}]})),
    "unknown role": (CHAT, _js({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]})),
    "prompt a number": (COMPLETIONS, _js({"model": MODEL, "prompt": 42})),
    "prompt an object": (COMPLETIONS, _js({"model": MODEL, "prompt": {"a": 1}})),
    "prompt ids of floats": (COMPLETIONS, _js({"model": MODEL, "prompt": [1.5, 2.5]})),
    "prompt missing": (COMPLETIONS, _js({"model": MODEL})),
    "n a bool": (COMPLETIONS, _js({"model": MODEL, "prompt": PROMPT, "n": True})),
    "stop a number": (COMPLETIONS, _js({"model": MODEL, "prompt": PROMPT, "stop": 5})),
    "logit_bias bad key": (
        COMPLETIONS,
        _js({"model": MODEL, "prompt": PROMPT, "logit_bias": {"abc": 1}}),
    ),
    "stream a string": (COMPLETIONS, _js({"model": MODEL, "prompt": PROMPT, "stream": "yes"})),
    # unknown fields and models
    "unknown field": (COMPLETIONS, _js({"model": MODEL, "prompt": PROMPT, "frobnicate": 1})),
    "unknown nested field": (
        CHAT,
        _js({"model": MODEL, "messages": [{"role": "user", "content": "x", "frobnicate": 1}]}),
    ),
    "unknown model": (COMPLETIONS, _js({"model": "no-such-model", "prompt": PROMPT})),
    # huge or out-of-range values
    "max_tokens 2**70": (COMPLETIONS, _js({"model": MODEL, "prompt": PROMPT, "max_tokens": 2**70})),
    "max_tokens negative": (COMPLETIONS, _js({"model": MODEL, "prompt": PROMPT, "max_tokens": -1})),
    "n 1e6": (COMPLETIONS, _js({"model": MODEL, "prompt": PROMPT, "n": 10**6})),
    "n 0": (COMPLETIONS, _js({"model": MODEL, "prompt": PROMPT, "n": 0})),
    "chat n 1e6": (CHAT, _js({"model": MODEL, "messages": MESSAGES, "n": 10**6})),
    "temperature overflow": (
        COMPLETIONS,
        b'{"model": "tiny", "prompt": "x", "temperature": 1e400}',
    ),
    "temperature negative": (
        COMPLETIONS,
        _js({"model": MODEL, "prompt": PROMPT, "temperature": -1}),
    ),
    "top_p 2": (COMPLETIONS, _js({"model": MODEL, "prompt": PROMPT, "top_p": 2.0})),
    "logprobs 1e6": (COMPLETIONS, _js({"model": MODEL, "prompt": PROMPT, "logprobs": 10**6})),
    "logit_bias huge": (
        COMPLETIONS,
        _js({"model": MODEL, "prompt": PROMPT, "logit_bias": {"5": 1e308}}),
    ),
    "token id out of range": (COMPLETIONS, _js({"model": MODEL, "prompt": [10**9]})),
    "negative token id": (COMPLETIONS, _js({"model": MODEL, "prompt": [-1]})),
    "empty prompt list": (COMPLETIONS, _js({"model": MODEL, "prompt": []})),
    "token id 2**70": (COMPLETIONS, _js({"model": MODEL, "prompt": [2**70]})),
    "stop_token_ids 2**70": (
        COMPLETIONS,
        _js({"model": MODEL, "prompt": PROMPT, "stop_token_ids": [2**70]}),
    ),
    "logit_bias key 2**70": (
        COMPLETIONS,
        _js({"model": MODEL, "prompt": PROMPT, "logit_bias": {str(2**70): 1}}),
    ),
    "n 129": (COMPLETIONS, _js({"model": MODEL, "prompt": PROMPT, "n": 129})),
    "seed 2**70": (COMPLETIONS, _js({"model": MODEL, "prompt": PROMPT, "seed": 2**70})),
    "prompt longer than the model": (COMPLETIONS, _js({"model": MODEL, "prompt": [1] * 1000})),
    # prompt + max_tokens beyond the context: refused, as OpenAI and vLLM's server do
    "max_tokens 1e12": (COMPLETIONS, _js({"model": MODEL, "prompt": PROMPT, "max_tokens": 10**12})),
    "chat max_tokens 1e12": (
        CHAT,
        _js({"model": MODEL, "messages": MESSAGES, "max_tokens": 10**12}),
    ),
    "max_completion_tokens past the context": (
        CHAT,
        _js({"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 256}),
    ),
    # a prompt of many token ids, just under and just over the body limit
    "many ids within the body limit": (
        COMPLETIONS,
        _js({"model": MODEL, "prompt": [1] * ((MAX_BODY - 100) // 3)}),
    ),
    "10**6 ids beyond the body limit": (COMPLETIONS, _js({"model": MODEL, "prompt": [1] * 10**6})),
    # deeply nested JSON
    "deep nesting": (
        COMPLETIONS,
        b'{"model": "tiny", "prompt": ' + b"[" * 10000 + b"]" * 10000 + b"}",
    ),
    # deeply nested free-form fields (RecursionError 500s before the depth limit)
    "deep chat_template_kwargs": (
        CHAT,
        _deep({"model": MODEL, "messages": MESSAGES, "chat_template_kwargs": {"a": "DEEP"}}, 5000),
    ),
    "chat_template_kwargs 900 deep": (
        CHAT,
        _deep({"model": MODEL, "messages": MESSAGES, "chat_template_kwargs": {"a": "DEEP"}}, 900),
    ),
    "deep tool parameters": (
        CHAT,
        _deep(
            {
                "model": MODEL,
                "messages": MESSAGES,
                "tools": [{"type": "function", "function": {"name": "f", "parameters": "DEEP"}}],
            },
            900,
        ),
    ),
    "deep response_format schema": (
        CHAT,
        _deep(
            {
                "model": MODEL,
                "messages": MESSAGES,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": "DEEP"},
                },
            },
            5000,
        ),
    ),
    "deep structured_outputs": (
        COMPLETIONS,
        _deep({"model": MODEL, "prompt": PROMPT, "structured_outputs": {"json": "DEEP"}}, 900),
    ),
    "deep prediction": (
        CHAT,
        _deep({"model": MODEL, "messages": MESSAGES, "prediction": "DEEP"}, 5000),
    ),
    "deep invocations": (
        "/invocations",
        b'{"prompt": "x", "a": ' + b"[" * 100000 + b"]" * 100000 + b"}",
    ),
    "deep tokenize kwargs": (
        "/tokenize",
        _deep({"messages": MESSAGES, "chat_template_kwargs": {"a": "DEEP"}}, 900),
    ),
    # integers beyond 64 bits in any field (the IPC encoder overflowed: a 500)
    "priority 2**70": (COMPLETIONS, _js({"model": MODEL, "prompt": PROMPT, "priority": 2**70})),
    "chat top_logprobs 2**70": (
        CHAT,
        _js({"model": MODEL, "messages": MESSAGES, "logprobs": True, "top_logprobs": 2**70}),
    ),
    "detokenize 2**70": ("/detokenize", _js({"tokens": [2**70]})),
    # token ids checked before echo decodes them
    "echo negative token id": (
        COMPLETIONS,
        _js({"model": MODEL, "prompt": [-1, 5], "echo": True, "max_tokens": 1}),
    ),
    "echo out-of-vocabulary token id": (
        COMPLETIONS,
        _js({"model": MODEL, "prompt": [[10**6]], "echo": True, "logprobs": 1}),
    ),
}

NAMED = {  # the case and the field its 400 must name
    "priority 2**70": "priority",
    "chat top_logprobs 2**70": "top_logprobs",
    "detokenize 2**70": "tokens[0]",
    "echo negative token id": "prompt",
    "echo out-of-vocabulary token id": "prompt",
    "chat_template_kwargs 900 deep": "chat_template_kwargs",
    "deep tool parameters": "tools",
    "deep structured_outputs": "structured_outputs",
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_a_4xx_in_openai_shape(server, name):
    path, raw = CASES[name]
    status, body = _post(server, path, raw)
    assert 400 <= status < 500, (status, body[:500])
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert error["code"] == status and isinstance(error["type"], str)
    if name in NAMED:
        assert status == 400 and error["param"] == NAMED[name], error


def test_a_completion_past_the_context_is_refused_with_the_arithmetic(server):
    status, body = _post(
        server, COMPLETIONS, _js({"model": MODEL, "prompt": [5] * 200, "max_tokens": 100})
    )
    assert status == 400, body[:500]
    assert json.loads(body)["error"]["message"].startswith(
        "This model's maximum context length is 256 tokens. However, you requested 300 tokens "
        "(200 in the messages, 100 in the completion)."
    )


# Huge but valid: served, bounded by the context.
ACCEPTED = {
    "max_tokens filling the context": (
        COMPLETIONS,
        {"model": MODEL, "prompt": [5] * 200, "max_tokens": 56, "ignore_eos": True},
    ),
    "chat without max_tokens": (CHAT, {"model": MODEL, "messages": MESSAGES, "ignore_eos": True}),
    "temperature 1e308": (
        COMPLETIONS,
        {"model": MODEL, "prompt": PROMPT, "temperature": 1e308, "max_tokens": 4},
    ),
    "n 128": (COMPLETIONS, {"model": MODEL, "prompt": PROMPT, "n": 128, "max_tokens": 2}),
}


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_huge_but_valid_values_are_served(server, name):
    path, body = ACCEPTED[name]
    status, raw = _post(server, path, _js(body))
    assert status == 200, (status, raw[:500])
    out = json.loads(raw)
    usage = out["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= 256 * body.get("n", 1)
    assert len(out["choices"]) == body.get("n", 1)
    assert all(c["finish_reason"] == "length" for c in out["choices"])


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_a_body_that_does_not_decompress_is_a_400(server, encoding):
    url = urllib.parse.urlsplit(server.api_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    conn.request(
        "POST",
        COMPLETIONS,
        body=b"this is not compressed",
        headers={
            "Content-Type": "application/json",
            "Content-Encoding": encoding,
            "Authorization": f"Bearer {API_KEY}",
        },
    )
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    assert resp.status == 400, body[:500]
    assert "could not be read" in json.loads(body)["error"]["message"]


def _raw_exchange(server, request: bytes) -> bytes:
    """Send request bytes as they are (http.client refuses non-ASCII headers); the answer."""
    url = urllib.parse.urlsplit(server.api_url)
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


@pytest.mark.parametrize("key", [b"\xff\xfe", "t\u00e9st".encode(), "t\u00e9st".encode("latin-1")])
def test_a_non_utf8_or_non_ascii_api_key_is_a_401(server, key):
    body = _js({"model": MODEL, "prompt": PROMPT, "max_tokens": 1})
    answer = _raw_exchange(
        server,
        b"POST " + COMPLETIONS.encode() + b" HTTP/1.1\r\nHost: x\r\n"
        b"Authorization: Bearer " + key + b"\r\nContent-Type: "
        b"application/json\r\nConnection: close\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body,
    )
    assert answer.startswith(b"HTTP/1.1 401 "), answer[:300]


def test_expect_100_continue_over_the_limit_gets_413_before_the_body(server):
    head = (
        f"POST {COMPLETIONS} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nExpect: 100-continue\r\n"
        f"Content-Length: {MAX_BODY + 1}\r\n\r\n"
    ).encode()
    answer = _raw_exchange(server, head)  # the body is never sent
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:300]
    assert b"larger than the limit" in answer
    small = _js({"model": MODEL, "prompt": PROMPT, "max_tokens": 1})
    url = urllib.parse.urlsplit(server.api_url)
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(head.replace(str(MAX_BODY + 1).encode(), str(len(small)).encode()))
        assert sock.recv(100).startswith(b"HTTP/1.1 100 Continue"), "no 100 within the limit"
        sock.sendall(small)
        assert sock.recv(100).startswith(b"HTTP/1.1 200 ")


def test_wrong_content_type_and_form_body(server):
    status, body = _post(
        server,
        COMPLETIONS,
        b"model=tiny&prompt=hi",
        content_type="application/x-www-form-urlencoded",
    )
    assert 400 <= status < 500, (status, body[:500])
    assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}


def test_server_still_serves_after_bad_input(server, client):
    for name in CASES:  # again, back to back, then a valid request
        _post(server, *CASES[name])
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    assert chat.choices[0].message.content is not None
