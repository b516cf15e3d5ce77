"""A shared-memory ring buffer: one writer broadcasts byte messages to reader processes on a host.

Block layout: num_slots slots, each a header followed by slot_bytes of data (both 64-byte aligned).

    header (int64 each): seq          1-based number of the message in the slot; 0 = never written
                         length       payload bytes
                         name_length  0: payload inline; else the data holds an overflow block name
                         read_seq[R]  the seq reader r last consumed from this slot

Message k (1-based) goes to slot (k - 1) % num_slots. The writer waits until every reader has
consumed the slot's previous message (read_seq[r] == seq for all r), writes the data and then
publishes seq = k; reader r waits for seq == k, reads, then stores read_seq[r] = k. Sequence
numbers only grow: no flag is ever reset, and a stale slot cannot pass for a new one.

Messages larger than a slot go into a fresh SharedMemory block of their own size whose name the
slot carries; readers map it, read and unmap, and the writer unlinks it when it next reuses the
slot (every reader done). Chosen over a ZeroMQ PUB/SUB side channel: no subscription handshake or
slow-joiner loss, ordering comes from the ring itself, and the cost (shm_open + mmap, tens of
microseconds) is paid only by the rare step that does not fit.

Waiting on either side polls: it spins (yielding the CPU) for SPIN_S, as a step's message usually
comes within it, then sleeps an eighth of the time waited so far, so it wakes at most ~12% late,
up to MAX_SLEEP_S. A reader with a Doorbell sleeps instead: it raises its "asleep" flag, checks
the ring once more, and blocks on a semaphore that the writer posts after a message whenever the
flag is up (a store then a load on each side, with a fence between: one of the two sees the
other). An idle reader then costs nothing but a wake-up every IDLE_WAKE_S (a safety net), and the
first step after idleness starts as soon as the semaphore is posted.

A reader in a process the writer did not start (a Ray actor on the writer's host) cannot be
handed a multiprocessing semaphore: its HostDoorbell is attached by name instead, the flag a
byte of a shared-memory block and the semaphore a named pipe. Readers map blocks without
registering them with their resource tracker, so a reader's exit never unlinks them: only the
writer does.
"""

from __future__ import annotations

import mmap
import os
import select
import shutil
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.shared_memory import SharedMemory
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")

SPIN_S = 1e-3
MAX_SLEEP_S = 20e-3
# An idle reader's safety-net wake-up. Timer wake-ups are charged CPU out of proportion (the
# kernel samples CPU time at its tick, which is also when timers fire): at 1 s, each idle
# worker's main thread read 0.04-0.07 CPU s per 10 s on a 2-core box.
IDLE_WAKE_S = 10.0
_ALIGN = 64
_INT = struct.Struct("<q")
_SLOT_FIELDS = struct.Struct("<qq")  # length, name_length
_fence_lock = threading.Lock()


def _fence() -> None:
    """Full memory barrier (a mutex round trip): data stores become visible before the flag."""
    with _fence_lock:
        pass


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class RingHandle(msgspec.Struct, frozen=True):
    """What a reader needs to attach: the block's name and its geometry."""

    name: str
    num_slots: int
    slot_bytes: int
    num_readers: int

    @property
    def header_bytes(self) -> int:
        """Bytes of one slot's header."""
        return _aligned(8 * (3 + self.num_readers))

    @property
    def stride(self) -> int:
        """Bytes from one slot to the next."""
        return self.header_bytes + _aligned(self.slot_bytes)


def wait_until(
    ready: Callable[[], bool],
    timeout: float | None = None,
    on_sleep: Callable[[], None] | None = None,
    doorbell: Doorbell | None = None,
) -> None:
    """Poll ready(): spin for SPIN_S, then sleep with backoff (or on the doorbell); TimeoutError
    after timeout seconds.

    on_sleep runs before each sleep, e.g. a liveness check that raises.
    """
    start = time.monotonic()
    while not ready():
        elapsed = time.monotonic() - start
        if timeout is not None and elapsed >= timeout:
            raise TimeoutError(f"no progress on the shared-memory ring in {timeout} s")
        if elapsed < SPIN_S:
            os.sched_yield()
            continue
        if on_sleep is not None:
            on_sleep()
        if doorbell is not None:
            left = IDLE_WAKE_S if timeout is None else min(IDLE_WAKE_S, timeout - elapsed)
            doorbell.sleep(ready, left)
        else:
            time.sleep(min(elapsed / 8, MAX_SLEEP_S))


class DoorbellHandle(msgspec.Struct, frozen=True):
    """What a reader in any process on the writer's host needs to attach to its HostDoorbell."""

    flags: str  # a SharedMemory block: reader i's "asleep" byte at offset 64 * i
    index: int
    pipe: str  # the named pipe (FIFO) the writer wakes reader i through


