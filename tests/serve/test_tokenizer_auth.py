"""--tokenizer-listen on TCP with the shared secret (issue 15, item 7): ENGINE_CORE_KEY makes
every tokenizer socket a CurveZMQ server (ipc/curve.py) that serves holders of the
secret and tells others why at once; a public address without a secret warns."""

from __future__ import annotations

import asyncio
import socket

import pytest

from protocol.sampling_params import SamplingParams
from protocol.tokenizer import GenerateRequest
from tests.serve.conftest import Server, http_request
from tokenizer_proc.client import BlockingTokenizerClient, TokenizerClient

SECRET = "correct horse battery staple"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tokenizer_listen_with_a_shared_secret(tiny_args, monkeypatch):
    monkeypatch.delenv("ENGINE_CORE_KEY", raising=False)
    address = f"tcp://127.0.0.1:{_free_port()}"
    server = Server([*tiny_args, "--tokenizer-listen", address], env={"ENGINE_CORE_KEY": SECRET})
    assert server.ready, server.stderr
    try:
        # The whole tree holds the secret: HTTP -> tokenizer process -> engine core.
        status, _, body = http_request(
            server, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 4}
        )
        assert status == 200, body
        client = BlockingTokenizerClient([address], auth_key=SECRET)
        try:
            deltas = client.generate(
                GenerateRequest("held", SamplingParams(max_tokens=4), prompt="Hi")
            )
            assert sum(len(d.token_ids) for d in deltas) == 4
        finally:
            client.close()
        for key in (None, "another secret"):
            with pytest.raises(ConnectionError, match="refused this client's key|CURVE"):
                BlockingTokenizerClient([address], auth_key=key, timeout=10)
        with pytest.raises(ConnectionError, match="ENGINE_CORE_KEY"):
            asyncio.run(TokenizerClient.create([address], auth_key="another secret", timeout=10))
    finally:
        assert server.stop() == 0, server.stderr
    assert "without authentication" not in server.stderr


def test_tokenizer_listen_on_a_public_address_without_a_secret_warns(tiny_args, monkeypatch):
    monkeypatch.delenv("ENGINE_CORE_KEY", raising=False)
    port = _free_port()
    server = Server([*tiny_args, "--tokenizer-listen", f"tcp://0.0.0.0:{port}"])
    assert server.ready, server.stderr
    assert server.stop() == 0, server.stderr
    assert f"tokenizer 0 listens on tcp://0.0.0.0:{port} without authentication" in server.stderr
