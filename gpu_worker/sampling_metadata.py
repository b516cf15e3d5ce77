"""Per-step batched sampling tensors, gathered on the device from SamplingStates
(sampling_state.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker.bad_words import BadWordsBatch


def _unset(field: str, doc: str) -> property:
    """A read-only property: whether the named field is None."""
    return property(lambda self: getattr(self, field) is None, doc=doc)


@dataclass
class SamplingMetadata:
    """Sampling inputs for N rows; a stage's tensors are None when no row uses that stage."""

    # Temperature is 1.0 on greedy rows so one division serves the whole batch.
    temperature: torch.Tensor | None  # [N] float32; None when all rows are greedy
    greedy_mask: torch.Tensor | None  # [N] bool; None unless the batch mixes greedy and random rows
    all_greedy: bool
    all_random: bool
    # Row -> generator for random rows with a seed.
    generators: dict[int, torch.Generator]
    top_k: torch.Tensor | None  # [N] int64; vocab_size where disabled
    max_top_k: int  # largest enabled top_k, known on the host so top-k needs no device sync
    top_p: torch.Tensor | None  # [N] float32; 1.0 where disabled
    min_p: torch.Tensor | None  # [N] float32; 0.0 where disabled
    presence_penalties: torch.Tensor | None  # [N] float32; the three are None together
    frequency_penalties: torch.Tensor | None  # [N] float32
    repetition_penalties: torch.Tensor | None  # [N] float32
    output_counts: torch.Tensor | None  # [N, V] float32: times each token was sampled
    prompt_mask: torch.Tensor | None  # [N, V] bool; None when no row has repetition_penalty
    # (rows still below min_tokens [N] bool, their banned ids [N, S] padded by repetition)
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None
    # (token ids [N, K], bias [N, K]), 0-padded
    logit_bias: tuple[torch.Tensor, torch.Tensor] | None
    max_num_logprobs: int | None  # max K over rows (-1 resolved to vocab_size); None if no row asks
    # (rows restricted to allowed_token_ids [N] bool, their allowed ids [N, A] padded by repetition)
    allowed_token_ids: tuple[torch.Tensor, torch.Tensor] | None = None
    # (the request state's token-id table [R, W], the step's bad-word entries)
    bad_words: tuple[torch.Tensor, BadWordsBatch] | None = None

    no_top_k = _unset("top_k", "True when no row restricts to its top-k tokens.")
    no_top_p = _unset("top_p", "True when no row applies nucleus (top-p) truncation.")
    no_min_p = _unset("min_p", "True when no row applies min-p truncation.")
    no_penalties = _unset(
        "repetition_penalties", "True when no row has a presence, frequency or repetition penalty."
    )
    no_logit_bias = _unset("logit_bias", "True when no row biases any token.")
    no_min_tokens = _unset("min_tokens_mask", "True when no row is still below its min_tokens.")

    @property
    def argmax_only(self) -> bool:
        """True when the sample is the plain argmax of the unprocessed logits."""
        return (
            self.all_greedy
            and self.no_penalties
            and self.no_logit_bias
            and self.no_min_tokens
            and self.allowed_token_ids is None
            and self.bad_words is None
        )
