"""The array codec (protocol/frames.py): round trips inline and as frames, zero copies."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from protocol.engine_core import EngineCoreRequest, OutputType, output_decoders
from protocol.frames import (
    INLINE_MAX_BYTES,
    FloatMatrix,
    FrameDecoder,
    FrameEncoder,
    IntMatrix,
    IntVector,
)
from protocol.sampling_params import SamplingParams


class Arrays(msgspec.Struct, array_like=True):
    ints: IntVector
    matrix: IntMatrix | None = None
    floats: FloatMatrix | None = None


def _round_trip(msg: Arrays) -> tuple[Arrays, list]:
    payload, *buffers = FrameEncoder().encode(msg)
    return FrameDecoder(Arrays).decode(payload, buffers), buffers


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_large_int_arrays_travel_as_frames(dtype):
    ints = np.arange(1000, dtype=dtype) - 500
    matrix = np.arange(600, dtype=dtype).reshape(20, 30)
    got, buffers = _round_trip(Arrays(ints, matrix))
    assert len(buffers) == 2
    for sent, received in ((ints, got.ints), (matrix, got.matrix)):
        assert received.dtype == dtype and received.shape == sent.shape
        assert np.array_equal(received, sent)


def test_float32_matrix_is_exact_and_a_view_of_its_frame():
    floats = np.random.default_rng(0).standard_normal((7, 512)).astype(np.float32)
    got, buffers = _round_trip(Arrays([1], floats=floats))
    assert got.floats.dtype == np.float32 and np.array_equal(got.floats, floats)
    assert np.shares_memory(got.floats, np.frombuffer(buffers[0], np.uint8))  # not copied


def test_sender_frames_are_the_arrays_own_memory():
    ints = np.arange(1000, dtype=np.int32)
    _, buffer = FrameEncoder().encode(Arrays(ints))
    assert np.shares_memory(np.frombuffer(buffer, np.int32), ints)


def test_small_and_empty_arrays_stay_inline_lists():
    small = np.arange(INLINE_MAX_BYTES // 4 - 1, dtype=np.int32)
    got, buffers = _round_trip(
        Arrays(small, np.zeros((0, 3), np.int64), np.zeros((2, 2), np.float32))
    )
    assert buffers == []
    assert got.ints == small.tolist() and got.matrix == [] and got.floats == [[0.0, 0.0]] * 2


def test_lists_are_accepted_wherever_arrays_are():
    got, buffers = _round_trip(Arrays([1, 2, 3], [[1, 2], [3, 4]], [[0.5]]))
    assert buffers == [] and got == Arrays([1, 2, 3], [[1, 2], [3, 4]], [[0.5]])
    with pytest.raises(msgspec.ValidationError, match="Expected `int`, got `float`"):
        FrameDecoder(Arrays).decode(msgspec.msgpack.encode([[1.5]]))


def test_only_wire_dtypes_are_sent():
    with pytest.raises(TypeError, match="cannot send a float64 array"):
        FrameEncoder().encode(Arrays(np.zeros(100)))


def test_a_long_prompt_travels_as_a_frame_and_decodes_as_the_engine_core_does():
    from engine_core.client import _with_prompt_array

    prompt = list(range(3, 203))
    request = _with_prompt_array(EngineCoreRequest("r", prompt, SamplingParams()))
    payload, *buffers = FrameEncoder().encode(request)
    assert len(buffers) == 1 and len(buffers[0]) == 4 * len(prompt)
    decoded = FrameDecoder(EngineCoreRequest).decode(payload, buffers)
    assert decoded.prompt_token_ids.tolist() == prompt


def test_output_decoders_take_buffer_frames():
    decoder = output_decoders()[OutputType.OUTPUTS]
    outputs = decoder.decode(msgspec.msgpack.encode([[["r", [5]]]]), []).outputs
    assert outputs[0].new_token_ids == [5]
