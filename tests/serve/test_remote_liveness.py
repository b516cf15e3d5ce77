"""Liveness across hosts (issue 15, item 1): a tokenizer process and a client whose pids the other
cannot watch exchange heartbeats (tokenizer_proc/heartbeat.py); a side that falls silent is
taken for dead: the tokenizer process aborts a silent client's requests, and a client fails
the requests of a silent tokenizer process with 503."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import msgspec
import pytest
import zmq
import zmq.asyncio

from engine_core.client import EngineCoreClient
from protocol.sampling_params import SamplingParams
from protocol.tokenizer import (
    TOKENIZER_PROTOCOL_VERSION,
    ApiOutputType,
    ApiRequestType,
    GenerateRequest,
    Heartbeat,
    RequestError,
    TokenizerHello,
    TokenizerReady,
)
from tests.serve.conftest import Server, wait_until
from tests.serve.test_liveness import _aborted
from tests.serve.test_tokenizer_auth import SECRET, _free_port
from tokenizer_proc import heartbeat
from tokenizer_proc.client import TokenizerClient, TokenizerRequestError
from tokenizer_proc.heartbeat import HEARTBEAT_INTERVAL_S, silence_timeout

# Silence is noticed at a heartbeat tick, up to an interval late, after the peer's last
# message (up to an interval before it died); the rest is a loaded 2-core box's margin.
NOTICED_S = silence_timeout(HEARTBEAT_INTERVAL_S) + 2 * HEARTBEAT_INTERVAL_S + 4

LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


@pytest.fixture
def tcp_server(tiny_args, monkeypatch):
    """engine serve with its tokenizer process on TCP and the shared secret (as for clients on
    other hosts); the secret is in this process's environment too."""
    monkeypatch.setenv("ENGINE_CORE_KEY", SECRET)
    address = f"tcp://127.0.0.1:{_free_port()}"
    server = Server([*tiny_args, "--tokenizer-listen", address])
    assert server.ready, server.stderr
    yield server, address
    if server.proc.poll() is None:
        server.stop()


