"""vLLM's bad_words on the worker: a word's last token is banned when the output so far ends
with the word's other tokens (a one-token word is always banned).

Which words can apply is decided on the host from the output lengths the host mirrors already
know; whether each one's prefix matches is decided on the device, from the token ids the
request state keeps there, so the step never reads the device."""

from __future__ import annotations

from typing import NamedTuple, Protocol

import numpy as np
import torch

from gpu_worker.staging import HostToDevice


class BadWordsBatch(NamedTuple):
    """One entry per (sampled row, applicable word): compare gathered tokens with the prefix."""

    rows: torch.Tensor  # [E] int64: the logits row
    last_ids: torch.Tensor  # [E] int64: the token to ban when the prefix matches
    history_index: torch.Tensor  # [E, P] int64: flat indices into the token-id table
    prefix: torch.Tensor  # [E, P] int64: the expected tokens (-1 where the word is shorter)


class TokenHistory(Protocol):
    """What the request state offers: token ids by slot on the device, counts on the host."""

    token_ids: torch.Tensor  # [R, W] int64
    num_tokens_np: np.ndarray  # [R]
    prompt_len_np: np.ndarray  # [R]


def bad_words_batch(
    words_of_slot: dict[int, list[list[int]]],
    slots_np: np.ndarray,
    history: TokenHistory,
    h2d: HostToDevice,
) -> BadWordsBatch | None:
    """The entries of the rows (row i = slot slots_np[i]) that have bad words, or None."""
    rows, last_ids, starts, prefixes = [], [], [], []
    width = history.token_ids.shape[1]
    for row, slot in enumerate(slots_np.tolist()):
        words = words_of_slot.get(slot)
        if not words:
            continue
        num_tokens = int(history.num_tokens_np[slot])
        num_output = num_tokens - int(history.prompt_len_np[slot])
        for word in words:
            p = len(word) - 1
            if p > num_output:  # the output is too short to end with the prefix
                continue
            rows.append(row)
            last_ids.append(word[-1])
            starts.append(slot * width + num_tokens - p)
            prefixes.append(word[:-1])
    if not rows:
        return None
    p_max = max(1, max(len(p) for p in prefixes))
    prefix = np.full((len(rows), p_max), -1, dtype=np.int64)
    index = np.zeros((len(rows), p_max), dtype=np.int64)
    for e, (start, p) in enumerate(zip(starts, prefixes)):
        prefix[e, : len(p)] = p
        index[e, : len(p)] = np.arange(start, start + len(p))
    arrays = h2d.copy(
        np.array(rows, dtype=np.int64), np.array(last_ids, dtype=np.int64), index, prefix
    )
    return BadWordsBatch(*arrays)


def apply_bad_words(logits: torch.Tensor, token_ids: torch.Tensor, batch: BadWordsBatch) -> None:
    """Set logits[row, last] to -inf in place where the row's recent tokens match the prefix."""
    gathered = token_ids.view(-1).index_select(0, batch.history_index.view(-1))
    gathered = gathered.view(batch.history_index.shape)
    match = ((gathered == batch.prefix) | (batch.prefix < 0)).all(dim=1)
    # Accumulated: two words may ban the same token of a row, matched or not.
    ban = torch.where(match, float("-inf"), 0.0).to(logits.dtype)
    logits.index_put_((batch.rows, batch.last_ids), ban, accumulate=True)
