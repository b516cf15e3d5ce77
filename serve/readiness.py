"""How the launcher waits for children to be ready during start-up: a HELLO answered with READY
(engine cores, tokenizer processes) or a ready file written (API servers)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import zmq

from ipc.curve import key_from_env
from ipc.handshake import ready_or_refused
from ipc.sockets import connect_dealer
from serve.child import Child, LaunchError

POLL_S = 0.2
# (children still starting, deadline, timeout): raises LaunchError when a child died, a
# signal came or the deadline passed.
StartUpCheck = Callable[[list[Child], float, float], None]


def await_ready(
    ctx: zmq.Context, children: list[Child], timeout: float, check: StartUpCheck
) -> None:
    """Send each child its HELLO and wait until every one answered READY (child.ready holds
    the answer); LaunchError when one refuses, or from check()."""
    sockets = {}
    auth_key = key_from_env()
    for child in children:
        # With a key, the engine cores and tokenizer processes speak CurveZMQ.
        sock, _ = connect_dealer(ctx, child.address, auth_key)
        sock.send_multipart(child.hello)
        sockets[sock] = child
    poller = zmq.Poller()
    for sock in sockets:
        poller.register(sock, zmq.POLLIN)
    deadline = time.monotonic() + timeout
    try:
        while any(c.ready is None for c in children):
            for sock in dict(poller.poll(int(POLL_S * 1000))):
                child = sockets[sock]
                kind, payload = sock.recv_multipart()
                try:
                    child.ready = ready_or_refused(
                        kind[0],
                        child.decoders[kind[0]].decode(payload),
                        f"{child.name} refused the launcher",
                    )
                except ConnectionError as e:
                    raise LaunchError(str(e)) from None
                poller.unregister(sock)
            check(children, deadline, timeout)
    finally:
        for sock in sockets:
            sock.close(linger=0)


def await_ready_files(children: list[Child], timeout: float, check: StartUpCheck) -> None:
    """Wait until every child has written its ready file (child.address); LaunchError from
    check()."""
    deadline = time.monotonic() + timeout
    while any(c.ready is None for c in children):
        for child in children:
            if child.ready is None and os.path.exists(child.address):
                child.ready = True
        check(children, deadline, timeout)
        time.sleep(0.05)
