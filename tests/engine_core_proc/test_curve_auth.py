"""The engine core's TCP endpoint with a shared secret (ENGINE_CORE_KEY): holders of the secret
are served over an encrypted connection; a client with another key or none is told why at once;
an engine core that listens on a public address without a secret warns."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
import zmq

from engine_core.client import AsyncEngineCoreClient, EngineCoreClient, EngineDeadError
from ipc.curve import derive_keys, is_exposed
from tests.engine_core_proc.utils import collect, greedy_request

SECRET = "correct horse battery staple"


def _free_port() -> int:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    sock.close(linger=0)
    return port


@pytest.fixture(scope="module")
def secured(engine_args):
    """`engine core --listen tcp://127.0.0.1:PORT` with ENGINE_CORE_KEY set."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in engine_args.items()]
    for _attempt in range(3):
        # A port free when probed can be taken before the engine core binds it (by a process
        # of an earlier test still going away); then that process, not ours, would answer.
        address = f"tcp://127.0.0.1:{_free_port()}"
        proc = subprocess.Popen(
            [sys.executable, "-m", "serve.cli", "core", "--listen", address, *flags],
            env={**os.environ, "ENGINE_CORE_KEY": SECRET},
        )
        try:
            with EngineCoreClient(address, startup_timeout=120, auth_key=SECRET):
                break
        except EngineDeadError:
            proc.kill()
            proc.wait(timeout=30)
    else:
        pytest.fail("the secured engine core never answered on a free port")
    yield address
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


def test_holder_of_the_secret_is_served(secured):
    with EngineCoreClient(secured, auth_key=SECRET) as client:
        client.add_request(greedy_request("a", [5, 6, 7], max_tokens=4))
        tokens, reason = collect(client, {"a"})["a"]
        assert len(tokens) == 4 and str(reason) == "length"


def test_secret_from_the_environment(secured, monkeypatch):
    monkeypatch.setenv("ENGINE_CORE_KEY", SECRET)
    with EngineCoreClient(secured, startup_timeout=10) as client:
        assert client.ready is not None


@pytest.mark.parametrize("key", ["wrong secret", None])
def test_others_are_refused_quickly_and_told_why(secured, key, monkeypatch):
    monkeypatch.delenv("ENGINE_CORE_KEY", raising=False)
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="ENGINE_CORE_KEY"):
        EngineCoreClient(secured, startup_timeout=20, auth_key=key)
    assert time.monotonic() - start < 5


def test_async_client_refused_with_a_wrong_key(secured):
    async def connect():
        await AsyncEngineCoreClient.create(secured, startup_timeout=20, auth_key="nope")

    with pytest.raises(EngineDeadError, match="ENGINE_CORE_KEY"):
        asyncio.run(connect())


def test_async_client_with_the_secret(secured):
    async def connect():
        client = await AsyncEngineCoreClient.create(secured, startup_timeout=20, auth_key=SECRET)
        client.shutdown()
        return client.ready

    assert asyncio.run(connect()) is not None


def test_keys_are_derived_alike_and_differ_by_secret():
    a, b, c = derive_keys(SECRET), derive_keys(SECRET), derive_keys("other")
    assert a == b and a.server_public != c.server_public
    assert len(a.server_public) == len(a.client_secret) == 40  # Z85 of 32 bytes
    assert zmq.curve_public(a.client_secret) == a.client_public


@pytest.mark.parametrize(
    "address, exposed",
    [
        ("tcp://127.0.0.1:5555", False),
        ("tcp://localhost:5555", False),
        ("tcp://[::1]:5555", False),
        ("tcp://0.0.0.0:5555", True),
        ("tcp://*:5555", True),
        ("ipc:///tmp/x.sock", False),
    ],
)
def test_exposed_addresses(address, exposed):
    assert is_exposed(address) is exposed


def test_public_address_without_a_secret_warns(engine_args):
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in engine_args.items()]
    env = {k: v for k, v in os.environ.items() if k != "ENGINE_CORE_KEY"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "serve.cli",
            "core",
            "--listen",
            f"tcp://0.0.0.0:{_free_port()}",
            *flags,
        ],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line)
            if "serving on" in line:
                break
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert any("without authentication" in line and "ENGINE_CORE_KEY" in line for line in lines)


def test_node_client_with_the_secret(secured):
    from tests.engine_core_proc.test_node_client import NODE_CLIENT, _skip_reason

    if _skip_reason() is not None:
        pytest.skip(_skip_reason())
    run = subprocess.run(
        [
            "node",
            str(NODE_CLIENT / "generate.mjs"),
            "--address",
            secured,
            "--max-tokens",
            "3",
            "--ignore-eos",
            "5",
            "6",
            "7",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "ENGINE_CORE_KEY": SECRET},
    )
    assert run.returncode == 0, run.stderr
    assert len(run.stdout.split()) == 3
