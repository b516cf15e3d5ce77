"""Hostile and malformed bodies: each gets a 4xx in OpenAI's error shape
{"error": {"message", "type", "param", "code"}} (never a 5xx, never a hang), and the server
keeps serving afterwards."""

from __future__ import annotations

import http.client
import json
import urllib.parse

import pytest

from tests.api.conftest import API_KEY, MAX_BODY, MODEL

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Hi"}]


def _post(server, path: str, raw: bytes, content_type: str = "application/json",
          timeout: float = 30) -> tuple[int, bytes]:
    """POST raw bytes on a fresh connection; (status, body). A hang fails by the timeout."""
    url = urllib.parse.urlsplit(server.api_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    try:
        conn.request("POST", path, body=raw, headers={
            "Content-Type": content_type, "Authorization": f"Bearer {API_KEY}",
            "Connection": "close"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _js(obj) -> bytes:
    return json.dumps(obj).encode()


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
    "max_tokens string": (COMPLETIONS, _js({"model": MODEL, "prompt": PROMPT,
                                            "max_tokens": "ten"})),
    "messages not a list": (CHAT, _js({"model": MODEL, "messages": "hello"})),
    "messages of strings": (CHAT, _js({"model": MODEL, "messages": ["hello"]})),
    "message without role": (CHAT, _js({"model": MODEL, "messages": [{"content": "x"}]})),
    "unknown role": (CHAT, _js({"model": MODEL, "messages": [{"role": "wizard",
                                                              "content": "x"}]})),
    "prompt a number": (COMPLETIONS, _js({"model": MODEL, "prompt": 42})),
    "prompt an object": (COMPLETIONS, _js({"model": MODEL, "prompt": {"a": 1}})),
    "prompt ids of floats": (COMPLETIONS, _js({"model": MODEL, "prompt": [1.5, 2.5]})),
    "prompt missing": (COMPLETIONS, _js({"model": MODEL})),
    "n a bool": (COMPLETIONS, _js({"model": MODEL, "prompt": PROMPT, "n": True})),
    "stop a number": (COMPLETIONS, _js({"model": MODEL, "prompt": PROMPT, "stop": 5})),
    "logit_bias bad key": (COMPLETIONS, _js({"model": MODEL, "prompt": PROMPT,
                                             "logit_bias": {"abc": 1}})),
    "stream a string": (COMPLETIONS, _js({"model": MODEL, "prompt": PROMPT,
                                          "stream": "yes"})),
    # unknown fields and models
    "unknown field": (COMPLETIONS, _js({"model": MODEL, "prompt": PROMPT, "frobnicate": 1})),
    "unknown nested field": (CHAT, _js({"model": MODEL, "messages": [
        {"role": "user", "content": "x", "frobnicate": 1}]})),
    "unknown model": (COMPLETIONS, _js({"model": "no-such-model", "prompt": PROMPT})),
    # huge or out-of-range values
    "max_tokens 2**70": (COMPLETIONS, _js({"model": MODEL, "prompt": PROMPT,
                                           "max_tokens": 2**70})),
    "max_tokens negative": (COMPLETIONS, _js({"model": MODEL, "prompt": PROMPT,
                                              "max_tokens": -1})),
    "n 1e6": (COMPLETIONS, _js({"model": MODEL, "prompt": PROMPT, "n": 10**6})),
    "n 0": (COMPLETIONS, _js({"model": MODEL, "prompt": PROMPT, "n": 0})),
    "chat n 1e6": (CHAT, _js({"model": MODEL, "messages": MESSAGES, "n": 10**6})),
    "temperature overflow": (COMPLETIONS, b'{"model": "tiny", "prompt": "x", '
                                          b'"temperature": 1e400}'),
    "temperature negative": (COMPLETIONS, _js({"model": MODEL, "prompt": PROMPT,
                                               "temperature": -1})),
    "top_p 2": (COMPLETIONS, _js({"model": MODEL, "prompt": PROMPT, "top_p": 2.0})),
    "logprobs 1e6": (COMPLETIONS, _js({"model": MODEL, "prompt": PROMPT, "logprobs": 10**6})),
    "logit_bias huge": (COMPLETIONS, _js({"model": MODEL, "prompt": PROMPT,
                                          "logit_bias": {"5": 1e308}})),
    "token id out of range": (COMPLETIONS, _js({"model": MODEL, "prompt": [10**9]})),
    "negative token id": (COMPLETIONS, _js({"model": MODEL, "prompt": [-1]})),
    "empty prompt list": (COMPLETIONS, _js({"model": MODEL, "prompt": []})),
    "token id 2**70": (COMPLETIONS, _js({"model": MODEL, "prompt": [2**70]})),
    "stop_token_ids 2**70": (COMPLETIONS, _js({"model": MODEL, "prompt": PROMPT,
                                               "stop_token_ids": [2**70]})),
    "logit_bias key 2**70": (COMPLETIONS, _js({"model": MODEL, "prompt": PROMPT,
                                               "logit_bias": {str(2**70): 1}})),
    "n 129": (COMPLETIONS, _js({"model": MODEL, "prompt": PROMPT, "n": 129})),
    "seed 2**70": (COMPLETIONS, _js({"model": MODEL, "prompt": PROMPT, "seed": 2**70})),
    "prompt longer than the model": (COMPLETIONS, _js({"model": MODEL, "prompt": [1] * 1000})),
    # prompt + max_tokens beyond the context: refused, as OpenAI and vLLM's server do
    "max_tokens 1e12": (COMPLETIONS, _js({"model": MODEL, "prompt": PROMPT, "max_tokens": 10**12})),
    "chat max_tokens 1e12": (CHAT, _js({"model": MODEL, "messages": MESSAGES,
                                        "max_tokens": 10**12})),
    "max_completion_tokens past the context": (CHAT, _js({"model": MODEL, "messages": MESSAGES,
                                                          "max_completion_tokens": 256})),
    # a prompt of many token ids, just under and just over the body limit
    "many ids within the body limit": (COMPLETIONS, _js({"model": MODEL, "prompt": [1] * (
        (MAX_BODY - 100) // 3)})),
    "10**6 ids beyond the body limit": (COMPLETIONS, _js({"model": MODEL,
                                                          "prompt": [1] * 10**6})),
    # deeply nested JSON
    "deep nesting": (COMPLETIONS, b'{"model": "tiny", "prompt": ' + b"[" * 10000
                     + b"]" * 10000 + b"}"),
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


def test_a_completion_past_the_context_is_refused_with_the_arithmetic(server):
    status, body = _post(server, COMPLETIONS, _js({"model": MODEL, "prompt": [5] * 200,
                                                   "max_tokens": 100}))
    assert status == 400, body[:500]
    assert json.loads(body)["error"]["message"].startswith(
        "This model's maximum context length is 256 tokens. However, you requested 300 tokens "
        "(200 in the messages, 100 in the completion).")


# Huge but valid: served, bounded by the context.
ACCEPTED = {
    "max_tokens filling the context": (COMPLETIONS, {"model": MODEL, "prompt": [5] * 200,
                                                     "max_tokens": 56, "ignore_eos": True}),
    "chat without max_tokens": (CHAT, {"model": MODEL, "messages": MESSAGES,
                                       "ignore_eos": True}),
    "temperature 1e308": (COMPLETIONS, {"model": MODEL, "prompt": PROMPT, "temperature": 1e308,
                                        "max_tokens": 4}),
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


def test_wrong_content_type_and_form_body(server):
    status, body = _post(server, COMPLETIONS, b"model=tiny&prompt=hi",
                         content_type="application/x-www-form-urlencoded")
    assert 400 <= status < 500, (status, body[:500])
    assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}


def test_server_still_serves_after_bad_input(server, client):
    for name in CASES:  # again, back to back, then a valid request
        _post(server, *CASES[name])
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0.0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    assert chat.choices[0].message.content is not None
