"""Fixtures: one `engine serve` with the tiny model and its OpenAI-compatible API per module."""

from __future__ import annotations

import pytest

from tests.serve.conftest import Server, tiny_model  # noqa: F401 - tiny_model is a fixture

API_KEY = "test-key"
MODEL = "tiny"
MAX_BODY = 256 * 1024


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
            "--api-key",
            API_KEY,
            "--max-request-body",
            str(MAX_BODY),
        ]
    )
    assert srv.ready and srv.api_url, srv.stderr
    yield srv
    assert srv.stop() == 0, srv.stderr


@pytest.fixture(scope="module")
def client(server):
    import openai

    c = openai.OpenAI(base_url=server.api_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    yield c
    c.close()
