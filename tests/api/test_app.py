"""The aiohttp app in-process against a fake TokenizerClient: errors after streaming began,
503 when the engine is gone or the server drains."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from frontend.api_server import build_app
from frontend.server_state import STATE
from frontend.serving import ServingContext
from protocol.tokenizer import RequestDelta, RequestError
from tokenizer_proc.client import TokenizerRequestError


class FakeClient:
    """Yields two deltas, then fails the request as a dying engine core would."""

    def __init__(self) -> None:
        self.closed: list[str] = []

    async def generate(self, request):
        try:
            yield RequestDelta(request.request_id, 0, "Hello", [1], num_prompt_tokens=3)
            yield RequestDelta(request.request_id, 0, " world", [2], num_prompt_tokens=3)
            raise TokenizerRequestError(
                RequestError(request.request_id, "the engine core process 1 exited", 503)
            )
        finally:
            self.closed.append(request.request_id)


async def _with_client(fn, engine_alive=lambda: True):
    app = build_app(ServingContext("m", 256, 100, FakeClient(), None), engine_alive=engine_alive)
    async with TestClient(TestServer(app)) as client:
        return await fn(app, client)


def _events(text: str) -> list:
    return [line[len("data: ") :] for line in text.split("\n\n") if line.startswith("data: ")]


def test_error_after_streaming_began_is_an_event():
    async def run(app, client):
        resp = await client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "stream": True},
        )
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        return _events(await resp.text())

    events = asyncio.run(_with_client(run))
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 503 and "exited" in error["message"]
    chunks = [json.loads(e) for e in events[:-2]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Hello world"


def test_error_before_streaming_is_a_plain_error():
    async def run(app, client):
        resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        return resp.status, await resp.json()

    status, body = asyncio.run(_with_client(run))
    assert status == 503 and body["error"]["code"] == 503


@pytest.mark.parametrize("draining,alive", [(True, True), (False, False)])
def test_unavailable_gives_503(draining, alive):
    async def run(app, client):
        app[STATE].draining = draining
        health = await client.get("/health")
        resp = await client.post("/v1/completions", json={"prompt": "x"})
        return health.status, resp.status, await resp.json()

    health, status, body = asyncio.run(_with_client(run, engine_alive=lambda: alive))
    assert health == 503 and status == 503 and body["error"]["type"] == "ServiceUnavailableError"
