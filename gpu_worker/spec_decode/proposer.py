"""The proposer contract: after a step, guess the next tokens of the requests that sampled.

The runner calls a Proposer once per step, after rejection sampling and the post-update, when
every request of ProposeInputs knows exactly num_tokens_np tokens (in the request state's token
table: prompt, outputs, and this step's accepted drafts and new token). The drafts go back to the
engine core with the step's output (ModelRunnerOutput.spec_token_ids), which schedules them in
the request's next step (trimmed to what its limits allow); the runner then writes them after
the request's known tokens and verifies them.

Drafts are tokens, not distributions: the rejection sampler treats each as a certain guess
(vLLM does so for ngram, draft models and EAGLE), which keeps the target's distribution exact
whatever the proposer does. A proposer only needs to be right often to pay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

if TYPE_CHECKING:
    from config.engine import EngineConfig
    from gpu_worker.input_batch import InputBatch
    from gpu_worker.request_state import RequestStates


@dataclass(slots=True)
class ProposeInputs:
    """The requests to propose for (those that sampled this step), in the step's order."""

    slots_np: np.ndarray  # [S] int64: their slots in RequestStates
    slots: torch.Tensor  # [S] int64, on the device
    num_tokens_np: np.ndarray  # [S] int64: tokens each knows now (exact)
    # [S] int64: the most drafts each may get (0: none; the runner caps by max_model_len and
    # leaves out requests whose sampling cannot take drafts, e.g. bad words).
    max_drafts_np: np.ndarray
    states: RequestStates  # token_ids [R, max_model_len + 1], block_table, num_computed, ...
    # The target's last hidden states of this step's forward [T, H], and for each request the
    # row of its last accepted position (the one whose token is the request's newest), for
    # EAGLE heads; aux_hidden_states: EAGLE-3's intermediate layers' states, when asked for.
    hidden_states: torch.Tensor | None = None
    last_rows: torch.Tensor | None = None  # [S] int64
    aux_hidden_states: list[torch.Tensor] | None = None
    # The step's whole batch (every request that computed tokens, sampling or not: input ids,
    # positions, query start locations), the rows of hidden_states in its order; for a
    # proposer that consumes every computed position (EAGLE's prompt chunks).
    batch: InputBatch | None = None


class Proposer(Protocol):
    """Guesses up to num_speculative_tokens next tokens per request."""

    num_speculative_tokens: int

    def attach_target(self, target: torch.nn.Module) -> None:
        """The target model, loaded (before load()): an EAGLE head shares its embedding and
        output head and has it keep the hidden states it reads; others ignore it."""

    def load(self) -> None:
        """Load what the proposer runs (a draft model's weights); nothing for ngram."""

    def kv_block_bytes(self) -> int:
        """Bytes one KV block (of the target's block size) of the proposer's own cache takes;
        the runner's KV sizing adds them to the target's (0: no cache of its own)."""

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the proposer's cache for num_blocks blocks, addressed by the target's block
        tables (the same block ids: a request's draft KV sits in the blocks its target KV does)."""

    def capture_model(self) -> None:
        """Capture the proposer's CUDA graphs, after the target's (a draft model's one-token
        forwards); nothing where there are none."""

    def add_request(self, slot: int, num_computed: int) -> None:
        """A request took slot, with num_computed tokens whose KV the target already holds
        (prefix-cache hits); the proposer resets what it keeps per slot."""

    def propose(self, inputs: ProposeInputs) -> torch.Tensor:
        """Drafts [S, num_speculative_tokens] int64 on the runner's device: row i's first
        drafts (at most max_drafts_np[i]), then -1. No host read of the device on CUDA."""


def make_proposer(config: EngineConfig, device: torch.device) -> Proposer | None:
    """The proposer --speculative-config names (None without one)."""
    spec = config.speculative
    if spec is None:
        return None
    if spec.method == "ngram":
        from gpu_worker.spec_decode.ngram import NgramProposer

        return NgramProposer(spec, config.max_model_len, device)
    if spec.method == "draft_model":
        from gpu_worker.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer(config, device)
    from gpu_worker.spec_decode.eagle import EagleProposer

    return EagleProposer(config, device)
