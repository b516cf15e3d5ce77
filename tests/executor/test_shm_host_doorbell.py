"""A ring reader in a process the writer did not start (as a Ray actor on the writer's host is):
it attaches to its HostDoorbell by handle, sleeps on it until a message comes, and its exit
leaves the writer's blocks in place (no resource tracker of its own unlinks them)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import msgspec

from executor.shm_broadcast import ShmRingWriter

_READER = """
import sys, time, msgspec
from executor.shm_broadcast import DoorbellHandle, HostDoorbell, RingHandle, ShmRingReader
ring = msgspec.json.decode(sys.argv[1], type=RingHandle)
bell = HostDoorbell(msgspec.json.decode(sys.argv[2], type=DoorbellHandle))
reader = ShmRingReader(ring, 1, bell)
print("attached", flush=True)
cpu = time.process_time()
data = reader.read(timeout=30)  # idle first: asleep on the doorbell
print(time.monotonic(), data.decode(), time.process_time() - cpu, flush=True)
reader.close()
bell.close()
"""


def test_a_reader_of_another_process_tree_sleeps_on_its_host_doorbell():
    writer = ShmRingWriter(num_readers=2, num_slots=2, slot_bytes=256, host_doorbells=True)
    try:
        assert [h.index for h in writer.doorbell_handles] == [0, 1]
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _READER,
                msgspec.json.encode(writer.handle).decode(),
                msgspec.json.encode(writer.doorbell_handles[1]).decode(),
            ],
            stdout=subprocess.PIPE,
            text=True,
            cwd=os.getcwd(),
            start_new_session=True,
        )
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "attached"
        time.sleep(3.0)  # the reader spins 1 ms, then sleeps on its doorbell
        sent = time.monotonic()
        writer.write(b"wake")
        arrived, data, cpu = proc.stdout.readline().split()
        assert proc.wait(10) == 0
        assert data == "wake"
        assert float(arrived) - sent < 0.1, f"woke {float(arrived) - sent:.3f} s after the message"
        assert float(cpu) < 0.1, f"the sleeping reader used {float(cpu):.3f} CPU seconds"
        # Its exit unlinked nothing: the ring and the doorbells' flags are still there.
        for name in (writer.handle.name, writer.doorbell_handles[1].flags):
            assert os.path.exists(f"/dev/shm/{name}")
    finally:
        writer.close()
    assert not os.path.exists(f"/dev/shm/{writer.handle.name}")
    assert not os.path.exists(writer.doorbell_handles[1].pipe)
