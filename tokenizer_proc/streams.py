"""Per-request streaming state of a tokenizer process: engine outputs in, RequestDeltas out."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine_core.protocol import EngineCoreOutput, FinishReason, Logprobs
from engine_core.sampling_params import SamplingParams
from gpu_worker.protocol import LogprobsLists
from tokenizer_proc.detokenizer import IncrementalDetokenizer, convert_logprobs
from tokenizer_proc.output_processor import child_request_ids
from tokenizer_proc.protocol import PositionLogprobs, RequestDelta, TokenLogprob

if TYPE_CHECKING:
    from metrics.request_stats import RequestStatsRecorder


@dataclass
class _Stream:
    """A request, owned by one API server (its socket identity), with n completions."""

    request_id: str
    owner: bytes
    params: SamplingParams
    num_prompt_tokens: int
    detokenizers: dict[str, tuple[int, IncrementalDetokenizer]] = field(default_factory=dict)
    sent_prompt_logprobs: bool = False
    num_cached_tokens: int = 0
    # Sent on the first delta, then dropped (GenerateRequest.return_prompt_token_ids).
    prompt_token_ids: list[int] | None = None


class DeltaStreams:
    """Live requests of one tokenizer process, keyed by request id and by engine (child) id."""

    def __init__(self, tokenizer, stats: RequestStatsRecorder | None = None) -> None:
        self.tokenizer = tokenizer
        self.stats = stats
        self._streams: dict[str, _Stream] = {}
        self._children: dict[str, _Stream] = {}

    def __len__(self) -> int:
        return len(self._streams)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._streams

    def add(self, request_id: str, owner: bytes, prompt_token_ids: list[int],
            params: SamplingParams, arrival_time: float = 0.0, engine: int = 0) -> list[str]:
        """Track a request served by engine (DP rank) `engine`; returns the engine request ids
        of its n completions."""
        stream = _Stream(request_id, owner, params, len(prompt_token_ids))
        child_ids = child_request_ids(request_id, params.n)
        if self.stats is not None:
            self.stats.on_request(params.n, engine)
        for index, child_id in enumerate(child_ids):
            if self.stats is not None:
                self.stats.on_arrival(child_id, arrival_time or time.time(), engine,
                                      params.max_tokens)
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
            stream.detokenizers[child_id] = (index, detok)
            self._children[child_id] = stream
        self._streams[request_id] = stream
        return child_ids

    def process(self, outputs: list[EngineCoreOutput], engine_timestamp: float = 0.0,
                engine: int = 0) -> tuple[list[tuple[bytes, RequestDelta]], list[str]]:
        """One step's outputs of engine `engine`: the deltas with their owners, and engine ids
        to abort (stop strings)."""
        deltas: list[tuple[bytes, RequestDelta]] = []
        to_abort: list[str] = []
        now = time.time()
        if self.stats is not None:
            self.stats.on_step(engine_timestamp or now, engine)
        for out in outputs:
            stream = self._children.get(out.request_id)
            if stream is None:
                continue  # forgotten after a stop string or an abort
            if self.stats is not None:
                self.stats.on_tokens(out.request_id, len(out.new_token_ids), now)
            index, detok = stream.detokenizers[out.request_id]
            stop = detok.update(out.new_token_ids, out.finished,
                                out.finish_reason == FinishReason.STOP)
            finish_reason, stop_reason = None, None
            if stop is not None:
                finish_reason, stop_reason = "stop", stop
                if not out.finished:
                    to_abort.append(out.request_id)
            elif out.finished:
                finish_reason, stop_reason = str(out.finish_reason), out.stop_reason
            if out.num_cached_tokens:
                stream.num_cached_tokens = out.num_cached_tokens
            prompt_logprobs = None
            if out.new_prompt_logprobs is not None and not stream.sent_prompt_logprobs:
                stream.sent_prompt_logprobs = True
                prompt_logprobs = [None, *self._logprobs(out.new_prompt_logprobs)]
            delta = RequestDelta(
                stream.request_id, index, detok.get_next_delta(), list(out.new_token_ids),
                self._logprobs(out.new_logprobs) if out.new_logprobs is not None else None,
                prompt_logprobs, finish_reason, stop_reason, stream.num_prompt_tokens,
                stream.num_cached_tokens, stream.prompt_token_ids, out.prefill_chunks)
            stream.prompt_token_ids = None
            deltas.append((stream.owner, delta))
            if finish_reason is not None:
                self._finish_child(out.request_id)
                if self.stats is not None:
                    self.stats.on_finish(out.request_id, finish_reason, stream.num_prompt_tokens,
                                         now)
        return deltas, to_abort

    def remove(self, request_id: str, owner: bytes | None = None) -> list[str]:
        """Forget a request (only if owner owns it, when given); returns its live engine ids."""
        stream = self._streams.get(request_id)
        if stream is None or (owner is not None and stream.owner != owner):
            return []
        del self._streams[request_id]
        live = [c for c in stream.detokenizers if c in self._children]
        now = time.time()
        for child_id in live:
            del self._children[child_id]
            if self.stats is not None:
                self.stats.on_finish(child_id, "abort", stream.num_prompt_tokens, now)
        return live

    def return_prompt_token_ids(self, request_id: str, prompt_token_ids: list[int]) -> None:
        """Send a tracked request's prompt token ids with its first delta."""
        self._streams[request_id].prompt_token_ids = list(prompt_token_ids)

    def owner_of_child(self, child_id: str) -> tuple[str, bytes] | None:
        """(request id, owner) of a live engine request id."""
        stream = self._children.get(child_id)
        return None if stream is None else (stream.request_id, stream.owner)

    def live(self) -> list[tuple[str, bytes]]:
        """(request id, owner) of every live request."""
        return [(s.request_id, s.owner) for s in self._streams.values()]

    def _finish_child(self, child_id: str) -> None:
        stream = self._children.pop(child_id)
        if not any(c in self._children for c in stream.detokenizers):
            del self._streams[stream.request_id]

    def _logprobs(self, lp: LogprobsLists | Logprobs) -> list[PositionLogprobs]:
        return [[TokenLogprob(token_id, p.logprob, p.rank, p.decoded_token)
                 for token_id, p in position.items()]
                for position in convert_logprobs(self.tokenizer, lp)]
