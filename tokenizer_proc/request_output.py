"""RequestOutput and CompletionOutput: what a user of the offline API gets back (vLLM's shape),
gathered from the output pipeline's deltas; Logprob, one token's entry in their logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec


class Logprob(msgspec.Struct, array_like=True, gc=False):
    """One token's log probability, its rank in the vocabulary (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: token id -> Logprob; the sampled token is always among the keys.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    # The stop string or stop token id that ended the sequence; None for EOS, length or abort.
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        """True once the sequence has ended."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's prompt and its n completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)

    @classmethod
    def empty(
        cls,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        n: int,
        with_logprobs: bool,
    ) -> RequestOutput:
        """A request's output before any token: n empty completions."""
        return cls(
            request_id,
            prompt,
            prompt_token_ids,
            None,
            [
                CompletionOutput(
                    i, "", [], 0.0 if with_logprobs else None, [] if with_logprobs else None
                )
                for i in range(n)
            ],
            False,
        )
