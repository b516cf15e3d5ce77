"""ipc.channel.Channel: every message delivered once and in order, sends that never block, a
backlog kept in order until the socket takes it, errors reported, nothing after close()."""

from __future__ import annotations

import asyncio
import time

import pytest
import uvloop
import zmq
import zmq.asyncio

from ipc.channel import Channel

LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def run(factory, coro_fn):
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro_fn())


async def wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.001)


def close_all(ctx: zmq.Context, channels: list[Channel], sockets: list[zmq.Socket]) -> None:
    for channel in channels:
        channel.close()
    for sock in sockets:
        sock.close(0)
    ctx.term()


def pair(ctx: zmq.Context, tmp_path) -> tuple[zmq.Socket, zmq.Socket]:
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"ipc://{tmp_path}/r.ipc")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"d")
    dealer.connect(f"ipc://{tmp_path}/r.ipc")
    return router, dealer


@pytest.mark.parametrize("loop", LOOPS)
def test_round_trip_in_order_beyond_one_batch(loop, tmp_path):
    """1000 requests each answered by the other side's callback: all arrive once, in order,
    also when both directions send from inside callbacks (the descriptor's edge is shared)."""

    async def main():
        ctx = zmq.asyncio.Context()
        router, dealer = pair(ctx, tmp_path)
        got: list[bytes] = []
        server = Channel(router, lambda f: server.send([f[0], b"re:" + f[1]]))
        client = Channel(dealer, lambda f: got.append(f[0]))
        for i in range(1000):
            client.send([str(i).encode()])
        await wait_for(lambda: len(got) == 1000)
        assert got == [b"re:%d" % i for i in range(1000)]
        await asyncio.sleep(0.02)
        assert len(got) == 1000  # nothing twice
        close_all(ctx, [server, client], [router, dealer])

    run(LOOPS[loop], main)


@pytest.mark.parametrize("loop", LOOPS)
def test_frames_without_copy(loop, tmp_path):
    async def main():
        ctx = zmq.asyncio.Context()
        router, dealer = pair(ctx, tmp_path)
        got = []
        server = Channel(router, lambda f: got.append([x.bytes for x in f]), copy=False)
        client = Channel(dealer, lambda f: None)
        client.send([b"a", memoryview(b"bc")], copy=False)
        await wait_for(lambda: got)
        assert got == [[b"d", b"a", b"bc"]]
        close_all(ctx, [server, client], [router, dealer])

    run(LOOPS[loop], main)


@pytest.mark.parametrize("loop", LOOPS)
def test_backlog_waits_for_a_peer_and_keeps_order(loop, tmp_path):
    """A DEALER with no peer yet (ZMQ_IMMEDIATE) cannot take a message: the sends wait in the
    backlog, in order, and go out once the peer binds."""

    async def main():
        ctx = zmq.asyncio.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IMMEDIATE, 1)
        dealer.setsockopt(zmq.IDENTITY, b"d")
        dealer.connect(f"ipc://{tmp_path}/late.ipc")
        client = Channel(dealer, lambda f: None)
        for i in range(5):
            client.send([b"%d" % i])
        assert client.backlog == 5
        got = []
        router = ctx.socket(zmq.ROUTER)
        router.bind(f"ipc://{tmp_path}/late.ipc")
        server = Channel(router, lambda f: got.append(f[1]))
        await wait_for(lambda: len(got) == 5)
        assert got == [b"0", b"1", b"2", b"3", b"4"]
        assert client.backlog == 0
        client.send([b"5"])  # after the backlog: straight out
        await wait_for(lambda: len(got) == 6)
        close_all(ctx, [server, client], [router, dealer])

    run(LOOPS[loop], main)