# A client on "another host" (its HELLO names another host identity, so its pid is not
# watched) that streams one long request, then waits to be killed or frozen.
_REMOTE_CLIENT = """
import asyncio, sys
import tokenizer_proc.client as client_module
client_module.host_identity = lambda: "another-host"
from protocol.sampling_params import SamplingParams
from protocol.tokenizer import GenerateRequest

async def main():
    client = await client_module.TokenizerClient.create(sys.argv[1:], client_name="remote-api")
    stream = client.generate(GenerateRequest("orphan", SamplingParams(
        temperature=0.0, max_tokens=200, ignore_eos=True), prompt="Hello"))
    await anext(stream)
    print("streaming", flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_a_silent_remote_clients_requests_are_aborted(tcp_server, sig):
    server, address = tcp_server
    core = server.child("engine-core")
    client = subprocess.Popen(
        [sys.executable, "-c", _REMOTE_CLIENT, address], stdout=subprocess.PIPE, text=True
    )
    try:
        assert client.stdout.readline() == "streaming\n"
        os.kill(core, signal.SIGSTOP)  # it would otherwise finish the request on its own
        os.kill(client.pid, sig)
        start = time.monotonic()
        assert wait_until(lambda: "remote-api fell silent" in server.stderr, timeout=NOTICED_S), (
            server.stderr
        )
        elapsed = time.monotonic() - start
    finally:
        os.kill(core, signal.SIGCONT)
        client.kill()
        client.wait()
    # Not the pid watch (the client is on "another host"): its heartbeats stopped.
    assert elapsed > silence_timeout(HEARTBEAT_INTERVAL_S) - 2 * HEARTBEAT_INTERVAL_S
    assert re.search(
        r"client remote-api fell silent \(\d+\.\d s without a message or "
        r"heartbeat\); aborting its 1 requests",
        server.stderr,
    ), server.stderr
    assert wait_until(lambda: _aborted(server) == 1), server.stderr
    with EngineCoreClient(server.core_address) as engine:
        assert wait_until(
            lambda: engine.call_utility("get_stats", timeout=10)["num_unfinished_requests"] == 0
        )
    assert server.stop() == 0, server.stderr


def test_a_client_fails_the_requests_of_a_frozen_remote_tokenizer_process(tcp_server):
    server, address = tcp_server
    tokenizer = server.child("engine-tok-0")

    async def run() -> tuple[TokenizerRequestError, float, TokenizerRequestError, str | None]:
        client = await TokenizerClient.create([address], client_name="test")
        try:
            stream = client.generate(GenerateRequest("a", LONG, prompt="Hello"))
            await anext(stream)
            os.kill(tokenizer, signal.SIGSTOP)  # as a lost host: no FIN, no answer
            start = time.monotonic()
            with pytest.raises(TokenizerRequestError) as err:
                await asyncio.wait_for(_drain(stream), NOTICED_S)
            elapsed = time.monotonic() - start
            with pytest.raises(TokenizerRequestError) as later:  # refused at once from now on
                await anext(client.generate(GenerateRequest("b", LONG, prompt="x")))
            return err.value, elapsed, later.value, client.unavailable()
        finally:
            client.shutdown()

    try:
        error, elapsed, later, unavailable = asyncio.run(run())
    finally:
        os.kill(tokenizer, signal.SIGCONT)
    assert error.status == 503 and later.status == 503
    assert re.fullmatch(
        rf"the tokenizer process at {re.escape(address)} fell silent "
        r"\(\d+\.\d s without a message or heartbeat\)",
        str(error),
    ), error
    assert str(error) == str(later) == unavailable
    assert silence_timeout(HEARTBEAT_INTERVAL_S) - 2 * HEARTBEAT_INTERVAL_S < elapsed < NOTICED_S
    assert server.stop() == 0, server.stderr


async def _drain(stream) -> None:
    async for _ in stream:
        pass


# ---- the client against a stand-in tokenizer process, on fast heartbeats ----

_FAST_S = 0.1  # heartbeat interval in these tests: silence is noticed after ~0.5 s


class _FakeTokenizer:
    """A ROUTER that answers HELLO with READY (agreeing to heartbeats at `agree` seconds when
    asked and agree is set), then keeps quiet, or sends HEARTBEAT every `beat` seconds; it
    records what it receives."""

    def __init__(self, agree: float = _FAST_S, beat: float = 0.0) -> None:
        self.sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.agree, self.beat = agree, beat
        self.hellos: list[TokenizerHello] = []
        self.kinds: list[int] = []
        self.peer = b""
        self._tasks = [asyncio.create_task(self._serve())]

    async def _serve(self) -> None:
        while True:
            self.peer, kind, payload = await self.sock.recv_multipart()
            self.kinds.append(kind[0])
            if kind[0] == ApiRequestType.HELLO:
                hello = msgspec.msgpack.decode(payload, type=TokenizerHello)
                self.hellos.append(hello)
                ready = TokenizerReady(
                    TOKENIZER_PROTOCOL_VERSION,
                    0,
                    "m",
                    64,
                    100,
                    heartbeat_s=self.agree if hello.heartbeat_s else 0.0,
                )
                await self.send(ApiOutputType.READY, ready)
                if self.beat:
                    self._tasks.append(asyncio.create_task(self._beat()))

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.beat)
            await self.send(ApiOutputType.HEARTBEAT, Heartbeat())

    async def send(self, kind: ApiOutputType, msg) -> None:
        await self.sock.send_multipart([self.peer, bytes([kind]), msgspec.msgpack.encode(msg)])

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.sock.close(linger=0)


@pytest.fixture
def fast_heartbeats(monkeypatch) -> None:
    """Heartbeats every _FAST_S in this process (the stand-in sets its own pace)."""
    monkeypatch.setattr(heartbeat, "HEARTBEAT_INTERVAL_S", _FAST_S)


@contextlib.asynccontextmanager
async def _connected(pids: list[int] | None = None, **fake_args):
    """A _FakeTokenizer(**fake_args) and a TokenizerClient connected to it."""
    fake = _FakeTokenizer(**fake_args)
    try:
        client = await TokenizerClient.create([fake.address], pids=pids)
        try:
            yield fake, client
        finally:
            client.shutdown()
    finally:
        fake.close()


async def _pending_request(client: TokenizerClient, request_id: str = "a") -> asyncio.Future:
    pending = asyncio.ensure_future(
        anext(
            client.generate(GenerateRequest(request_id, SamplingParams(max_tokens=8), prompt="x"))
        )
    )
    await asyncio.sleep(0)
    return pending


def test_client_fails_requests_of_a_tokenizer_process_that_stops_its_heartbeats(fast_heartbeats):
    async def run() -> None:
        async with _connected() as (fake, client):
            assert fake.hellos[0].heartbeat_s > 0  # asked for heartbeats: no pid to watch
            pending = await _pending_request(client)
            start = time.monotonic()
            with pytest.raises(TokenizerRequestError) as err:
                await asyncio.wait_for(pending, 5)
            elapsed = time.monotonic() - start
            assert err.value.status == 503
            assert str(err.value).startswith(f"the tokenizer process at {fake.address} fell silent")
            assert 0.9 * silence_timeout(_FAST_S) < elapsed < silence_timeout(_FAST_S) + 2
            # The client sent heartbeats while it had nothing else to send, then stopped.
            await asyncio.sleep(2 * _FAST_S)  # what it sent before has arrived
            assert fake.kinds.count(ApiRequestType.HEARTBEAT) >= 3
            sent = len(fake.kinds)
            await asyncio.sleep(5 * _FAST_S)
            assert len(fake.kinds) == sent

    asyncio.run(run())


def test_client_keeps_a_tokenizer_process_that_heartbeats(fast_heartbeats):
    async def run() -> None:
        async with _connected(beat=_FAST_S) as (_, client):
            pending = await _pending_request(client)
            await asyncio.sleep(4 * silence_timeout(_FAST_S))
            assert not pending.done() and client.unavailable() is None
            pending.cancel()

    asyncio.run(run())


@pytest.mark.parametrize("pids", [False, True], ids=["older-tokenizer", "pid-watched"])
def test_no_heartbeats_with_an_older_tokenizer_process_or_a_watched_pid(fast_heartbeats, pids):
    """An older tokenizer process (no heartbeat_s in READY) gets no HEARTBEAT it could not
    read, and is never taken for silent; nor is one whose pid the client watches."""

    async def run() -> None:
        async with _connected([os.getpid()] if pids else None, agree=_FAST_S if pids else 0.0) as (
            fake,
            client,
        ):
            assert (fake.hellos[0].heartbeat_s == 0) == pids
            pending = await _pending_request(client)
            await asyncio.sleep(3 * silence_timeout(_FAST_S))
            assert not pending.done() and client.unavailable() is None
            assert ApiRequestType.HEARTBEAT not in fake.kinds
            pending.cancel()

    asyncio.run(run())


def test_client_dropped_by_its_tokenizer_process_fails_its_requests(fast_heartbeats):
    """A tokenizer process that took this client for dead (it was frozen, or cut off) says so
    with a 503 ERROR without a request id: the client stops using it at once."""

    async def run() -> None:
        async with _connected(beat=_FAST_S) as (fake, client):
            pending = await _pending_request(client)
            await fake.send(ApiOutputType.ERROR, RequestError("", "client ? fell silent", 503))
            with pytest.raises(TokenizerRequestError) as err:
                await asyncio.wait_for(pending, 2)
            assert (
                str(err.value)
                == (
                    f"the tokenizer process at {fake.address} dropped this "
                    "client: client ? fell silent"
                )
                == client.unavailable()
            )

    asyncio.run(run())
