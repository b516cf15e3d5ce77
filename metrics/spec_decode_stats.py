"""Speculative decoding's counters (vLLM's vllm:spec_decode_* names) and its periodic log line,
from the SpecDecodingStats of each step that verified drafts.

The acceptance rate is rate(vllm:spec_decode_num_accepted_tokens_total) /
rate(vllm:spec_decode_num_draft_tokens_total); the mean acceptance length (the bonus token
included, as vLLM counts it) is 1 + accepted / drafts; the per-position acceptance rate is
vllm:spec_decode_num_accepted_tokens_per_pos{position=j} / vllm:spec_decode_num_drafts.
"""

from __future__ import annotations

import logging

from metrics.registry import spec_decode_metrics
from protocol.engine_core import SpecDecodingStats

logger = logging.getLogger("metrics.engine_stats")


class SpecDecodeRecorder:
    """One engine core's speculative-decoding counters: held between flushes like the other
    per-step series (metrics/engine_stats.py), and summed over a log window."""

    def __init__(self, labels: tuple[str, str], num_speculative_tokens: int) -> None:
        m = spec_decode_metrics()
        self._drafts = m.num_drafts.labels(*labels)
        self._draft_tokens = m.num_draft_tokens.labels(*labels)
        self._accepted = m.num_accepted_tokens.labels(*labels)
        # One series per draft position, created now so /metrics shows them at 0 (as vLLM).
        self._per_pos = [
            m.num_accepted_tokens_per_pos.labels(*labels, str(pos))
            for pos in range(num_speculative_tokens)
        ]
        self._k = num_speculative_tokens
        self._held = [0, 0, 0]  # drafts, draft tokens, accepted tokens
        self._held_per_pos = [0] * num_speculative_tokens
        self.reset_window()

    def record(self, stats: SpecDecodingStats) -> None:
        """Hold one step's counts; flush() writes them."""
        if len(stats.num_accepted_tokens_per_pos) > self._k:
            raise ValueError(
                f"{len(stats.num_accepted_tokens_per_pos)} draft positions counted, "
                f"num_speculative_tokens is {self._k}"
            )
        self._add(self._held, self._held_per_pos, stats)

    def observe(self, stats: SpecDecodingStats) -> None:
        """Add one step's counts to the log window."""
        self._add(self._window, self._window_per_pos, stats)

    @staticmethod
    def _add(counts: list[int], per_pos: list[int], stats: SpecDecodingStats) -> None:
        counts[0] += stats.num_drafts
        counts[1] += stats.num_draft_tokens
        counts[2] += stats.num_accepted_tokens
        for pos, accepted in enumerate(stats.num_accepted_tokens_per_pos):
            per_pos[pos] += accepted

    def flush(self) -> None:
        """Write the held counts to Prometheus."""
        drafts, draft_tokens, accepted = self._held
        if drafts:
            self._drafts.inc(drafts)
            self._draft_tokens.inc(draft_tokens)
            self._accepted.inc(accepted)
            for counter, n in zip(self._per_pos, self._held_per_pos, strict=True):
                if n:
                    counter.inc(n)
        self._held = [0, 0, 0]
        self._held_per_pos = [0] * self._k

    def reset_window(self) -> None:
        self._window = [0, 0, 0]
        self._window_per_pos = [0] * self._k

    def log(self, elapsed: float) -> None:
        """vLLM's "SpecDecoding metrics" line for the window of elapsed seconds (none when the
        window saw no drafts); starts a new window."""
        drafts, draft_tokens, accepted = self._window
        if drafts:
            rates = ", ".join(f"{n / drafts:.3f}" for n in self._window_per_pos)
            logger.info(
                "SpecDecoding metrics: Mean acceptance length: %.2f, "
                "Accepted throughput: %.2f tokens/s, Drafted throughput: %.2f tokens/s, "
                "Accepted: %d tokens, Drafted: %d tokens, "
                "Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
                1 + accepted / drafts,
                accepted / elapsed if elapsed > 0 else 0.0,
                draft_tokens / elapsed if elapsed > 0 else 0.0,
                accepted,
                draft_tokens,
                rates,
                100 * accepted / draft_tokens if draft_tokens else float("nan"),
            )
        self.reset_window()
