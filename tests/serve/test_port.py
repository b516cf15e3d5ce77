"""The port is ours alone: the API servers accept from one listening socket the launcher made
without SO_REUSEPORT, so a second `engine serve` on a busy port fails at start-up naming it
(it used to start "ready" and take half of the first one's connections)."""

from __future__ import annotations

import json
import time
import urllib.request

from tests.serve.conftest import Server


def _completion(url: str) -> dict:
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps({"prompt": "Hello", "max_tokens": 2}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.headers["X-Engine-Api-Server"] in ("0", "1")
        return json.loads(resp.read())


def test_a_second_server_on_a_busy_port_fails_at_start_up(tiny_args):
    first = Server([*tiny_args, "--api-server-count", "2"])
    try:
        assert first.ready and first.api_url, first.stderr
        port = first.api_url.rsplit(":", 1)[1]
        started = time.monotonic()
        second = Server([*tiny_args, "--port", port])
        assert not second.ready
        assert second.proc.wait(timeout=60) != 0
        assert f"cannot listen on 127.0.0.1:{port}" in second.stderr, second.stderr
        assert "Address already in use" in second.stderr, second.stderr
        assert time.monotonic() - started < 30  # before any model loads
        for _ in range(8):  # every connection still reaches the first server
            assert _completion(first.api_url)["usage"]["completion_tokens"] == 2
    finally:
        assert first.stop() == 0, first.stderr
