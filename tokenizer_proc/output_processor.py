"""OutputProcessor: turns the engine core's token outputs into RequestOutputs with text.

Keeps each sequence's incremental detokenizer, applies stop strings (reporting which engine
requests to abort), converts logprobs to token strings, and gathers the n sequences of a
request (sent to the engine core as n child requests) into one RequestOutput.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from engine_core.protocol import EngineCoreOutput, FinishReason
from engine_core.sampling_params import SamplingParams
from tokenizer_proc.detokenizer import IncrementalDetokenizer, convert_logprobs
from tokenizer_proc.request_output import CompletionOutput, RequestOutput


@dataclass
class _Sequence:
    """One child request: one completion of its parent."""

    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[_Sequence]
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0
    num_finished: int = 0


def child_request_ids(request_id: str, n: int) -> list[str]:
    """Engine-core ids of a request's n sequences (the id itself when n == 1)."""
    return [request_id] if n == 1 else [f"{i}_{request_id}" for i in range(n)]


def child_sampling_params(params: SamplingParams, index: int) -> SamplingParams:
    """Params of sequence `index`: n=1, and a distinct seed so seeded samples differ."""
    seed = None if params.seed is None else params.seed + index
    return msgspec.structs.replace(params, n=1, seed=seed)


class OutputProcessor:
    """Per-request output state, keyed by the engine core's (child) request ids."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _Parent] = {}
        self._children: dict[str, tuple[_Parent, _Sequence]] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams) -> list[str]:
        """Track a request; returns the child ids to send to the engine core."""
        child_ids = child_request_ids(request_id, params.n)
        parent = _Parent(request_id, prompt, prompt_token_ids, params, [])
        for index, child_id in enumerate(child_ids):
            seq = _Sequence(index, IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params),
                            logprobs=[] if params.logprobs is not None else None,
                            cumulative_logprob=0.0 if params.logprobs is not None else None)
            parent.sequences.append(seq)
            self._children[child_id] = (parent, seq)
        self._parents[request_id] = parent
        return child_ids

    def has_unfinished_requests(self) -> bool:
        """True while any tracked request has an unfinished sequence."""
        return bool(self._parents)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Apply one step's outputs: the RequestOutputs that changed, and child ids to abort."""
        changed: dict[str, _Parent] = {}
        to_abort: list[str] = []
        for out in outputs:
            entry = self._children.get(out.request_id)
            if entry is None:
                continue
            parent, seq = entry
            if out.new_prompt_logprobs is not None and parent.prompt_logprobs is None:
                parent.prompt_logprobs = [None] + convert_logprobs(self.tokenizer,
                                                                   out.new_prompt_logprobs)
            if out.num_cached_tokens:
                parent.num_cached_tokens = out.num_cached_tokens
            seq.token_ids.extend(out.new_token_ids)
            if seq.logprobs is not None and out.new_logprobs is not None:
                seq.logprobs.extend(convert_logprobs(self.tokenizer, out.new_logprobs))
                seq.cumulative_logprob += sum(float(row[0]) for row in out.new_logprobs.logprobs)
            stop = seq.detokenizer.update(out.new_token_ids, out.finished,
                                         out.finish_reason == FinishReason.STOP)
            if stop is not None and not out.finished:
                seq.finish_reason, seq.stop_reason = "stop", stop
                to_abort.append(out.request_id)
            elif out.finished:
                seq.finish_reason = str(out.finish_reason)
                seq.stop_reason = stop if stop is not None else out.stop_reason
                if stop is not None:
                    seq.finish_reason = "stop"
            if seq.finish_reason is not None:
                parent.num_finished += 1
                del self._children[out.request_id]
            changed[parent.request_id] = parent
        results = []
        for parent in changed.values():
            finished = parent.num_finished == len(parent.sequences)
            if finished:
                del self._parents[parent.request_id]
            results.append(self._request_output(parent, finished))
        return results, to_abort

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget requests; returns the child ids the engine core must abort."""
        children = []
        for request_id in request_ids:
            parent = self._parents.pop(request_id, None)
            if parent is None:
                continue
            ids = child_request_ids(request_id, parent.params.n)
            children.extend(i for i in ids if self._children.pop(i, None) is not None)
        return children

    @staticmethod
    def _request_output(parent: _Parent, finished: bool) -> RequestOutput:
        completions = [
            CompletionOutput(index=s.index, text=s.detokenizer.output_text, token_ids=list(s.token_ids),
                             cumulative_logprob=s.cumulative_logprob,
                             logprobs=list(s.logprobs) if s.logprobs is not None else None,
                             finish_reason=s.finish_reason, stop_reason=s.stop_reason)
            for s in parent.sequences
        ]
        return RequestOutput(request_id=parent.request_id, prompt=parent.prompt,
                             prompt_token_ids=parent.prompt_token_ids,
                             prompt_logprobs=parent.prompt_logprobs, outputs=completions,
                             finished=finished, num_cached_tokens=parent.num_cached_tokens)
