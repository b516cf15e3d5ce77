"""--stream-interval as the tokenizer process sees it: the engine core's gate
(engine_core/stream_gate.py) joins a completion's outputs to that many tokens, its first and its
last sent at once, and the deltas the tokenizer process makes of them (tokenizer_proc/streams.py:
detokenizing, stop strings, logprobs) add up to exactly what every-token streaming sends."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from config.args import add_engine_args, engine_kwargs
from config.errors import ConfigError
from config.scheduler import SchedulerConfig
from engine_core.stream_gate import StreamGate
from protocol.engine_core import EngineCoreOutput, FinishReason, Logprobs
from protocol.sampling_params import SamplingParams
from tokenizer_proc.streams import DeltaStreams

PROMPT = [1, 2, 3]


def out(child_id: str, token_ids: list[int], finish=None, **kwargs) -> EngineCoreOutput:
    return EngineCoreOutput(child_id, token_ids, finish_reason=finish, **kwargs)


def token_counts(sent) -> list[int]:
    return [len(d.token_ids) for _, d in sent]


def gated(gate: StreamGate | None, step: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
    """What the engine core sends of one step's outputs."""
    if gate is None:
        return step
    return [sent for o in step if (sent := gate.admit(o)) is not None]


def test_first_token_at_once_then_every_interval_then_the_end(tokenizer):
    streams, gate = DeltaStreams(tokenizer), StreamGate(4)
    streams.add("r", b"api", PROMPT, SamplingParams(max_tokens=10))
    per_step = []
    for i in range(10):
        finish = FinishReason.LENGTH if i == 9 else None
        sent, _ = streams.process(gated(gate, [out("r", [100 + i], finish)]))
        per_step.append(token_counts(sent))
    # Step 1 (the first token), steps 5 and 9 (four gathered each), step 10 (the end).
    assert per_step == [[1], [], [], [], [4], [], [], [], [4], [1]]
    assert len(streams) == 0 and len(gate) == 0


def _run(tokenizer, interval: int, steps, params: SamplingParams):
    """Every delta each completion was sent, and the aborts, for the given engine steps."""
    streams = DeltaStreams(tokenizer)
    gate = StreamGate(interval) if interval > 1 else None
    child_ids = streams.add("r", b"api", PROMPT, params)
    sent, aborts = [], []
    for step in steps:
        deltas, to_abort = streams.process(
            gated(gate, [o for o in step if o.request_id in child_ids])
        )
        sent += [d for _, d in deltas]
        aborts += to_abort
    return sent, aborts


def _completion(sent, index: int) -> dict:
    mine = [d for d in sent if d.index == index]
    return {
        "text": "".join(d.text for d in mine),
        "token_ids": [t for d in mine for t in d.token_ids],
        "logprobs": [p for d in mine for p in (d.logprobs or [])],
        "prompt_logprobs": [d.prompt_logprobs for d in mine if d.prompt_logprobs is not None],
        "finish": (mine[-1].finish_reason, mine[-1].stop_reason),
        "prefill_chunks": [c for d in mine for c in d.prefill_chunks],
        "first_len": len(mine[0].token_ids),
        "chunks": len(mine),
    }


@pytest.mark.parametrize("interval", [2, 3, 7])
def test_chunks_add_up_to_every_token_streaming(tokenizer, interval):
    """Two completions (n=2) with logprobs, prompt logprobs, a stop string that cuts one of them
    (its engine request aborted), steps of 1-3 tokens: the same text, tokens, logprobs, finish
    and prefill chunks as with every token streamed; the first delta carries one step only."""
    rng = np.random.default_rng(interval)
    words = tokenizer.encode(" alpha beta gamma delta epsilon zeta eta theta iota kappa lambda")
    stop_at = tokenizer.encode(" STOP")
    params = SamplingParams(n=2, logprobs=1, prompt_logprobs=1, stop=[" STOP"], max_tokens=40)
    prompt_lp = Logprobs([[1, 1], [2, 2], [3, 3]], [[-1.0] * 2] * 3, [1, 1, 1])
    streams = {"0_r": list(words) + stop_at + words[:3], "1_r": list(words) * 2}
    steps, pos = [], {c: 0 for c in streams}
    while any(pos[c] < len(ids) for c, ids in streams.items()):
        step = []
        for child, ids in streams.items():
            if pos[child] >= len(ids):
                continue
            take = ids[pos[child] : pos[child] + int(rng.integers(1, 4))]
            pos[child] += len(take)
            done = FinishReason.LENGTH if pos[child] >= len(ids) else None
            step.append(
                out(
                    child,
                    take,
                    done,
                    new_logprobs=Logprobs(
                        [[t, t] for t in take], [[-0.5, -0.5]] * len(take), [1] * len(take)
                    ),
                    new_prompt_logprobs=prompt_lp if len(steps) == 0 else None,
                    prefill_chunks=[(1.0, 3)] if len(steps) == 0 else [],
                )
            )
        steps.append(step)
    every, every_abort = _run(tokenizer, 1, steps, params)
    gathered, gathered_abort = _run(tokenizer, interval, steps, params)
    assert gathered_abort == every_abort == ["0_r"]
    for index in (0, 1):
        a, b = _completion(every, index), _completion(gathered, index)
        assert b["first_len"] == a["first_len"]
        assert b["chunks"] < a["chunks"]
        for key in ("text", "token_ids", "logprobs", "prompt_logprobs", "finish", "prefill_chunks"):
            assert b[key] == a[key], key
    assert _completion(gathered, 0)["finish"] == ("stop", " STOP")


def test_a_request_removed_with_held_tokens_sends_nothing_more(tokenizer):
    streams, gate = DeltaStreams(tokenizer), StreamGate(8)
    streams.add("r", b"api", PROMPT, SamplingParams(max_tokens=20))
    assert token_counts(streams.process(gated(gate, [out("r", [100])]))[0]) == [1]
    assert streams.process(gated(gate, [out("r", [101, 102])]))[0] == []  # held
    assert streams.remove("r") == ["r"]
    assert streams.process(gated(gate, [out("r", [103], FinishReason.ABORT)]))[0] == []
    assert len(gate) == 0


def test_interval_one_sends_every_step(tokenizer):
    streams = DeltaStreams(tokenizer)
    streams.add("r", b"api", PROMPT, SamplingParams(max_tokens=3))
    counts = [token_counts(streams.process([out("r", [100 + i])])[0]) for i in range(3)]
    assert counts == [[1], [1], [1]]


def test_the_flag_and_its_limits():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args(["--stream-interval", "16"]))["stream_interval"] == 16
    with pytest.raises(ConfigError, match="stream_interval must be at least 1"):
        SchedulerConfig(stream_interval=0)
    with pytest.raises(ValueError, match="stream interval must be at least 1"):
        StreamGate(0)
