"""Host-to-device copies that never make the host wait: reused pinned buffers and staged writes.

On CUDA every host array a step needs goes through one of a few pinned buffers with a
non-blocking copy on a side stream; an event recorded there after the copy guards the buffer
(the next write into it waits only for that copy, never for a step, since the side stream runs
nothing else), and the compute stream waits on the same event before it reads the data. On the
CPU the "device" is host memory: a copy is a view of the array, and nothing waits at all.
"""

from __future__ import annotations

import numpy as np
import torch

_NUM_PINNED = 4  # buffers in rotation, each free again once its own copy is done
_SHORT_ROW = 16  # StagedWrites rows up to this long are gathered in Python lists


class HostToDevice:
    """Copies numpy arrays to one device, through reused pinned buffers on CUDA."""

    def __init__(self, device: torch.device, capacity: int = 1 << 16) -> None:
        self.device = device
        self._pinned: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event | None] = []
        self._next = 0
        self._capacity = 0
        self._last_cpu: list[tuple[np.ndarray, torch.Tensor]] = []
        if device.type == "cuda":
            self._stream = torch.cuda.Stream(device)
            self._grow(capacity)

    def _grow(self, nbytes: int) -> None:
        for event in self._events:
            if event is not None:
                event.synchronize()
        self._capacity = max(nbytes, 2 * self._capacity)
        self._pinned = [
            torch.empty(self._capacity, dtype=torch.uint8, pin_memory=True)
            for _ in range(_NUM_PINNED)
        ]
        self._events = [None] * _NUM_PINNED

    def copy(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """The arrays on the device, in one copy. On the CPU they share the arrays' memory, so
        the caller hands over fresh arrays and never writes them afterwards."""
        if self.device.type != "cuda":
            # Same memory: the arrays become the device tensors (each step builds fresh ones,
            # or hands over again an array it never writes: the last call's tensor of that
            # very array serves again, held here with it so that its id is not reused).
            out: list[torch.Tensor] = []
            for a in arrays:
                tensor = None
                for prev, t in self._last_cpu:
                    if prev is a:
                        tensor = t
                        break
                out.append(torch.from_numpy(a) if tensor is None else tensor)
            self._last_cpu = list(zip(arrays, out))
            return out
        offsets, total = [], 0
        for a in arrays:
            # 128-byte aligned: Triton specialises a pointer on 16-byte alignment, so an
            # offset that moved with the arrays' sizes would compile kernel variants.
            total = -(-total // 128) * 128
            offsets.append(total)
            total += a.nbytes
        if total > self._capacity:
            self._grow(total)
        slot = self._next
        self._next = (slot + 1) % _NUM_PINNED
        event = self._events[slot]
        if event is not None:
            event.synchronize()  # only this buffer's copy from two steps ago
        host = self._pinned[slot]
        host_np = host.numpy()
        for a, off in zip(arrays, offsets):
            host_np[off : off + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
        compute = torch.cuda.current_stream(self.device)
        event = torch.cuda.Event()
        with torch.cuda.stream(self._stream):
            on_device = host[:total].to(self.device, non_blocking=True)
            event.record(self._stream)
        compute.wait_event(event)
        on_device.record_stream(compute)  # allocated on the side stream, used on this one
        self._events[slot] = event
        return [
            on_device[off : off + a.nbytes].view(_TORCH_DTYPES[a.dtype.str[1:]])
            for a, off in zip(arrays, offsets)
        ]


_TORCH_DTYPES = {
    "i4": torch.int32,
    "i8": torch.int64,
    "f4": torch.float32,
    "b1": torch.bool,
    "u1": torch.uint8,
}


class StagedWrites:
    """Writes into a persistent device tensor, gathered on the host and applied in one copy."""

    def __init__(self, target: torch.Tensor, h2d: HostToDevice) -> None:
        self.target = target
        self._h2d = h2d
        self._np_dtype = torch.empty(0, dtype=target.dtype).numpy().dtype
        self._index: list[np.ndarray] = []
        self._values: list[np.ndarray] = []
        # Single-element writes (most of them: a count, a parameter) as plain Python lists.
        self._one_index: list[int] = []
        self._one_value: list[float | int] = []

    def put(self, flat_index: np.ndarray | int, values: np.ndarray | list | float | int) -> None:
        """Stage target.view(-1)[flat_index] = values."""
        if isinstance(flat_index, int) and not isinstance(values, (np.ndarray, list)):
            self._one_index.append(flat_index)
            self._one_value.append(values)
            return
        index = np.atleast_1d(np.asarray(flat_index, dtype=np.int64))
        self._index.append(index)
        self._values.append(np.broadcast_to(np.asarray(values, dtype=self._np_dtype), index.shape))

    def put_scalars(self, flat_indices: list[int], values: list) -> None:
        """Stage target.view(-1)[flat_indices[k]] = values[k] for each k (Python lists)."""
        self._one_index.extend(flat_indices)
        self._one_value.extend(values)

    def put_row(self, row: int, values: np.ndarray | list | tuple, start: int = 0) -> None:
        """Stage target[row, start:start + len(values)] = values (a 2-D target)."""
        at = row * self.target.shape[1] + start
        if len(values) <= _SHORT_ROW:  # a few new block ids, a parameter row: plain lists
            self._one_index.extend(range(at, at + len(values)))
            self._one_value.extend(values)
            return
        self._index.append(np.arange(at, at + len(values), dtype=np.int64))
        self._values.append(np.asarray(values, dtype=self._np_dtype))

    def apply(self) -> None:
        """Send every staged write to the device (stream-ordered before the next kernels)."""
        if self._one_index:
            self._index.append(np.array(self._one_index, dtype=np.int64))
            self._values.append(np.array(self._one_value, dtype=self._np_dtype))
            self._one_index.clear()
            self._one_value.clear()
        if not self._index:
            return
        index = np.concatenate(self._index) if len(self._index) > 1 else self._index[0]
        values = np.concatenate(self._values) if len(self._values) > 1 else self._values[0]
        self._index.clear()
        self._values.clear()
        index_dev, values_dev = self._h2d.copy(index, values)
        self.target.view(-1).index_copy_(0, index_dev, values_dev)
