"""Fixtures: one `engine serve` with two API servers and an API key, shared by the page's tests."""

from __future__ import annotations

import json
import urllib.request

import pytest

from tests.serve.conftest import Server, tiny_args, tiny_model  # noqa: F401 - fixtures

API_KEY = "ui-test-key"
MODEL = "tiny"


@pytest.fixture(scope="session")
def ui_server(tiny_model):
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
            "--api-key",
            API_KEY,
            "--api-server-count",
            "2",
        ]
    )
    assert srv.ready and srv.api_url, srv.stderr
    yield srv
    assert srv.stop() == 0, srv.stderr


def get(url: str, key: str | None = API_KEY, body: dict | None = None) -> tuple[int, dict, bytes]:
    """(status, headers, body) of a GET (or a POST of body as JSON), with the key if given."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def metrics_now(api_url: str) -> dict[str, float]:
    """/metrics's samples summed over label sets (sample name -> value)."""
    from prometheus_client.parser import text_string_to_metric_families

    _, _, body = get(api_url + "/metrics", key=None)
    totals: dict[str, float] = {}
    counts: dict[str, int] = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            if "le" in s.labels:
                continue
            totals[s.name] = totals.get(s.name, 0.0) + s.value
            counts[s.name] = counts.get(s.name, 0) + 1
    # The page averages KV cache usage over engines (a fraction, not a count).
    usage = "vllm:kv_cache_usage_perc"
    if usage in totals:
        totals[usage] /= counts[usage]
    return totals
