"""Per-step batched sampling tensors, built on the host once per step and moved to the device."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from engine_core.sampling_params import SAMPLING_EPS, SamplingParams


class SamplingState(Protocol):
    """What the sampler needs to know about one request that samples this step."""

    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None


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
    # Padded with vocab_size; only rows that use the matching penalty have entries.
    output_token_ids: torch.Tensor | None  # [N, O] int64
    prompt_token_ids: torch.Tensor | None  # [N, P] int64; None when no row has repetition_penalty
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) forced to -inf
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, token ids, bias)
    max_num_logprobs: int | None  # max K over rows (-1 resolved to vocab_size); None if no row asks

    @property
    def no_top_k(self) -> bool:
        """True when no row restricts to its top-k tokens."""
        return self.top_k is None

    @property
    def no_top_p(self) -> bool:
        """True when no row applies nucleus (top-p) truncation."""
        return self.top_p is None

    @property
    def no_min_p(self) -> bool:
        """True when no row applies min-p truncation."""
        return self.min_p is None

    @property
    def no_penalties(self) -> bool:
        """True when no row has a presence, frequency or repetition penalty."""
        return self.repetition_penalties is None

    @property
    def no_logit_bias(self) -> bool:
        """True when no row biases any token."""
        return self.logit_bias is None

    @property
    def no_min_tokens(self) -> bool:
        """True when no row is still below its min_tokens."""
        return self.min_tokens_mask is None

    @property
    def argmax_only(self) -> bool:
        """True when the sample is the plain argmax of the unprocessed logits."""
        return self.all_greedy and self.no_penalties and self.no_logit_bias and self.no_min_tokens


def _padded(rows: list[list[int]], pad: int) -> torch.Tensor:
    out = np.full((len(rows), max((len(r) for r in rows), default=0)), pad, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return torch.from_numpy(out)


def build_sampling_metadata(
    states: Sequence[SamplingState],
    device: torch.device | str,
    vocab_size: int,
    eos_token_id: int | None,
) -> SamplingMetadata:
    """Batch the sampling inputs of `states` (row i = states[i]) onto `device`."""
    params = [s.sampling_params for s in states]
    greedy = [p.temperature < SAMPLING_EPS for p in params]
    all_greedy, all_random = all(greedy), not any(greedy)

    def to_dev(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    # Truncation only matters on random rows; greedy rows get the neutral value.
    top_k = [vocab_size if g or p.top_k == 0 else min(p.top_k, vocab_size) for p, g in zip(params, greedy)]
    top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
    min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy)]

    # Rows without a penalty contribute no token ids, so the count tensors stay small.
    row_penalized = [
        p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0 for p in params
    ]
    penalized = any(row_penalized)
    uses_prompt = any(p.repetition_penalty != 1.0 for p in params)
    output_rows = [s.output_token_ids if r else [] for s, r in zip(states, row_penalized)]
    prompt_rows = [s.prompt_token_ids if p.repetition_penalty != 1.0 else [] for s, p in zip(states, params)]

    # Ids outside the logits' vocabulary have no logit to mask or bias.
    min_rows: list[int] = []
    min_cols: list[int] = []
    bias_rows: list[int] = []
    bias_cols: list[int] = []
    bias_vals: list[float] = []
    for i, (s, p) in enumerate(zip(states, params)):
        if len(s.output_token_ids) < p.min_tokens:
            # EOS is masked even with ignore_eos, as vLLM does.
            banned = set(p.stop_token_ids or ()) | ({eos_token_id} if eos_token_id is not None else set())
            ids = sorted(t for t in banned if 0 <= t < vocab_size)
            min_rows += [i] * len(ids)
            min_cols += ids
        for t, b in (p.logit_bias or {}).items():
            if 0 <= t < vocab_size:
                bias_rows.append(i)
                bias_cols.append(t)
                bias_vals.append(b)

    temperature = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
    ks = [vocab_size if p.logprobs == -1 else min(p.logprobs, vocab_size) for p in params if p.logprobs is not None]

    return SamplingMetadata(
        temperature=None if all_greedy else to_dev(temperature, torch.float32),
        greedy_mask=None if all_greedy or all_random else to_dev(greedy, torch.bool),
        all_greedy=all_greedy,
        all_random=all_random,
        generators={
            i: s.generator for i, (s, g) in enumerate(zip(states, greedy)) if not g and s.generator is not None
        },
        top_k=None if all(k == vocab_size for k in top_k) else to_dev(top_k, torch.int64),
        max_top_k=max((k for k in top_k if k < vocab_size), default=vocab_size),
        top_p=None if all(p >= 1.0 for p in top_p) else to_dev(top_p, torch.float32),
        min_p=None if all(p <= 0.0 for p in min_p) else to_dev(min_p, torch.float32),
        presence_penalties=to_dev([p.presence_penalty for p in params], torch.float32) if penalized else None,
        frequency_penalties=to_dev([p.frequency_penalty for p in params], torch.float32) if penalized else None,
        repetition_penalties=to_dev([p.repetition_penalty for p in params], torch.float32) if penalized else None,
        output_token_ids=_padded(output_rows, vocab_size).to(device, non_blocking=True) if penalized else None,
        prompt_token_ids=_padded(prompt_rows, vocab_size).to(device, non_blocking=True) if uses_prompt else None,
        min_tokens_mask=(to_dev(min_rows, torch.int64), to_dev(min_cols, torch.int64)) if min_rows else None,
        logit_bias=(
            (to_dev(bias_rows, torch.int64), to_dev(bias_cols, torch.int64), to_dev(bias_vals, torch.float32))
            if bias_rows
            else None
        ),
        max_num_logprobs=max(ks) if ks else None,
    )
