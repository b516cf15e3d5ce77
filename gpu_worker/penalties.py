"""Logit adjustments that can change the greedy choice: allowed token ids, logit bias, min_tokens,
and vLLM's penalties (bad words: gpu_worker/bad_words.py)."""

from __future__ import annotations

import torch


def apply_allowed_token_ids(
    logits: torch.Tensor, restricted: torch.Tensor, allowed_ids: torch.Tensor
) -> torch.Tensor:
    """Logits with every token but allowed_ids[i, :] at -inf on the rows where restricted[i]."""
    kept = logits.gather(1, allowed_ids)
    masked = torch.full_like(logits, float("-inf")).scatter_(1, allowed_ids, kept)
    return torch.where(restricted.unsqueeze(1), masked, logits)


def apply_logit_bias(logits: torch.Tensor, token_ids: torch.Tensor, bias: torch.Tensor) -> None:
    """Add bias[i, j] to logits[i, token_ids[i, j]] in place (padding adds 0.0 to token 0)."""
    logits.scatter_add_(1, token_ids, bias.to(logits.dtype))


def apply_min_tokens(logits: torch.Tensor, below: torch.Tensor, banned_ids: torch.Tensor) -> None:
    """Set logits[i, banned_ids[i, :]] to -inf in place on the rows where below[i]."""
    kept = logits.gather(1, banned_ids)
    logits.scatter_(1, banned_ids, torch.where(below.unsqueeze(1), float("-inf"), kept))


def apply_penalties(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_mask: torch.Tensor | None,
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    repetition_penalties: torch.Tensor,
) -> torch.Tensor:
    """Return logits after vLLM's repetition, then frequency and presence penalties.

    output_counts[i, t] is how often row i's request sampled token t; prompt_mask[i, t] whether
    its prompt holds t. A token seen in the prompt or the output has a positive logit divided by
    its row's repetition penalty and a negative one multiplied by it; then
    logits -= frequency * output_count + presence * (output_count > 0).
    """
    counts = output_counts.to(logits.dtype)
    in_output = counts > 0
    seen = in_output if prompt_mask is None else in_output | prompt_mask
    penalty = torch.where(seen, repetition_penalties.unsqueeze(1), 1.0)
    logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits -= frequency_penalties.unsqueeze(1) * counts
    logits -= presence_penalties.unsqueeze(1) * in_output
    return logits