class Doorbell:
    """Wakes one reader sleeping on a ring: a shared "asleep" flag and a semaphore. Made from a
    multiprocessing context and handed to the reader's process when it is started."""

    def __init__(self, ctx: Any) -> None:
        self._asleep: Any = ctx.RawValue("b", 0)
        self._wake: Any = ctx.Semaphore(0)

    def sleep(self, ready: Callable[[], bool], timeout: float) -> None:
        """Block until rung or timeout, unless ready() already holds once the flag is up."""
        self._asleep.value = 1
        _fence()
        try:
            if not ready():
                self._wake.acquire(timeout=max(0.0, timeout))
        finally:
            self._asleep.value = 0

    def ring(self) -> None:
        """Wake the reader if it sleeps (call after publishing, behind a fence)."""
        if self._asleep.value:
            self._wake.release()

    def close(self) -> None:
        """Release what this end holds (nothing: multiprocessing frees the semaphore)."""


class HostDoorbell(Doorbell):
    """A Doorbell attached by its handle, from any process on the writer's host."""

    def __init__(self, handle: DoorbellHandle) -> None:  # no multiprocessing context to pass up
        self._block = _Mapping(handle.flags)
        self._asleep = _SharedByte(self._block.buf, handle.index * _ALIGN)
        self._wake = _PipeSemaphore(handle.pipe)

    def close(self) -> None:
        """Unmap the flag and close the pipe (the writer removes both)."""
        self._wake.close()
        self._block.close()


class _SharedByte:
    """A byte of shared memory, read and written as .value (as a RawValue("b") is)."""

    def __init__(self, buf: memoryview, offset: int) -> None:
        self._buf, self._offset = buf, offset

    @property
    def value(self) -> int:
        return self._buf[self._offset]

    @value.setter
    def value(self, value: int) -> None:
        self._buf[self._offset] = value


class _PipeSemaphore:
    """A semaphore for one waiter made of a named pipe: release() writes a byte, acquire() waits
    for one and drains the pipe (a byte left over costs one spurious wake-up, which the
    doorbell's caller tolerates: it checks its condition again)."""

    def __init__(self, path: str) -> None:
        # Read-write: the open never blocks and no read ever sees EOF, whoever opens first.
        self._fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)

    def acquire(self, timeout: float) -> None:
        readable, _, _ = select.select([self._fd], [], [], timeout)
        if readable:
            try:
                os.read(self._fd, 4096)
            except BlockingIOError:
                pass

    def release(self) -> None:
        try:
            os.write(self._fd, b"\0")
        except BlockingIOError:  # the pipe is full: the reader has wake-ups enough
            pass

    def close(self) -> None:
        os.close(self._fd)


class _HostDoorbells:
    """The writer's side of HostDoorbells: the flags block and a directory of named pipes."""

    def __init__(self, num_readers: int) -> None:
        self._flags = SharedMemory(create=True, size=num_readers * _ALIGN)
        self._dir = tempfile.mkdtemp(prefix="shm-ring-")
        self.handles = []
        for index in range(num_readers):
            pipe = os.path.join(self._dir, f"reader-{index}")
            os.mkfifo(pipe, 0o600)
            self.handles.append(DoorbellHandle(self._flags.name, index, pipe))
        self.doorbells = [HostDoorbell(handle) for handle in self.handles]

    def close(self) -> None:
        for doorbell in self.doorbells:
            doorbell.close()
        self._flags.close()
        self._flags.unlink()
        shutil.rmtree(self._dir, ignore_errors=True)


