"""Per-row truncation of the sampling distribution (min-p, top-k, top-p); masked tokens get -inf."""

from __future__ import annotations

import torch


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """In place, mask tokens whose probability is below min_p times their row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    logits.masked_fill_(probs < threshold, float("-inf"))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> None:
    """In place, mask tokens below each row's k-th largest logit (ties with it are kept)."""
    vocab_size = logits.shape[-1]
    disabled = top_k >= vocab_size
    # topk over max_top_k columns only; disabled rows read column 0 and are then neutralised.
    kth_index = torch.where(disabled, 0, top_k - 1)
    kth = logits.topk(max_top_k, dim=-1).values.gather(1, kth_index.unsqueeze(1))
    kth.masked_fill_(disabled.unsqueeze(1), float("-inf"))
    logits.masked_fill_(logits < kth, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor
) -> torch.Tensor:
    """Return logits keeping, per row, the top-k tokens, then the smallest set whose mass reaches
    top_p.

    At least one token per row always survives.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab_size = logits.shape[-1]
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab_size - top_k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    # Ascending order: a token is dropped when it and everything below it fit within 1 - top_p.
    cum_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cum_probs <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
