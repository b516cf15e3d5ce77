"""Per-request incremental detokenization with stop strings, and logprob conversion."""

from __future__ import annotations

from typing import TYPE_CHECKING

from protocol.engine_core import Logprobs
from protocol.frames import tolist
from protocol.sampling_params import SamplingParams
from tokenizer_proc.incremental import make_incremental_decoder
from tokenizer_proc.request_output import Logprob

if TYPE_CHECKING:  # only a type here: transformers costs a process seconds to import
    from transformers import PreTrainedTokenizerBase


class IncrementalDetokenizer:
    """Turns one request's sampled tokens into text, streams it in deltas and finds stop strings."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        self._decoder = make_incremental_decoder(
            tokenizer, prompt_token_ids, params.skip_special_tokens
        )
        self.output_token_ids: list[int] = []
        self.output_text = ""
        self.finished = False
        self.stop_string: str | None = None
        self._stop = tuple(params.stop or ())
        self._include_stop = params.include_stop_str_in_output
        # A partial stop string must not be streamed and then retracted; with the stop string kept
        # in the output nothing is ever retracted, so nothing needs holding back.
        longest = max(map(len, self._stop), default=0)
        self._holdback = 0 if self._include_stop else max(longest - 1, 0)
        self._min_tokens = params.min_tokens
        self._sent = 0
        # How many of the last update's tokens count: all of them, unless a stop string ended
        # inside them (an output of several tokens, --stream-interval): then up to the token
        # that completed it, as one token at a time would have had it.
        self.num_kept = 0

    def update(
        self, new_token_ids: list[int], finished: bool, stop_terminated: bool = False
    ) -> str | None:
        """Append sampled tokens; return the stop string they complete, if any (caller aborts).

        stop_terminated: the last token is the stop token (EOS or a stop_token_id) that ended
        the request; as in vLLM its text is left out unless include_stop_str_in_output (with
        skip_special_tokens=False an EOS would otherwise show as "<|im_end|>")."""
        self.num_kept = 0
        if self.stop_string is not None:
            return None
        self.finished = self.finished or finished
        num_before = len(self.output_token_ids)
        self.output_token_ids.extend(new_token_ids)
        self.num_kept = len(new_token_ids)
        if stop_terminated and new_token_ids and not self._include_stop:
            new_token_ids = new_token_ids[:-1]
        if not self._stop:
            self.output_text += self._decode(new_token_ids)
            return None
        # Stop strings may only end in text from tokens after the first min_tokens, as in vLLM.
        num_unchecked = max(self._min_tokens - num_before, 0)
        if num_unchecked >= len(new_token_ids):
            self.output_text += self._decode(new_token_ids)
            return None
        if num_unchecked:
            self.output_text += self._decode(new_token_ids[:num_unchecked])
        step = self._decoder.step
        for kept, token_id in enumerate(new_token_ids[num_unchecked:], num_unchecked + 1):
            checked_from = len(self.output_text)
            self.output_text += step(token_id)
            stop = self._check_stop(checked_from)
            if stop is not None:
                self.num_kept = kept
                del self.output_token_ids[num_before + kept :]
                return stop
        return None

    def get_next_delta(self) -> str:
        """Return text not yet returned, holding back a possible partial stop string until done."""
        end = len(self.output_text)
        if not self.finished and self.stop_string is None:
            end -= self._holdback
        if end <= self._sent:
            return ""
        delta = self.output_text[self._sent : end]
        self._sent = end
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        step = self._decoder.step
        return "".join([step(token_id) for token_id in token_ids])

    def _check_stop(self, checked_from: int) -> str | None:
        """Find the earliest stop string ending in output_text[checked_from:]; truncate at it."""
        text = self.output_text
        match, match_at = None, len(text)
        for stop in self._stop:
            # Only a window reaching len(stop) - 1 characters back can hold a newly completed match.
            at = text.find(stop, max(checked_from - len(stop) + 1, 0))
            if at != -1 and at < match_at:
                match, match_at = stop, at
        if match is None:
            return None
        self.output_text = text[: match_at + len(match) if self._include_stop else match_at]
        self.stop_string = match
        return match


def convert_logprobs(tokenizer: PreTrainedTokenizerBase, lp: Logprobs) -> list[dict[int, Logprob]]:
    """Map each position's sampled and top-k token ids to Logprob(logprob, rank, decoded_token).

    lp holds lists (in-process) or numpy arrays (decoded from an engine core process).
    """
    token_ids, logprobs, sampled_ranks = tolist(lp.token_ids), tolist(lp.logprobs), tolist(lp.ranks)
    flat_ids = [token_id for row in token_ids for token_id in row]
    # Per-token strings may hold U+FFFD for a partial character, as in vLLM.
    texts = iter(tokenizer.batch_decode([[token_id] for token_id in flat_ids]))
    positions: list[dict[int, Logprob]] = []
    for row_ids, row_logprobs, sampled_rank in zip(token_ids, logprobs, sampled_ranks):
        # The sampled token comes first; when it is also in the top-k its top-k entry overwrites it.
        ranks = [sampled_rank, *range(1, len(row_ids))]
        positions.append(
            {
                token_id: Logprob(logprob, rank, next(texts))
                for token_id, logprob, rank in zip(row_ids, row_logprobs, ranks)
            }
        )
    return positions
