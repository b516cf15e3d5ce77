"""Property-based fuzzing of the request schemas: a thousand generated bodies per endpoint,
derived from frontend.openai_protocol's Structs (tests/api/request_strategies.py); none gets a
5xx, a streamed answer carries no internal error, and the server still answers correctly
afterwards. derandomize=True: the same bodies on every run, so CI is reproducible."""

from __future__ import annotations

import json
import math

import pytest
import requests
from hypothesis import HealthCheck, given, settings

from frontend.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tests.api.conftest import API_KEY, MODEL
from tests.api.request_strategies import request_bodies

FUZZ = settings(
    max_examples=1000,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
    ],
)

ENDPOINTS = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}


@pytest.fixture(scope="module")
def session(server):
    with requests.Session() as s:
        s.headers["Authorization"] = f"Bearer {API_KEY}"
        yield s


def _capped(path: str, body):
    """A body whose generation is cheap: a valid one generates at most 2 tokens."""
    if (
        path.startswith("/v1/")
        and isinstance(body, dict)
        and body.get("max_tokens") is None
        and body.get("max_completion_tokens") is None
    ):
        body = {**body, "max_tokens": 2}
    return body


def _send(server, session, path: str, body) -> None:
    text = json.dumps(body, allow_nan=True)
    resp = session.post(
        server.api_url + path,
        data=text.encode(),
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert resp.status_code < 500, (path, text[:2000], resp.status_code, resp.text[:1000])
    assert "InternalServerError" not in resp.text, (path, text[:2000], resp.text[:1000])


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_generated_bodies_never_get_a_5xx(server, session, path):
    @FUZZ
    @given(body=request_bodies(ENDPOINTS[path]))
    def fuzz(body):
        _send(server, session, path, _capped(path, body))

    fuzz()


def test_the_server_is_still_correct_after_fuzzing(server, session):
    assert session.get(server.api_url + "/health", timeout=30).status_code == 200
    resp = session.post(
        server.api_url + "/v1/completions",
        json={
            "model": MODEL,
            "prompt": "The capital of France is",
            "max_tokens": 4,
            "ignore_eos": True,
            "logprobs": 1,
        },
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "length" and resp.json()["usage"]["completion_tokens"] == 4
    assert all(math.isfinite(x) for x in choice["logprobs"]["token_logprobs"])
    chat = session.post(
        server.api_url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        timeout=60,
    )
    assert (
        chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant"
    ), chat.text
    ids = session.post(
        server.api_url + "/tokenize", json={"prompt": "hello world"}, timeout=30
    ).json()["tokens"]
    assert (
        session.post(server.api_url + "/detokenize", json={"tokens": ids}, timeout=30).json()[
            "prompt"
        ]
        == "hello world"
    )
