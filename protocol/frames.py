"""Large numpy arrays as extra ZeroMQ frames of an engine core message (docs/protocol.md).

A message is [type byte, msgpack payload, buffer 0, buffer 1, ...]. An array of at least
INLINE_MAX_BYTES travels as the msgpack Ext ARRAY_EXT_CODE whose data is the msgpack array
[dtype, shape, buffer index]; the buffer frame holds its raw little-endian bytes. The sender
hands the array's own memory to send_multipart(copy=False) and the receiver wraps the frame with
np.frombuffer, so neither copies it. Smaller arrays travel inline as msgpack lists, and a list
is accepted wherever an array is, so a simple client never needs the Ext.

A protocol module: imports only msgspec and numpy.
"""

from __future__ import annotations

import abc
import math
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec
import numpy as np

# msgpack application extension type of an array whose bytes are in a buffer frame.
ARRAY_EXT_CODE = 1
# Below this many bytes an array stays an inline list: a frame costs more than it saves.
INLINE_MAX_BYTES = 256
# The only dtypes on the wire, always little-endian.
WIRE_DTYPES: dict[str, np.dtype] = {
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "float32": np.dtype("<f4"),
}


class WireArray(abc.ABC):
    """A msgspec field type: a (nested) list, or a numpy array that travels as an array Ext.

    Decoders keep a list a list (checked against list_type) and an Ext an array (checked
    against kind and ndim); tolist() turns either into lists. Subclasses name the shape.
    """

    kind: ClassVar[type[np.generic]]
    ndim: ClassVar[int]
    list_type: ClassVar[Any]

    @classmethod
    def __subclasshook__(cls, subclass: type) -> bool:
        return True if issubclass(subclass, (list, np.ndarray)) else NotImplemented


if TYPE_CHECKING:  # what a field of these types holds, for the type checker
    IntVector = list[int] | np.ndarray
    IntMatrix = list[list[int]] | np.ndarray
    FloatMatrix = list[list[float]] | np.ndarray
else:

    class IntVector(WireArray):
        """Ints of one dimension, e.g. token ids."""

        kind, ndim, list_type = np.integer, 1, list[int]

    class IntMatrix(WireArray):
        """Ints of two dimensions, e.g. the top-k token ids of each position."""

        kind, ndim, list_type = np.integer, 2, list[list[int]]

    class FloatMatrix(WireArray):
        """Floats of two dimensions, e.g. the top-k logprobs of each position."""

        kind, ndim, list_type = np.floating, 2, list[list[float]]


class ArrayHeader(msgspec.Struct, array_like=True, gc=False):
    """The data of an array Ext: dtype name, shape, and the index of its buffer frame."""

    dtype: str
    shape: list[int]
    buffer: int


_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(ArrayHeader)


def tolist(values: list[Any] | np.ndarray) -> list[Any]:
    """values as (nested) Python lists: what a decoded array field holds, ready for plain code."""
    return values.tolist() if isinstance(values, np.ndarray) else values


class FrameEncoder:
    """Encodes messages as [payload, *buffers]; one per thread (it is not thread-safe)."""

    def __init__(self) -> None:
        self._buffers: list[memoryview] = []
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)

    def encode(self, msg: Any) -> list[bytes | memoryview]:
        """The payload frame, then one frame per large array; the views keep their arrays alive."""
        self._buffers = []
        payload = self._encoder.encode(msg)
        return [payload, *self._buffers]

    def _enc_hook(self, obj: Any) -> Any:
        if not isinstance(obj, np.ndarray):
            raise NotImplementedError(f"cannot encode objects of type {type(obj).__name__}")
        dtype = WIRE_DTYPES.get(obj.dtype.name)
        if dtype is None:
            raise TypeError(f"cannot send a {obj.dtype} array; use one of {', '.join(WIRE_DTYPES)}")
        if obj.nbytes < INLINE_MAX_BYTES:
            return obj.tolist()
        array = np.ascontiguousarray(obj, dtype=dtype)  # a no-op for the usual arrays
        self._buffers.append(array.data.cast("B"))
        header = ArrayHeader(dtype.name, list(array.shape), len(self._buffers) - 1)
        return msgspec.msgpack.Ext(ARRAY_EXT_CODE, _header_encoder.encode(header))


class FrameDecoder:
    """Decodes [payload, *buffers] as one type; one per thread (it is not thread-safe).

    An array Ext becomes a read-only np.frombuffer view of its buffer frame. Raises ValueError
    (msgspec's DecodeError and ValidationError are ones) for a malformed payload or array.
    """

    def __init__(self, type_: Any) -> None:
        self._buffers: list[memoryview] = []
        self._decoder = msgspec.msgpack.Decoder(type_, ext_hook=self._ext_hook, dec_hook=_dec_hook)

    def decode(self, payload: Any, buffers: list[Any] | tuple[Any, ...] = ()) -> Any:
        """Decode payload (any buffer); buffers are the frames after it (any buffers)."""
        self._buffers = [memoryview(b) for b in buffers]
        try:
            return self._decoder.decode(payload)
        finally:
            self._buffers = []

    def _ext_hook(self, code: int, data: memoryview) -> np.ndarray:
        if code != ARRAY_EXT_CODE:
            raise ValueError(f"unknown msgpack extension type {code}; arrays use {ARRAY_EXT_CODE}")
        try:
            header = _header_decoder.decode(data)
        except msgspec.DecodeError as e:
            raise ValueError(f"malformed array extension: {e}") from None
        dtype = WIRE_DTYPES.get(header.dtype)
        if dtype is None:
            raise ValueError(
                f"array dtype {header.dtype!r} is not allowed; use one of {', '.join(WIRE_DTYPES)}"
            )
        if not 0 <= header.buffer < len(self._buffers):
            raise ValueError(
                f"array buffer frame {header.buffer} does not exist; the message "
                f"has {len(self._buffers)} buffer frames"
            )
        if any(n < 0 for n in header.shape):
            raise ValueError(f"array shape {header.shape} has a negative dimension")
        buffer = self._buffers[header.buffer]
        if math.prod(header.shape) * dtype.itemsize != buffer.nbytes:
            raise ValueError(
                f"a {header.dtype} array of shape {header.shape} needs "
                f"{math.prod(header.shape) * dtype.itemsize} bytes; its buffer "
                f"frame has {buffer.nbytes}"
            )
        return np.frombuffer(buffer, dtype).reshape(header.shape)


def _dec_hook(type_: Any, obj: Any) -> Any:
    if not (isinstance(type_, type) and issubclass(type_, WireArray)):
        raise NotImplementedError(f"cannot decode type {type_}")
    spec = type_
    if not isinstance(obj, np.ndarray):
        return msgspec.convert(obj, spec.list_type)
    if not np.issubdtype(obj.dtype, spec.kind) or obj.ndim != spec.ndim:
        raise ValueError(
            f"expected a {spec.ndim}-dimensional {spec.kind.__name__} array, got "
            f"a {obj.ndim}-dimensional {obj.dtype} array"
        )
    return obj
