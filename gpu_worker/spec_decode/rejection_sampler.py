"""Rejection sampling of drafts: keep the longest prefix of each request's drafts that the target
would have produced, then one more token, so the output is distributed exactly as the target's.

A draft is a certain guess (its proposal distribution a point mass), so Leviathan et al.'s rule
min(1, p/q) is: accept draft d at a row with probability p(d), where p is the distribution the
plain sampler would sample that row from (penalties, temperature and truncation applied: the
metadata of verify_metadata.expand_metadata). At the first rejection the token is drawn from p
with d removed (max(0, p - q), renormalised); when every draft is accepted the request's last
row gives a bonus token drawn from p itself. Greedy rows accept a draft while it equals the
argmax and end with the argmax, so greedy output is plain greedy decoding token for token.

Everything runs on the logits' device over the [T, V] rows at once; the host reads nothing.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from gpu_worker.sampler import LogprobsTensors, Sampler, _exponential_race, compute_logprobs_tensors
from gpu_worker.sampling_metadata import SamplingMetadata


class RejectionOutput(NamedTuple):
    """Each request's tokens of the step, and the logprobs of every verification row."""

    output_token_ids: torch.Tensor  # [S, K+1] int64: accepted drafts, one more token, then -1
    num_output: torch.Tensor  # [S] int64: 1 + accepted drafts
    # T rows: row r's token is the one its request outputs at that position (the accepted draft,
    # or the final token on the first rejected or bonus row); later rows are meaningless.
    logprobs: LogprobsTensors | None


class RejectionSampler:
    """Verifies each request's drafts against the target's logits of its verification rows."""

    def __init__(self, sampler: Sampler | None = None) -> None:
        self.sampler = sampler or Sampler()

    def __call__(
        self,
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        num_drafts_np: np.ndarray,
        draft_token_ids: torch.Tensor,
    ) -> RejectionOutput:
        """logits [T, V] (fp32 or bf16; may be overwritten): request i's num_drafts_np[i] + 1
        consecutive rows, row r verifying draft_token_ids[r] (-1 on each request's last row);
        metadata: expand_metadata's for those rows."""
        md = metadata
        raw_logprobs = None
        if md.max_num_logprobs is not None:
            raw_logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)

        if md.argmax_only:
            final = self.sampler.greedy(logits)
            accepted = draft_token_ids == final
        else:
            adjusted = Sampler._adjust(logits.to(torch.float32), md)
            greedy_ids = None if md.all_random else self.sampler.greedy(adjusted)
            if md.all_greedy:
                assert greedy_ids is not None
                final, accepted = greedy_ids, draft_token_ids == greedy_ids
            else:
                probs = Sampler.truncate(adjusted, md).softmax(dim=-1)
                accepted, final = _verify_random(probs, draft_token_ids, md.generators)
                if greedy_ids is not None:
                    assert md.greedy_mask is not None
                    accepted = torch.where(md.greedy_mask, draft_token_ids == greedy_ids, accepted)
                    final = torch.where(md.greedy_mask, greedy_ids, final)

        # The token each row's request outputs there, if it gets that far: the draft where
        # accepted, else the row's own token (and the row is the request's last output).
        row_tokens = torch.where(accepted, draft_token_ids, final)
        num_drafts = int(num_drafts_np.max()) if len(num_drafts_np) else 0
        output_token_ids, num_accepted = _per_request(
            accepted, row_tokens, draft_token_ids, len(num_drafts_np), num_drafts + 1
        )
        logprobs = None
        if raw_logprobs is not None and md.max_num_logprobs is not None:
            logprobs = compute_logprobs_tensors(raw_logprobs, row_tokens, md.max_num_logprobs)
        return RejectionOutput(output_token_ids, num_accepted + 1, logprobs)


def accept_argmax(
    argmax: torch.Tensor, num_drafts_np: np.ndarray, draft_token_ids: torch.Tensor
) -> RejectionOutput:
    """Greedy verification from each row's argmax [T] alone (the argmax of the unprocessed
    logits, e.g. fused into the output projection so the logits are never written): what
    RejectionSampler gives when every row is argmax-only and no logprobs are asked."""
    accepted = draft_token_ids == argmax
    row_tokens = torch.where(accepted, draft_token_ids, argmax)
    num_drafts = int(num_drafts_np.max()) if len(num_drafts_np) else 0
    output_token_ids, num_accepted = _per_request(
        accepted, row_tokens, draft_token_ids, len(num_drafts_np), num_drafts + 1
    )
    return RejectionOutput(output_token_ids, num_accepted + 1, None)


def _verify_random(
    probs: torch.Tensor, draft_token_ids: torch.Tensor, generators: dict[int, torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of probs [T, V]: whether its draft is accepted (u < p(draft), u ~ U[0, 1)) and
    the token drawn from p without the draft (the bonus row, draft -1, keeps p whole)."""
    num_rows = probs.shape[0]
    has_draft = draft_token_ids >= 0
    drafts = draft_token_ids.clamp_min(0).unsqueeze(1)
    p_draft = probs.gather(1, drafts).squeeze(1)
    u = torch.empty(num_rows, device=probs.device)
    if len(generators) < num_rows:
        u.uniform_()
    # A seeded row draws from its own generator only (rows in order: u, then the race's draws).
    for row, generator in generators.items():
        u[row] = torch.rand(1, device=probs.device, generator=generator)
    accepted = has_draft & (u < p_draft)
    recovered = _exponential_race(_without_draft(probs, drafts, has_draft, p_draft), generators)
    return accepted, recovered


def _without_draft(
    probs: torch.Tensor, drafts: torch.Tensor, has_draft: torch.Tensor, p_draft: torch.Tensor
) -> torch.Tensor:
    """probs with each row's draft set to 0 (in place), rows without a draft unchanged; the race
    needs no renormalisation."""
    kept = torch.where(has_draft, 0.0, p_draft).unsqueeze(1)
    return probs.scatter_(1, drafts, kept)


def _per_request(
    accepted: torch.Tensor,
    row_tokens: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_requests: int,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [T] laid out as [S, width] by request (a request's rows end at its draft -1): its
    row tokens up to its first row not accepted, then -1; and each request's accepted count."""
    num_rows = draft_token_ids.shape[0]
    device = draft_token_ids.device
    last = draft_token_ids < 0
    request = last.cumsum(0) - last.long()
    row = torch.arange(num_rows, device=device)
    first = torch.ones_like(last)
    first[1:] = last[:-1]
    column = row - torch.where(first, row, 0).cummax(0).values
    # The first row not accepted (the last row at the latest) is the count accepted before it.
    num_accepted = torch.full((num_requests,), width, dtype=torch.int64, device=device)
    num_accepted.scatter_reduce_(0, request, torch.where(accepted, width, column), "amin")
    tokens = torch.full((num_requests * width,), -1, dtype=torch.int64, device=device)
    tokens = tokens.scatter_(0, request * width + column, row_tokens).view(num_requests, width)
    columns = torch.arange(width, device=device)
    return tokens.masked_fill_(columns > num_accepted.unsqueeze(1), -1), num_accepted
