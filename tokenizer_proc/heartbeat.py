"""Heartbeats on a link between an API server and a tokenizer process whose pid the other side
cannot watch (another host, or a client not told the pid): each side sends HEARTBEAT after
every interval in which it sent nothing else, and a side that hears nothing from its peer for
HEARTBEAT_MISSES of the longer interval takes the peer for dead (docs/protocol.md).

Timers of the asyncio loop only: an idle link costs five small messages a second each way (a
few microseconds each), and the engine core never hears of it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

# Seconds between heartbeats on an otherwise quiet link.
HEARTBEAT_INTERVAL_S = 0.2
# Intervals without a message after which the peer is dead: 1 s, the bound for a
# peer's death to reach its clients. A late wake-up of our own (a stall) restarts the count,
# and unread input postpones the verdict, so a busy peer is not taken for a dead one.
HEARTBEAT_MISSES = 5


def silence_timeout(peer_interval: float) -> float:
    """Seconds of silence after which a peer sending every peer_interval seconds is dead."""
    return HEARTBEAT_MISSES * max(HEARTBEAT_INTERVAL_S, peer_interval)


class Link:
    """One side's view of a link since its heartbeat last looked: whether it sent anything
    (then no heartbeat is due) and whether it heard anything (then the peer lives)."""

    __slots__ = ("heard", "sent")

    def __init__(self) -> None:
        self.sent = False
        self.heard = False


async def keep_alive(
    link: Link,
    send_heartbeat: Callable[[], Awaitable[None]],
    input_pending: Callable[[], bool],
    timeout: float,
) -> float:
    """Send a heartbeat after each interval in which nothing was sent on link; return the
    silence in seconds once nothing was heard for more than timeout. Input waiting to be read
    (input_pending(): our reader is behind) postpones the verdict, and a wake-up that came late
    (this process was frozen or starved) starts the count again: our stall is not the peer's
    silence."""
    loop = asyncio.get_running_loop()
    heard_at = woke = loop.time()
    while True:
        await asyncio.sleep(HEARTBEAT_INTERVAL_S)
        now = loop.time()
        if link.heard or now - woke > 2 * HEARTBEAT_INTERVAL_S:
            heard_at = now
        elif now - heard_at > timeout and not input_pending():
            return now - heard_at
        link.heard = False
        woke = now
        if not link.sent:
            await send_heartbeat()
        link.sent = False
