"""A ZeroMQ socket on the asyncio loop without a future per message.

pyzmq's asyncio sockets make a future for every send and receive, register and drop the socket's
file descriptor with the loop each time, and walk enum flags on the way: in a tokenizer process
streaming one request, that machinery was most of its 0.45 ms of CPU per token (cProfile),
on the two cores the model's step needs. A Channel owns the descriptor instead. Whenever the
loop sees it readable, every message waiting is received without blocking and handed to a
callback, in order; a send goes out at once without blocking (the links here have unbounded
queues, so ZeroMQ takes it), and waits in a backlog, in order, only when the socket cannot take
it (a DEALER with no peer yet).

ZeroMQ's descriptor is edge-triggered: it signals once when the socket's events change, and any
send or receive may consume that signal. So the channel reads ZMQ_EVENTS after each batch and
after each send, and drains again when a message is waiting (as pyzmq's own asyncio sockets do).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Sequence
from typing import Any

import zmq

logger = logging.getLogger(__name__)

# Messages received in one go before the loop gets a turn (a flood must not starve the rest).
_BATCH = 64
# Plain ints: pyzmq's constants are enum flags, and every `&` on one builds an enum member.
_EVENTS, _POLLIN, _POLLOUT, _NOBLOCK, _RCVMORE = (
    int(c) for c in (zmq.EVENTS, zmq.POLLIN, zmq.POLLOUT, zmq.NOBLOCK, zmq.RCVMORE)
)
_MORE_NOBLOCK = int(zmq.SNDMORE) | _NOBLOCK

# libzmq's calls without pyzmq's Python layer (sugar/socket.py): its send_multipart checks each
# part's type and builds `SNDMORE | flags` as an enum for every part, which was 8 of the 21 us a
# three-part send took in a warm loop (and more on the per-token path's cold caches).
_send_part = zmq.backend.Socket.send
_recv_part = zmq.backend.Socket.recv
_get = zmq.backend.Socket.get


def _send_parts(sock: zmq.Socket, frames: Sequence[Any], copy: bool) -> None:
    """send_multipart(frames, NOBLOCK, copy) for parts that are bytes, buffers or Frames: the
    first part raises zmq.Again when the socket cannot take the message; the others then go
    (ZeroMQ takes a message's parts all or none)."""
    last = len(frames) - 1
    for i in range(last):
        _send_part(sock, frames[i], _MORE_NOBLOCK, copy)
    _send_part(sock, frames[last], _NOBLOCK, copy)


def _recv_parts(sock: zmq.Socket, copy: bool) -> list[Any]:
    """recv_multipart(NOBLOCK, copy=copy) (zmq.Again when nothing waits)."""
    parts = [_recv_part(sock, _NOBLOCK, copy)]
    while _get(sock, _RCVMORE):
        parts.append(_recv_part(sock, _NOBLOCK, copy))
    return parts


class Channel:
    """Messages of `socket` (multipart frames: bytes, or zmq.Frame with copy=False) go to
    on_message as they arrive; send() never blocks. An exception in on_message, or the socket
    failing, stops the channel and goes to on_error (by default: logged)."""

    def __init__(
        self,
        socket: zmq.Socket,
        on_message: Callable[[list[Any]], None],
        on_error: Callable[[BaseException], None] | None = None,
        *,
        copy: bool = True,
    ) -> None:
        # A blocking-API view of the same socket: an asyncio socket's methods return futures.
        self._sock = zmq.Socket.shadow(socket.underlying)
        self._fd = self._sock.getsockopt(zmq.FD)
        self._on_message = on_message
        self._on_error = on_error
        self._copy = copy
        self._backlog: collections.deque[tuple[Sequence[Any], bool]] = collections.deque()
        self._loop = asyncio.get_running_loop()
        self._scheduled = False
        self.closed = False
        self._loop.add_reader(self._fd, self._drain)
        self._schedule()  # messages that came before the reader

    def send(self, frames: Sequence[Any], copy: bool = True) -> None:
        """Send a multipart message now, or after those already waiting."""
        if self.closed:
            raise zmq.ZMQError(zmq.ENOTSOCK, "the channel is closed")
        if self._backlog:
            self._backlog.append((frames, copy))
        else:
            try:
                _send_parts(self._sock, frames, copy)
            except zmq.Again:
                self._backlog.append((frames, copy))
        # The send may have taken the descriptor's signal of a message that came meanwhile.
        if self._sock.getsockopt(_EVENTS) & _POLLIN or self._backlog:
            self._schedule()

    def has_input(self) -> bool:
        """Whether a message waits to be delivered. Reading the socket's events may take the
        descriptor's signal, so a waiting message gets a drain scheduled here; callers must ask
        this rather than the socket."""
        if self.closed or not self._sock.getsockopt(_EVENTS) & _POLLIN:
            return False
        self._schedule()
        return True

    @property
    def backlog(self) -> int:
        """Messages waiting for the socket to take them."""
        return len(self._backlog)

    def close(self) -> None:
        """Stop reading (before the socket is closed); the backlog is dropped."""
        if self.closed:
            return
        self.closed = True
        self._backlog.clear()
        try:
            self._loop.remove_reader(self._fd)
        except (OSError, ValueError, RuntimeError):  # the loop or descriptor already gone
            pass

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._scheduled = False
        if self.closed:
            return
        sock = self._sock
        try:
            for _ in range(_BATCH):
                events = sock.getsockopt(_EVENTS)
                if self._backlog and events & _POLLOUT:
                    self._flush()
                if not events & _POLLIN:
                    return
                self._on_message(_recv_parts(sock, self._copy))
                if self.closed:  # on_message closed it
                    return
            self._schedule()  # more may be waiting: after the loop's other callbacks
        except Exception as e:
            self.close()
            if self._on_error is None:
                logger.exception("channel stopped")
            else:
                self._on_error(e)

    def _flush(self) -> None:
        while self._backlog:
            frames, copy = self._backlog[0]
            try:
                _send_parts(self._sock, frames, copy)
            except zmq.Again:
                return
            self._backlog.popleft()
