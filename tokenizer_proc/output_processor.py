"""OutputProcessor: the one output pipeline, from the engine core's token outputs to text.

Used by the offline LLM (frontend/llm.py, which gathers the deltas into RequestOutputs) and by
the tokenizer process (tokenizer_proc/streams.py, which sends them to API servers as
RequestDeltas). Per engine (child) request it detokenizes incrementally, holds back a possible
partial stop string, applies stop strings (reporting which engine requests to abort), decides
the finish and stop reasons, converts logprobs to token strings, and counts the n sequences of a
request (sent to the engine core as n child requests) until all have finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from protocol.engine_core import EngineCoreOutput, FinishReason, Logprobs
from protocol.sampling_params import SamplingParams
from tokenizer_proc.detokenizer import IncrementalDetokenizer, convert_logprobs
from tokenizer_proc.request_output import PromptLogprobs, RequestOutput, SampleLogprobs

if TYPE_CHECKING:  # transformers takes seconds to import
    from transformers import PreTrainedTokenizerBase


def child_request_ids(request_id: str, n: int) -> list[str]:
    """Engine-core ids of a request's n sequences (the id itself when n == 1)."""
    return [request_id] if n == 1 else [f"{i}_{request_id}" for i in range(n)]


def child_sampling_params(params: SamplingParams, index: int) -> SamplingParams:
    """Params of sequence `index`: n=1, and a distinct seed so seeded samples differ."""
    seed = None if params.seed is None else params.seed + index
    return msgspec.structs.replace(params, n=1, seed=seed)


@dataclass
class SequenceState:
    """One child request: one completion of its parent."""

    index: int
    detokenizer: IncrementalDetokenizer
    # Sum of the sampled tokens' logprobs, when the request asked for logprobs.
    cumulative_logprob: float | None = None


@dataclass
class RequestState:
    """A request and its n sequences, keyed by their engine (child) ids."""

    request_id: str
    params: SamplingParams
    num_prompt_tokens: int
    # Who receives the request's outputs (the tokenizer process: the API server's identity).
    owner: Any
    sequences: dict[str, SequenceState] = field(default_factory=dict)
    num_cached_tokens: int = 0
    prompt_logprobs_sent: bool = False
    num_finished: int = 0

    @property
    def finished(self) -> bool:
        """True once every sequence has finished."""
        return self.num_finished == len(self.sequences)


@dataclass(slots=True)
class SequenceDelta:
    """What one engine output added to one sequence of a request."""

    request: RequestState
    child_id: str
    index: int
    text: str  # new text; a possible partial stop string is held back until it is decided
    token_ids: list[int]
    logprobs: SampleLogprobs | None
    prompt_logprobs: PromptLogprobs | None  # on the request's first delta that has them
    cumulative_logprob: float | None
    finish_reason: str | None = None  # "stop", "length" or "abort" on the sequence's last delta
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    # EngineCoreOutput.prefill_chunks ([Unix time, tokens] each), on the sequence's first delta.
    prefill_chunks: list[tuple[float, int]] = field(default_factory=list)

    def apply_to(self, output: RequestOutput) -> None:
        """Append what this delta added to its completion of output (which is cumulative)."""
        completion = output.outputs[self.index]
        completion.text += self.text
        completion.token_ids.extend(self.token_ids)
        if completion.logprobs is not None and self.logprobs is not None:
            completion.logprobs.extend(self.logprobs)
        completion.cumulative_logprob = self.cumulative_logprob
        completion.finish_reason, completion.stop_reason = self.finish_reason, self.stop_reason
        if self.prompt_logprobs is not None:
            output.prompt_logprobs = self.prompt_logprobs
        output.num_cached_tokens = self.request.num_cached_tokens
        output.finished = self.request.finished


class OutputProcessor:
    """Live requests, keyed by request id and by engine (child) id."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, RequestState] = {}
        self._children: dict[str, tuple[RequestState, SequenceState]] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        owner: Any = None,
    ) -> list[str]:
        """Track a request; returns the engine ids of its n sequences, to send to the engine."""
        request = RequestState(request_id, params, len(prompt_token_ids), owner)
        cumulative = 0.0 if params.logprobs is not None else None
        for index, child_id in enumerate(child_request_ids(request_id, params.n)):
            seq = SequenceState(
                index, IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params), cumulative
            )
            request.sequences[child_id] = seq
            self._children[child_id] = (request, seq)
        self._requests[request_id] = request
        return list(request.sequences)

    def get(self, request_id: str) -> RequestState | None:
        """A live request, or None."""
        return self._requests.get(request_id)

    def request_of_child(self, child_id: str) -> RequestState | None:
        """The live request an engine id belongs to, or None."""
        entry = self._children.get(child_id)
        return None if entry is None else entry[0]

    def requests(self) -> list[RequestState]:
        """Every live request."""
        return list(self._requests.values())

    def process_outputs(
        self, outputs: list[EngineCoreOutput]
    ) -> tuple[list[SequenceDelta], list[str]]:
        """Apply one step's outputs: a delta per output of a live sequence, and the engine ids to
        abort (stopped by a stop string before the engine core saw them finish)."""
        deltas: list[SequenceDelta] = []
        to_abort: list[str] = []
        for out in outputs:
            entry = self._children.get(out.request_id)
            if entry is None:
                continue  # forgotten after a stop string or an abort
            request, seq = entry
            new_token_ids = out.new_token_ids
            stop = seq.detokenizer.update(
                new_token_ids, out.finished, out.finish_reason == FinishReason.STOP
            )
            kept = seq.detokenizer.num_kept  # fewer when a stop string ended inside them
            new_lp = out.new_logprobs
            if kept < len(new_token_ids):
                new_token_ids = new_token_ids[:kept]
                if new_lp is not None:
                    new_lp = Logprobs(
                        new_lp.token_ids[:kept], new_lp.logprobs[:kept], new_lp.ranks[:kept]
                    )
            finish_reason, stop_reason = None, None
            if stop is not None:
                finish_reason, stop_reason = "stop", stop
                if not out.finished:
                    to_abort.append(out.request_id)
            elif out.finished:
                finish_reason, stop_reason = str(out.finish_reason), out.stop_reason
            if out.num_cached_tokens:
                request.num_cached_tokens = out.num_cached_tokens
            prompt_logprobs = None
            if out.new_prompt_logprobs is not None and not request.prompt_logprobs_sent:
                request.prompt_logprobs_sent = True
                prompt_logprobs = [None, *convert_logprobs(self.tokenizer, out.new_prompt_logprobs)]
            logprobs = None
            if new_lp is not None:
                logprobs = convert_logprobs(self.tokenizer, new_lp)
                if seq.cumulative_logprob is not None:
                    seq.cumulative_logprob += sum(float(row[0]) for row in new_lp.logprobs)
            deltas.append(
                SequenceDelta(
                    request,
                    out.request_id,
                    seq.index,
                    seq.detokenizer.get_next_delta(),
                    list(new_token_ids),
                    logprobs,
                    prompt_logprobs,
                    seq.cumulative_logprob,
                    finish_reason,
                    stop_reason,
                    out.prefill_chunks,
                )
            )
            if finish_reason is not None:
                self._finish(out.request_id)
        return deltas, to_abort

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request; returns the engine ids of its unfinished sequences (to abort)."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return []
        live = [child_id for child_id in request.sequences if child_id in self._children]
        for child_id in live:
            del self._children[child_id]
        return live

    def _finish(self, child_id: str) -> None:
        request, _ = self._children.pop(child_id)
        request.num_finished += 1
        if request.finished:
            del self._requests[request.request_id]
