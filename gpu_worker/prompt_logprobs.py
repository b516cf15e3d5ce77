"""Prompt logprobs: each prompt token's logprob given its prefix, gathered chunk by chunk.

Every prefill chunk of a request that asked for them yields the logprobs of the prompt tokens
it predicts, computed on the device from the chunk's hidden states and the device's token
table; the chunks travel to the host with the step's other results, and the whole list is sent
once, with the step that completes the prompt.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gpu_worker.async_output import AsyncOutput
from gpu_worker.input_batch import InputBatch
from gpu_worker.request_state import RequestStates
from gpu_worker.sampler import LogprobsTensors, compute_logprobs_tensors


class PromptLogprobs:
    """Requests whose prompt logprobs are still being gathered."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._num_top: dict[str, int] = {}  # request -> K asked (-1: whole vocabulary)
        self._chunks: dict[str, list[LogprobsTensors]] = {}  # host copies so far

    def add_request(self, req_id: str, num_top: int) -> None:
        """Start gathering for a request that asked for num_top prompt logprobs."""
        self._num_top[req_id] = num_top
        self._chunks[req_id] = []

    def remove_request(self, req_id: str) -> None:
        """Stop gathering (finished, preempted, or complete)."""
        self._num_top.pop(req_id, None)
        self._chunks.pop(req_id, None)

    def compute(
        self,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
        hidden: torch.Tensor,
        batch: InputBatch,
        states: RequestStates,
    ) -> tuple[list[str], list[LogprobsTensors], list[str]]:
        """This step's chunks on the device: (their requests, chunks, requests now complete)."""
        if not self._num_top:
            return [], [], []
        owners, chunks, complete = [], [], []
        qsl, seq_lens = batch.query_start_loc_np, batch.seq_lens_np
        for i, req_id in enumerate(batch.req_ids):
            k = self._num_top.get(req_id)
            if k is None:
                continue
            slot = int(batch.slots_np[i])
            num_prompt = int(states.prompt_len_np[slot])
            q0, q1 = int(qsl[i]), int(qsl[i + 1])
            start = int(seq_lens[i]) - (q1 - q0)
            end = min(int(seq_lens[i]), num_prompt - 1)  # positions predicting a prompt token
            if end > start:
                logits = compute_logits(hidden[q0 : q0 + end - start])
                targets = states.token_ids[slot, start + 1 : end + 1]
                num_top = self.vocab_size if k == -1 else k
                owners.append(req_id)
                chunks.append(
                    compute_logprobs_tensors(torch.log_softmax(logits, dim=-1), targets, num_top)
                )
            if seq_lens[i] >= num_prompt:
                complete.append(req_id)
        return owners, chunks, complete

    def attach(self, output: AsyncOutput, owners: list[str], complete: list[str]) -> None:
        """Keep the host copies started by output, and hand it the completed requests."""
        for req_id, chunk in zip(owners, output.prompt_chunks):
            self._chunks[req_id].append(chunk)
        for req_id in complete:
            output.prompt_logprobs[req_id] = (self._chunks[req_id], self._num_top[req_id])
            self.remove_request(req_id)
