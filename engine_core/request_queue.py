"""Waiting queues of the scheduler: arrival order (fcfs) or priority order."""

from __future__ import annotations

import heapq
from collections import deque

from engine_core.request import Request


class FcfsQueue:
    """Waiting requests in arrival order; preempted ones go back to the front."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self._q)

    def peek(self) -> Request:
        """The request admitted next."""
        return self._q[0]

    def pop(self) -> Request:
        """Remove and return the request admitted next."""
        return self._q.popleft()

    def add(self, req: Request) -> None:
        """Queue a new request."""
        self._q.append(req)

    def add_preempted(self, req: Request) -> None:
        """Queue a preempted request at the front."""
        self._q.appendleft(req)

    def drop_finished(self) -> None:
        """Remove requests finished (aborted) while waiting."""
        self._q = deque(r for r in self._q if not r.is_finished)


class PriorityQueue:
    """Waiting requests by (priority, arrival_time, order added); lower values first."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = 0

    def __len__(self) -> int:
        return len(self._heap)

    def peek(self) -> Request:
        """The request admitted next."""
        return self._heap[0][3]

    def pop(self) -> Request:
        """Remove and return the request admitted next."""
        return heapq.heappop(self._heap)[3]

    def _push(self, req: Request, seq: int) -> None:
        heapq.heappush(self._heap, (req.priority, req.arrival_time, seq, req))

    def add(self, req: Request) -> None:
        """Queue a new request."""
        self._seq += 1
        self._push(req, self._seq)

    def add_preempted(self, req: Request) -> None:
        """Queue a preempted request ahead of its equals, like the front of the FCFS queue."""
        self._seq += 1
        self._push(req, -self._seq)

    def drop_finished(self) -> None:
        """Remove requests finished (aborted) while waiting."""
        self._heap = [k for k in self._heap if not k[3].is_finished]
        heapq.heapify(self._heap)
