"""NgramProposer: drafts looked up in the request's own tokens (--speculative-config's ngram).

The drafts of a request are the tokens that followed the earliest earlier occurrence of its
longest suffix n-gram (prompt_lookup_min <= n <= prompt_lookup_max), read straight from the
runner's token table by one kernel for the whole step (kernels/ngram.py: C on the CPU, Triton on
CUDA, with nothing read back to the host). No model, no cache, nothing kept per request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from config.speculative import SpeculativeConfig
from gpu_worker.staging import HostToDevice
from kernels.ngram import ngram_propose_for

if TYPE_CHECKING:  # proposer.py imports this module (make_proposer)
    from gpu_worker.spec_decode.proposer import ProposeInputs


class NgramProposer:
    """The Proposer of method ngram."""

    def __init__(self, spec: SpeculativeConfig, max_model_len: int, device: torch.device) -> None:
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.min_n = spec.prompt_lookup_min
        self.max_n = spec.prompt_lookup_max
        self.max_model_len = max_model_len
        self.device = device
        self._h2d = HostToDevice(device, capacity=1 << 12)
        self._propose = ngram_propose_for(device)

    def attach_target(self, target: torch.nn.Module) -> None:
        """Nothing: the n-gram proposer reads only the token table."""

    def capture_model(self) -> None:
        """Nothing: no graphs (the matching is one kernel launch)."""

    def load(self) -> None:
        """Nothing to load."""

    def kv_block_bytes(self) -> int:
        return 0

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """No cache of its own."""

    def add_request(self, slot: int, num_computed: int) -> None:
        """Nothing kept per slot."""

    def propose(self, inputs: ProposeInputs) -> torch.Tensor:
        """Drafts [S, num_speculative_tokens] int64 on the token table's device, -1 padded."""
        table = inputs.states.token_ids
        num_reqs = len(inputs.slots_np)
        out = torch.empty(
            (num_reqs, self.num_speculative_tokens), dtype=torch.int64, device=table.device
        )
        if not num_reqs:
            return out
        # Row 0: tokens known; row 1: the most drafts, never past max_model_len. Rows of an even
        # width keep row 1 16-byte aligned (Triton compiles a variant per alignment). A fresh
        # array: on the CPU the "device" tensor is a view of it.
        width = num_reqs + num_reqs % 2
        counts = np.zeros((2, width), dtype=np.int64)
        known = counts[0, :num_reqs]
        known[:] = inputs.num_tokens_np
        np.minimum(inputs.max_drafts_np, self.max_model_len - known, out=counts[1, :num_reqs])
        (on_device,) = self._h2d.copy(counts)
        on_device = on_device.view(2, width)[:, :num_reqs]
        self._propose(table, inputs.slots, on_device[0], on_device[1], self.min_n, self.max_n, out)
        return out
