"""The tokenizer process's live requests: the output pipeline's deltas as RequestDeltas for the
API server that owns each request, with the request statistics recorded along the way."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from protocol.engine_core import EngineCoreOutput
from protocol.sampling_params import SamplingParams
from protocol.tokenizer import PositionLogprobs, RequestDelta, TokenLogprob
from tokenizer_proc.output_processor import OutputProcessor
from tokenizer_proc.request_output import Logprob

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from metrics.request_stats import RequestStatsRecorder


class DeltaStreams:
    """Live requests of one tokenizer process, each owned by one API server (its socket
    identity)."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, stats: RequestStatsRecorder | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.stats = stats
        self._outputs = OutputProcessor(tokenizer)
        # Sent on a request's first delta, then dropped (GenerateRequest.return_prompt_token_ids).
        self._prompt_token_ids: dict[str, list[int]] = {}

    def __len__(self) -> int:
        return len(self._outputs)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._outputs

    def add(
        self,
        request_id: str,
        owner: bytes,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float = 0.0,
        engine: int = 0,
    ) -> list[str]:
        """Track a request served by engine (DP rank) `engine`; returns the engine request ids
        of its n completions."""
        child_ids = self._outputs.add_request(request_id, prompt_token_ids, params, owner)
        if self.stats is not None:
            self.stats.on_request(params.n, engine)
            for child_id in child_ids:
                self.stats.on_arrival(
                    child_id, arrival_time or time.time(), engine, params.max_tokens
                )
        return child_ids

    def process(
        self, outputs: list[EngineCoreOutput], engine_timestamp: float = 0.0, engine: int = 0
    ) -> tuple[list[tuple[bytes, RequestDelta]], list[str]]:
        """One step's outputs of engine `engine`: the deltas with their owners, and engine ids
        to abort (stop strings)."""
        now = time.time()
        if self.stats is not None:
            self.stats.on_step(engine_timestamp or now, engine)
            for out in outputs:
                if self._outputs.request_of_child(out.request_id) is not None:
                    self.stats.on_tokens(out.request_id, len(out.new_token_ids), now)
        deltas, to_abort = self._outputs.process_outputs(outputs)
        returned = self._prompt_token_ids
        sent = []
        for d in deltas:
            request = d.request
            prompt_logprobs = None
            if d.prompt_logprobs is not None:
                prompt_logprobs = [None, *map(_token_logprobs, d.prompt_logprobs[1:])]
            sent.append(
                (
                    request.owner,
                    RequestDelta(
                        request.request_id,
                        d.index,
                        d.text,
                        d.token_ids,
                        None if d.logprobs is None else list(map(_token_logprobs, d.logprobs)),
                        prompt_logprobs,
                        d.finish_reason,
                        d.stop_reason,
                        request.num_prompt_tokens,
                        request.num_cached_tokens,
                        returned.pop(request.request_id, None) if returned else None,
                        d.prefill_chunks,
                    ),
                )
            )
            if d.finish_reason is not None and self.stats is not None:
                self.stats.on_finish(d.child_id, d.finish_reason, request.num_prompt_tokens, now)
        return sent, to_abort

    def remove(self, request_id: str, owner: bytes | None = None) -> list[str]:
        """Forget a request (only if owner owns it, when given); returns its live engine ids."""
        request = self._outputs.get(request_id)
        if request is None or (owner is not None and request.owner != owner):
            return []
        self._prompt_token_ids.pop(request_id, None)
        live = self._outputs.abort_request(request_id)
        if self.stats is not None:
            now = time.time()
            for child_id in live:
                self.stats.on_finish(child_id, "abort", request.num_prompt_tokens, now)
        return live

    def return_prompt_token_ids(self, request_id: str, prompt_token_ids: list[int]) -> None:
        """Send a tracked request's prompt token ids with its first delta."""
        if request_id not in self._outputs:
            raise KeyError(request_id)
        self._prompt_token_ids[request_id] = list(prompt_token_ids)

    def owner_of_child(self, child_id: str) -> tuple[str, bytes] | None:
        """(request id, owner) of a live engine request id."""
        request = self._outputs.request_of_child(child_id)
        return None if request is None else (request.request_id, request.owner)

    def live(self) -> list[tuple[str, bytes]]:
        """(request id, owner) of every live request."""
        return [(r.request_id, r.owner) for r in self._outputs.requests()]


def _token_logprobs(position: dict[int, Logprob]) -> PositionLogprobs:
    return [
        TokenLogprob(token_id, p.logprob, p.rank, p.decoded_token)
        for token_id, p in position.items()
    ]
