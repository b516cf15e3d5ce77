"""Helpers: build requests, collect a client's outputs until requests finish."""

from __future__ import annotations

from typing import Any

from protocol.engine_core import EngineCoreRequest, FinishReason
from protocol.sampling_params import SamplingParams

PROMPTS = [
    [1, 17, 250, 3, 99],
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
    [400, 401],
    [33] * 40,
]


def greedy_request(request_id: str, prompt: list[int], max_tokens: int = 12) -> EngineCoreRequest:
    """A greedy request that ignores EOS, so it runs exactly max_tokens steps."""
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
    return EngineCoreRequest(request_id, prompt, params)


def collect(client: Any, request_ids: set[str]) -> dict[str, tuple[list[int], FinishReason]]:
    """Tokens and finish reason of each request, reading get_output() until all have finished."""
    tokens: dict[str, list[int]] = {r: [] for r in request_ids}
    done: dict[str, tuple[list[int], FinishReason]] = {}
    while len(done) < len(request_ids):
        for out in client.get_output().outputs:
            assert out.request_id in request_ids, f"got another client's output {out.request_id}"
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                done[out.request_id] = (tokens[out.request_id], out.finish_reason)
    return done
