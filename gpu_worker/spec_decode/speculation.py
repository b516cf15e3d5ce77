"""Speculative decoding in the model runner: the scheduled drafts written, verified in the
step's forward, the kept tokens applied, and the next drafts proposed.

The runner hands a Speculation the state it shares (request and sampling state, the staging
buffer) and calls it at three points of a step: stage() before the inputs are gathered,
verify() in place of the sampler when drafts were scheduled, propose() after the post-update.
The rejection sampler and the metadata of the verification rows are the "rejection" part of
this package; the proposer is whichever --speculative-config names.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from gpu_worker.grammar_mask import apply_grammar_bitmask
from gpu_worker.input_batch import InputBatch
from gpu_worker.request_state import RequestStates
from gpu_worker.sampler import LogprobsTensors
from gpu_worker.sampling_state import SamplingStates
from gpu_worker.spec_decode.proposer import ProposeInputs, Proposer
from gpu_worker.spec_decode.rejection_sampler import RejectionSampler, accept_argmax
from gpu_worker.spec_decode.verify import apply_verified, stage_drafts, verify_rows
from gpu_worker.spec_decode.verify_metadata import expand_metadata
from gpu_worker.staging import HostToDevice
from protocol.step import SchedulerOutput


class Speculation:
    """The runner's speculative decoding: one proposer, one rejection sampler."""

    def __init__(
        self,
        proposer: Proposer,
        states: RequestStates,
        sampling: SamplingStates,
        h2d: HostToDevice,
        max_model_len: int,
    ) -> None:
        self.proposer = proposer
        self.states = states
        self.sampling = sampling
        self.h2d = h2d
        self.max_model_len = max_model_len
        self.num_speculative_tokens = proposer.num_speculative_tokens
        self.rejection_sampler = RejectionSampler()

    def stage(self, sched: SchedulerOutput) -> np.ndarray | None:
        """Write the step's drafts after their requests' known tokens (on the device before
        the inputs are gathered); the drafts per slot, or None when no request has any."""
        spec = sched.scheduled_spec_decode_tokens
        if not spec:
            return None
        per_slot = stage_drafts(self.states, spec)
        self.states.apply_staged_writes()
        return per_slot

    def verify(
        self,
        model: Any,
        batch: InputBatch,
        hidden: torch.Tensor,
        sched: SchedulerOutput,
        drafts_per_slot: np.ndarray,
    ) -> tuple[torch.Tensor, LogprobsTensors | None, np.ndarray, torch.Tensor]:
        """Sample at every verification row, keep what rejection sampling accepts, and apply
        it to the request state. Returns the kept tokens [S, K + 1] (-1 padded), their
        logprobs by verification row, each request's first row, and the hidden-state row of
        each request's newest token."""
        rows = verify_rows(batch, drafts_per_slot, self.h2d)
        metadata = expand_metadata(
            self.sampling,
            batch.sample_slots_np,
            batch.sample_slots,
            rows.num_drafts_np,
            rows.draft_token_ids,
            self.states,
        )
        hidden_rows = hidden.index_select(0, rows.logits_indices)
        argmax = None
        if (
            metadata.argmax_only
            and metadata.max_num_logprobs is None
            and not sched.structured_output_request_ids
        ):
            # Greedy rows need only each row's argmax: where a kernel fuses it with the output
            # projection (the CPU's few-rows path), the logits are never written.
            argmax = model.greedy_tokens(hidden_rows)
        if argmax is not None:
            result = accept_argmax(argmax, rows.num_drafts_np, rows.draft_token_ids)
        else:
            logits = model.compute_logits(hidden_rows)
            if sched.structured_output_request_ids:
                # A constrained request's bitmask rows: one per verification row.
                apply_grammar_bitmask(
                    logits, sched, batch, self.h2d, rows.row_starts_np, rows.num_drafts_np
                )
            result = self.rejection_sampler(
                logits, metadata, rows.num_drafts_np, rows.draft_token_ids
            )
        # Every request computed up to its seq_len; none appended a token yet.
        none = batch.sample_slots[:0]
        self.states.post_update(
            batch.slots,
            batch.slots_np,
            batch.device_batch.seq_lens,
            batch.seq_lens_np,
            none,
            batch.sample_slots_np[:0],
            None,
            self.sampling.num_output,
        )
        kept = apply_verified(
            self.states,
            self.sampling,
            batch.sample_slots,
            batch.sample_slots_np,
            rows.num_drafts_np,
            result.output_token_ids,
            result.num_output,
        )
        (newest,) = self.h2d.copy(rows.row_starts_np + kept - 1)
        last_rows = rows.logits_indices.index_select(0, newest)
        return result.output_token_ids, result.logprobs, rows.row_starts_np, last_rows

    def propose(
        self,
        batch: InputBatch,
        hidden: torch.Tensor,
        last_rows: torch.Tensor,
        aux_hidden_states: list[torch.Tensor] | None,
    ) -> torch.Tensor | None:
        """The drafts [S, K] (-1 padded) for the next step of every request that sampled: as
        many as fit below max_model_len, none for a request with bad words (their matching
        reads one position per step); None when no request sampled."""
        slots_np = batch.sample_slots_np
        num_tokens = self.states.num_tokens_np[slots_np]
        max_drafts = np.clip(self.max_model_len - num_tokens, 0, self.num_speculative_tokens)
        if self.sampling.bad_words:
            banned = np.fromiter(
                (int(s) in self.sampling.bad_words for s in slots_np), bool, len(slots_np)
            )
            max_drafts[banned] = 0
        # Called in steps where no request samples too: a draft model or EAGLE head computes
        # the step's prompt chunks along with the target (their blocks may be shared).
        drafts = self.proposer.propose(
            ProposeInputs(
                slots_np=slots_np,
                slots=batch.sample_slots,
                num_tokens_np=num_tokens,
                max_drafts_np=max_drafts,
                states=self.states,
                hidden_states=hidden,
                last_rows=last_rows,
                aux_hidden_states=aux_hidden_states,
                batch=batch,
            )
        )
        return drafts if len(slots_np) else None
