"""Logit adjustments that can change the greedy choice: logit bias, min_tokens, and vLLM's penalties."""

from __future__ import annotations

import torch


def apply_logit_bias(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor, bias: torch.Tensor) -> None:
    """Add bias[j] to logits[rows[j], token_ids[j]] in place."""
    logits.index_put_((rows, token_ids), bias, accumulate=True)


def apply_min_tokens(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
    """Set logits[rows[j], token_ids[j]] to -inf in place."""
    logits[rows, token_ids] = float("-inf")


def apply_penalties(
    logits: torch.Tensor,
    output_token_ids: torch.Tensor,
    prompt_token_ids: torch.Tensor | None,
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    repetition_penalties: torch.Tensor,
) -> torch.Tensor:
    """Return logits after vLLM's repetition, then frequency and presence penalties.

    Token-id tensors are [N, L] padded with vocab_size. A token seen in the prompt or the output has
    a positive logit divided by its row's repetition penalty and a negative one multiplied by it;
    then logits -= frequency * output_count + presence * (output_count > 0).
    """
    num_rows, vocab_size = logits.shape
    # One spare column absorbs the padding id.
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, output_token_ids, torch.ones_like(output_token_ids, dtype=logits.dtype))
    counts = counts[:, :vocab_size]
    in_output = counts > 0

    seen = in_output
    if prompt_token_ids is not None:
        in_prompt = torch.zeros(num_rows, vocab_size + 1, dtype=torch.bool, device=logits.device)
        in_prompt.scatter_(1, prompt_token_ids, True)
        seen = in_output | in_prompt[:, :vocab_size]

    penalty = torch.where(seen, repetition_penalties.unsqueeze(1), 1.0)
    logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits -= frequency_penalties.unsqueeze(1) * counts
    logits -= presence_penalties.unsqueeze(1) * in_output
    return logits