class ShmRingWriter:
    """The writing end; creates and finally unlinks the block."""

    def __init__(
        self,
        num_readers: int,
        num_slots: int = 8,
        slot_bytes: int = 1 << 20,
        ctx: Any = None,
        host_doorbells: bool = False,
    ) -> None:
        """ctx (a multiprocessing context): make a Doorbell per reader (self.doorbells), so
        readers given theirs sleep until a message comes instead of polling. host_doorbells:
        make HostDoorbells instead, for readers in processes this one did not start; reader i
        attaches to its own by self.doorbell_handles[i]."""
        if num_readers < 1 or num_slots < 1 or slot_bytes < 64:
            raise ValueError("a ring needs a reader, a slot, and slots of at least 64 bytes")
        self._host_doorbells = _HostDoorbells(num_readers) if host_doorbells else None
        self.doorbell_handles = self._host_doorbells.handles if self._host_doorbells else []
        self.doorbells: list[Doorbell] = (
            self._host_doorbells.doorbells
            if self._host_doorbells
            else [Doorbell(ctx) for _ in range(num_readers)]
            if ctx is not None
            else []
        )
        stride = RingHandle("", num_slots, slot_bytes, num_readers).stride
        self._shm = SharedMemory(create=True, size=num_slots * stride)  # zero-filled
        self.handle = RingHandle(self._shm.name, num_slots, slot_bytes, num_readers)
        self._read_seqs = struct.Struct(f"<{num_readers}q")
        self._count = 0
        self._overflow: dict[int, SharedMemory] = {}

    def write(
        self, data: bytes, timeout: float | None = None, on_wait: Callable[[], None] | None = None
    ) -> None:
        """Publish data to every reader; waits while the next slot is still being read."""
        h, buf = self.handle, self._shm.buf
        slot = self._count % h.num_slots
        base = slot * h.stride
        previous = _INT.unpack_from(buf, base)[0]
        if previous:

            def all_read() -> bool:
                return all(s == previous for s in self._read_seqs.unpack_from(buf, base + 24))

            wait_until(all_read, timeout, on_wait)
            _fence()
        old = self._overflow.pop(slot, None)
        if old is not None:
            old.close()
            old.unlink()
        data_at = base + h.header_bytes
        if len(data) <= h.slot_bytes:
            buf[data_at : data_at + len(data)] = data
            name_length = 0
        else:
            block = SharedMemory(create=True, size=len(data))
            block.buf[: len(data)] = data
            self._overflow[slot] = block
            name = block.name.encode()
            buf[data_at : data_at + len(name)] = name
            name_length = len(name)
        _SLOT_FIELDS.pack_into(buf, base + 8, len(data), name_length)
        _fence()
        self._count += 1
        _INT.pack_into(buf, base, self._count)
        if self.doorbells:
            _fence()
            for doorbell in self.doorbells:
                doorbell.ring()

    def close(self) -> None:
        """Unlink the ring and any overflow blocks; readers still attached keep their mappings."""
        for block in self._overflow.values():
            block.close()
            block.unlink()
        self._overflow.clear()
        self._shm.close()
        self._shm.unlink()
        if self._host_doorbells is not None:
            self._host_doorbells.close()


class ShmRingReader:
    """Reader number `index` of a ring; reads every message in order."""

    def __init__(self, handle: RingHandle, index: int, doorbell: Doorbell | None = None) -> None:
        if not 0 <= index < handle.num_readers:
            raise ValueError(f"reader index {index} out of range for {handle.num_readers} readers")
        self.handle, self.index = handle, index
        self._doorbell = doorbell
        self._shm = _Mapping(handle.name)
        self._count = 0

    def poll(self) -> bool:
        """True when the next message has arrived (read() would not wait)."""
        base = (self._count % self.handle.num_slots) * self.handle.stride
        return _INT.unpack_from(self._shm.buf, base)[0] == self._count + 1

    def read(
        self,
        decode: Callable[[memoryview], T] = bytes,
        timeout: float | None = None,
        on_sleep: Callable[[], None] | None = None,
    ) -> T:
        """The next message, passed through decode while it still lies in shared memory.
        on_sleep runs before each sleep while it waits (a liveness check that raises)."""
        h, buf = self.handle, self._shm.buf
        base = (self._count % h.num_slots) * h.stride
        expected = self._count + 1
        wait_until(self.poll, timeout, on_sleep, self._doorbell)
        _fence()
        length, name_length = _SLOT_FIELDS.unpack_from(buf, base + 8)
        data_at = base + h.header_bytes
        if name_length:
            block = _Mapping(bytes(buf[data_at : data_at + name_length]).decode())
            try:
                result = _decode_view(block.buf, 0, length, decode)
            finally:
                block.close()
        else:
            result = _decode_view(buf, data_at, length, decode)
        _fence()
        _INT.pack_into(buf, base + 24 + 8 * self.index, expected)
        self._count = expected
        return result

    def close(self) -> None:
        """Detach from the ring."""
        self._shm.close()


class _Mapping:
    """A block another process created, mapped by name. Unlike SharedMemory(name), it is kept
    out of this process's resource tracker, which would unlink it when this process exits."""

    def __init__(self, name: str) -> None:
        fd = os.open(os.path.join("/dev/shm", name.lstrip("/")), os.O_RDWR)
        try:
            self._mmap = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        self.buf = memoryview(self._mmap)

    def close(self) -> None:
        self.buf.release()
        self._mmap.close()


def _decode_view(buf: memoryview, start: int, length: int, decode: Callable[[memoryview], T]) -> T:
    # Released at once: a live slice of the mapping would make closing it fail.
    with buf[start : start + length] as view:
        return decode(view)
