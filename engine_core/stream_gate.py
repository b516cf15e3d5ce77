"""--stream-interval at the source: a request's step outputs held in the engine core until they
carry that many tokens.

A streamed token costs each serving process a wake-up (the tokenizer process, the API server,
the HTTP client), and on a CPU those wake-ups land on the cores the model's step needs.
With an interval of N the engine core sends a request's outputs at most every N tokens: its
first output at once (the time to first token), the last one (finished) at once, and any output
carrying prompt logprobs at once; between those, each step's new tokens (and their logprobs) are
joined to the held output. What the client receives adds up to the same tokens, logprobs and
finish. Two costs, both bounded by the interval: a stop string (found by the tokenizer process)
is seen up to N - 1 tokens later, so the engine may compute up to N - 1 tokens that are then
dropped; and the inter-token latency histogram sees one gap per chunk, as vLLM observes one per
output batch.
"""

from __future__ import annotations

from protocol.engine_core import EngineCoreOutput, Logprobs


class StreamGate:
    """Decides, per step output, what to send now (interval > 1)."""

    def __init__(self, interval: int) -> None:
        if interval < 1:
            raise ValueError(f"stream interval must be at least 1, got {interval}")
        self.interval = interval
        self._held: dict[str, EngineCoreOutput] = {}
        self._started: set[str] = set()

    def __len__(self) -> int:
        """Requests with tokens held back."""
        return len(self._held)

    def admit(self, out: EngineCoreOutput) -> EngineCoreOutput | None:
        """The output to send for this step's `out` (joined with what was held), or None while
        the request's held tokens are fewer than the interval."""
        request_id = out.request_id
        held = self._held.pop(request_id, None)
        if held is not None:
            out = _joined(held, out)
        if out.finished:
            self._started.discard(request_id)
            return out
        if request_id not in self._started or out.new_prompt_logprobs is not None:
            if out.new_token_ids:  # the first token has gone out: hold from now on
                self._started.add(request_id)
            return out
        if len(out.new_token_ids) < self.interval:
            self._held[request_id] = out
            return None
        return out

    def forget(self, request_id: str) -> None:
        """Drop what is held for a request whose client is gone."""
        self._held.pop(request_id, None)
        self._started.discard(request_id)


def _joined(earlier: EngineCoreOutput, later: EngineCoreOutput) -> EngineCoreOutput:
    """One output saying what earlier and later said, in that order (later, extended)."""
    later.new_token_ids = earlier.new_token_ids + later.new_token_ids
    if earlier.new_logprobs is not None:
        later.new_logprobs = _joined_logprobs(earlier.new_logprobs, later.new_logprobs)
    # Prompt logprobs are never held (an output carrying them goes out at once); a cached count
    # and prefill chunks come on a request's first output, kept here all the same.
    later.num_cached_tokens = later.num_cached_tokens or earlier.num_cached_tokens
    later.prefill_chunks = earlier.prefill_chunks + later.prefill_chunks
    return later


def _joined_logprobs(earlier: Logprobs, later: Logprobs | None) -> Logprobs:
    if later is None:
        return earlier
    return Logprobs(
        list(earlier.token_ids) + list(later.token_ids),
        list(earlier.logprobs) + list(later.logprobs),
        list(earlier.ranks) + list(later.ranks),
    )
