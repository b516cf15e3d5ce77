"""`engine serve --api-server-count 2`: fresh connections reach both API server processes
(each response names its process in X-Engine-Api-Server), and /metrics, whichever process
answers it, shows the same engine-wide totals."""

from __future__ import annotations

import collections
import json
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serve.conftest import Server, wait_until

MODEL = "tiny"
PROMPT = "The capital of France is"
REQUESTS = 24
MAX_TOKENS = 3


@pytest.fixture(scope="module")
def server(tiny_model):
    srv = Server(
        [
            "--model",
            str(tiny_model),
            "--device",
            "cpu",
            "--kv-cache-memory",
            "16MiB",
            "--max-model-len",
            "256",
            "--served-model-name",
            MODEL,
            "--api-server-count",
            "2",
        ]
    )
    assert srv.ready and srv.api_url, srv.stderr
    yield srv
    assert srv.stop() == 0, srv.stderr


def _fresh(server, path: str, body: dict | None = None) -> tuple[str, bytes]:
    """One request on its own connection: (X-Engine-Api-Server, body)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        server.api_url + path,
        data=data,
        method="POST" if data else "GET",
        headers={"Content-Type": "application/json", "Connection": "close"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.status == 200
        return resp.headers["X-Engine-Api-Server"], resp.read()


def _totals(text: str) -> dict[str, float]:
    want = (
        "vllm:request_success_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
    )
    out = dict.fromkeys(want, 0.0)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in out:
                out[s.name] += s.value
    return out


def test_both_api_servers_get_traffic_and_agree_on_metrics(server):
    names = sorted(n for n in server.children().values() if n.startswith("engine-api"))
    assert names == ["engine-api-0", "engine-api-1"]
    by_server: collections.Counter[str] = collections.Counter()
    prompt_tokens = 0
    for _ in range(REQUESTS):
        index, body = _fresh(
            server,
            "/v1/completions",
            {
                "model": MODEL,
                "prompt": PROMPT,
                "max_tokens": MAX_TOKENS,
                "temperature": 0.0,
                "ignore_eos": True,
            },
        )
        out = json.loads(body)
        assert out["choices"][0]["finish_reason"] == "length"
        prompt_tokens += out["usage"]["prompt_tokens"]
        by_server[index] += 1
    # Both processes wait on the one listening socket; fresh connections reach both.
    assert set(by_server) == {"0", "1"}, by_server

    expected = {
        "vllm:request_success_total": REQUESTS,
        "vllm:prompt_tokens_total": prompt_tokens,
        "vllm:generation_tokens_total": REQUESTS * MAX_TOKENS,
    }
    # The engine core may publish the last request's stats just after its response.
    assert wait_until(lambda: _totals(_fresh(server, "/metrics")[1].decode()) == expected, 5)
    seen: collections.Counter[str] = collections.Counter()
    for _ in range(24):
        index, text = _fresh(server, "/metrics")
        seen[index] += 1
        assert _totals(text.decode()) == expected, index
    assert set(seen) == {"0", "1"}, seen