def test_callback_error_stops_the_channel_and_is_reported(tmp_path):
    async def main():
        ctx = zmq.asyncio.Context()
        router, dealer = pair(ctx, tmp_path)
        seen, errors = [], []

        def on_message(frames):
            seen.append(frames[1])
            if frames[1] == b"bad":
                raise ValueError("bad frame")

        server = Channel(router, on_message, errors.append)
        client = Channel(dealer, lambda f: None)
        for body in (b"ok", b"bad", b"after"):
            client.send([body])
        await wait_for(lambda: errors)
        await asyncio.sleep(0.02)
        assert seen == [b"ok", b"bad"]
        assert isinstance(errors[0], ValueError) and server.closed
        with pytest.raises(zmq.ZMQError):
            server.send([b"d", b"x"])
        close_all(ctx, [client], [router, dealer])

    run(asyncio.new_event_loop, main)


def test_nothing_delivered_after_close(tmp_path):
    async def main():
        ctx = zmq.asyncio.Context()
        router, dealer = pair(ctx, tmp_path)
        got = []
        server = Channel(router, lambda f: got.append(f[1]))
        client = Channel(dealer, lambda f: None)
        client.send([b"1"])
        await wait_for(lambda: got)
        server.close()
        client.send([b"2"])
        await asyncio.sleep(0.05)
        assert got == [b"1"]
        server.close()  # idempotent
        close_all(ctx, [client], [router, dealer])

    run(asyncio.new_event_loop, main)


def test_messages_waiting_before_the_channel_are_delivered(tmp_path):
    """Messages queued on the socket before the Channel exists (no descriptor edge will come for
    them) are still read."""

    async def main():
        ctx = zmq.asyncio.Context()
        router, dealer = pair(ctx, tmp_path)
        sync_dealer = zmq.Socket.shadow(dealer.underlying)
        for i in range(3):
            sync_dealer.send(b"%d" % i)
        await asyncio.sleep(0.05)
        zmq.Socket.shadow(router.underlying).getsockopt(zmq.EVENTS)  # consume the edge
        got = []
        server = Channel(router, lambda f: got.append(f[1]))
        await wait_for(lambda: len(got) == 3)
        close_all(ctx, [server], [router, dealer])

    run(asyncio.new_event_loop, main)


@pytest.mark.parametrize("loop", LOOPS)
def test_message_that_came_during_a_send_is_read(loop, tmp_path):
    """A send processes the socket's pending commands, which takes the descriptor's signal of a
    message that arrived meanwhile: the channel must still read that message."""

    async def main():
        import time

        ctx = zmq.asyncio.Context()
        router, dealer = pair(ctx, tmp_path)
        got = []
        server = Channel(router, lambda f: got.append(f[1]))
        sync_dealer = zmq.Socket.shadow(dealer.underlying)
        sync_dealer.send(b"hello")  # the router learns the dealer's identity
        await wait_for(lambda: got)
        for i in range(3):
            sync_dealer.send(b"%d" % i)
            # Block the loop on purpose: the message arrives before the loop looks at the
            # descriptor, and the send below takes the signal.
            time.sleep(0.05)  # noqa: ASYNC251
            server.send([b"d", b"ack"])
            await wait_for(lambda n=i + 2: len(got) == n, timeout=2.0)
        assert got == [b"hello", b"0", b"1", b"2"]
        close_all(ctx, [server], [router, dealer])

    run(LOOPS[loop], main)


def test_has_input_keeps_the_descriptor_signal(tmp_path):
    """Asking whether a message waits reads the socket's events, which takes the descriptor's
    signal: the waiting message must still be delivered (a liveness check asks this between
    messages)."""

    async def main():
        ctx = zmq.asyncio.Context()
        router, dealer = pair(ctx, tmp_path)
        got = []
        server = Channel(router, lambda f: got.append(f[1]))
        assert not server.has_input()
        await asyncio.sleep(0.05)  # the channel's first drain is done
        sync_dealer = zmq.Socket.shadow(dealer.underlying)
        sync_dealer.send(b"late")
        deadline = asyncio.get_running_loop().time() + 5
        while not server.has_input():  # no loop turn in between: the reader cannot run
            assert asyncio.get_running_loop().time() < deadline
            time.sleep(0.001)  # noqa: ASYNC251
        await wait_for(lambda: got == [b"late"])
        close_all(ctx, [server], [router, dealer])

    run(asyncio.new_event_loop, main)
