"""engine_core/stream_gate.py: with --stream-interval N the engine core holds a request's step
outputs until they carry N tokens; the first token, prompt logprobs and the finish go out at
once, and what a client receives adds up to what it gets with every step sent."""

from __future__ import annotations

import pytest

from engine_core.client import EngineCoreClient
from engine_core.stream_gate import StreamGate
from protocol.engine_core import EngineCoreOutput, EngineCoreRequest, FinishReason, Logprobs
from protocol.sampling_params import SamplingParams
from tests.engine_core_proc.utils import PROMPTS


def step(request_id, tokens, finish=None, **kwargs) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, list(tokens), finish_reason=finish, **kwargs)


def lp(tokens) -> Logprobs:
    return Logprobs([[t, t + 1] for t in tokens], [[-0.5, -1.5]] * len(tokens), [1] * len(tokens))


def test_first_token_then_every_interval_then_the_finish():
    gate = StreamGate(4)
    sent = []
    for i in range(10):
        out = gate.admit(step("r", [100 + i], FinishReason.LENGTH if i == 9 else None))
        sent.append(None if out is None else out.new_token_ids)
    assert sent == [
        [100],
        None,
        None,
        None,
        [101, 102, 103, 104],
        None,
        None,
        None,
        [105, 106, 107, 108],
        [109],
    ]
    assert len(gate) == 0


def test_joined_outputs_keep_logprobs_in_order():
    gate = StreamGate(3)
    first = gate.admit(
        step("r", [1], new_logprobs=lp([1]), num_cached_tokens=16, prefill_chunks=[(1.0, 5)])
    )
    assert first.num_cached_tokens == 16 and first.prefill_chunks == [(1.0, 5)]
    assert gate.admit(step("r", [2], new_logprobs=lp([2]))) is None
    out = gate.admit(step("r", [3, 4], new_logprobs=lp([3, 4])))
    assert out.new_token_ids == [2, 3, 4]
    assert out.new_logprobs.token_ids == [[2, 3], [3, 4], [4, 5]]
    assert out.new_logprobs.ranks == [1, 1, 1]
    assert gate.admit(step("r", [5], new_logprobs=lp([5]))) is None
    last = gate.admit(step("r", [], FinishReason.ABORT))
    assert (last.new_token_ids, last.finish_reason) == ([5], FinishReason.ABORT)
    assert last.new_logprobs.token_ids == [[5, 6]]


def test_prompt_logprob_chunks_go_out_and_do_not_delay_the_first_token():
    """Chunked prefill with prompt logprobs: outputs without a token come before the first
    token; each goes out at once, and so does the first token."""
    gate = StreamGate(8)
    chunk = lp([7, 8])
    assert gate.admit(step("r", [], new_prompt_logprobs=chunk)) is not None
    assert gate.admit(step("r", [], new_prompt_logprobs=chunk)) is not None
    assert gate.admit(step("r", [9], new_prompt_logprobs=chunk)).new_token_ids == [9]
    assert gate.admit(step("r", [10])) is None


def test_requests_are_held_apart_and_forget_drops_one():
    gate = StreamGate(2)
    for r in ("a", "b"):
        assert gate.admit(step(r, [1])) is not None
        assert gate.admit(step(r, [2])) is None
    gate.forget("a")
    assert len(gate) == 1
    assert gate.admit(step("b", [3])).new_token_ids == [2, 3]
    with pytest.raises(ValueError, match="at least 1"):
        StreamGate(0)


def _stream(engine_args: dict, requests: list[EngineCoreRequest]) -> dict:
    """Each request's outputs as a client received them: (token chunks, logprobs, finish)."""
    received: dict[str, list[EngineCoreOutput]] = {r.request_id: [] for r in requests}
    with EngineCoreClient(engine_args=engine_args) as client:
        for request in requests:
            client.add_request(request)
        done = 0
        while done < len(requests):
            for out in client.get_output().outputs:
                received[out.request_id].append(out)
                done += out.finished
    return received


def test_engine_core_sends_chunks_that_add_up_to_every_step(engine_args):
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=13, logprobs=2)
    requests = [EngineCoreRequest(f"r{i}", p, params) for i, p in enumerate(PROMPTS)]
    every = _stream(engine_args, requests)
    chunked = _stream({**engine_args, "stream_interval": 5}, requests)
    for request_id, outs in chunked.items():
        # 13 tokens: the first, two chunks of five, the last two with the finish.
        assert [len(o.new_token_ids) for o in outs] == [1, 5, 5, 2]
        steps = every[request_id]
        assert [t for o in outs for t in o.new_token_ids] == [
            t for o in steps for t in o.new_token_ids
        ]
        assert [r for o in outs for r in o.new_logprobs.token_ids] == [
            r for o in steps for r in o.new_logprobs.token_ids
        ]
        assert outs[-1].finish_reason == steps[-1].finish_reason == FinishReason.LENGTH
