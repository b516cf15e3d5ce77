"""The data-parallel rendezvous (serve/dp_rendezvous.py) with the engine's shared secret:
only holders of the secret register ranks; a headless host with another key or none is told
its key was refused, at once, instead of waiting out the timeout."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import zmq

from serve.dp_rendezvous import FirstHost, HeadlessHost, RendezvousError

SECRET = "rendezvous-test-secret"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def first_host():
    ctx = zmq.Context()
    host = FirstHost(ctx, "127.0.0.1", _free_port(), size=2, first_remote=1, auth_key=SECRET)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            host.poll(0.05)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield host
    stop.set()
    thread.join(timeout=5)
    host.stop(failed=False)
    ctx.term()


def _register(host: FirstHost, key: str | None, timeout_s: float = 10.0) -> None:
    ctx = zmq.Context()
    port = int(host.address.rsplit(":", 1)[1])
    headless = HeadlessHost(ctx, "127.0.0.1", port, key)
    try:
        headless.register(1, ["tcp://10.0.0.2:5555"], timeout_s, lambda: None)
    finally:
        headless.close()
        ctx.term()


def test_a_holder_of_the_secret_registers(first_host):
    _register(first_host, SECRET)
    assert first_host.addresses == {1: "tcp://10.0.0.2:5555"} and first_host.missing() == []


@pytest.mark.parametrize("key", [None, "another-secret"])
def test_another_key_is_refused_at_once(first_host, key):
    start = time.monotonic()
    with pytest.raises(RendezvousError, match="refused this client's key|CURVE handshake"):
        _register(first_host, key, timeout_s=10.0)
    assert time.monotonic() - start < 5.0  # told, not timed out
    assert first_host.addresses == {}
