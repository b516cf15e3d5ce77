"""Every request's sampling parameters as device columns, by slot, and the step's gather of them.

A request's parameters are written once, when it arrives (staged, one copy per step for all
new requests). Each step gathers the columns of the rows that sample with one index on the
device; host mirrors of the same columns decide which sampler stages run, so choosing them never
reads the device. Penalties keep per-slot output-token counts on the device, advanced by the
step's post-update; logit bias, min-tokens bans and allowed token ids are small padded per-slot
tables; bad words are kept on the host and matched on the device each step (bad_words.py).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from gpu_worker.bad_words import TokenHistory, bad_words_batch
from gpu_worker.sampling_metadata import SamplingMetadata
from gpu_worker.staging import HostToDevice, StagedWrites
from protocol.sampling_params import SAMPLING_EPS, SamplingParams

# Float columns.
_TEMPERATURE, _TOP_P, _MIN_P, _PRESENCE, _FREQUENCY, _REPETITION = range(6)
# Integer columns.
_TOP_K, _MIN_TOKENS, _NUM_BAN = range(3)


class SamplingStates:
    """Sampling parameters of every live request, by slot."""

    def __init__(
        self,
        max_num_reqs: int,
        vocab_size: int,
        eos_token_id: int | None,
        device: torch.device,
        h2d: HostToDevice,
    ) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.device = device
        self.h2d = h2d
        self.floats_np = np.zeros((max_num_reqs, 6), dtype=np.float32)
        self.ints_np = np.zeros((max_num_reqs, 3), dtype=np.int64)
        self.floats = torch.zeros((max_num_reqs, 6), dtype=torch.float32, device=device)
        self.ints = torch.zeros((max_num_reqs, 3), dtype=torch.int64, device=device)
        self.num_output = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        self.num_output_np = np.zeros(max_num_reqs, dtype=np.int64)
        self.greedy_np = np.zeros(max_num_reqs, dtype=bool)
        self.penalized_np = np.zeros(max_num_reqs, dtype=bool)
        self.uses_prompt_np = np.zeros(max_num_reqs, dtype=bool)
        self.num_bias_np = np.zeros(max_num_reqs, dtype=np.int64)
        self.logprobs_np = np.full(max_num_reqs, -2, dtype=np.int64)  # -2: none asked
        self.generators: dict[int, torch.Generator] = {}
        self._writes = [StagedWrites(t, h2d) for t in (self.floats, self.ints, self.num_output)]
        # Lazily sized: most workloads never use them.
        self.bias_ids = torch.zeros((max_num_reqs, 0), dtype=torch.int64, device=device)
        self.bias_vals = torch.zeros((max_num_reqs, 0), dtype=torch.float32, device=device)
        self.ban_ids = torch.zeros((max_num_reqs, 0), dtype=torch.int64, device=device)
        self.allowed_ids = torch.zeros((max_num_reqs, 0), dtype=torch.int64, device=device)
        self._table_writes = [
            StagedWrites(t, h2d)
            for t in (self.bias_ids, self.bias_vals, self.ban_ids, self.allowed_ids)
        ]
        self.restricted_np = np.zeros(max_num_reqs, dtype=bool)  # has allowed_token_ids
        self.bad_words: dict[int, list[list[int]]] = {}  # slot -> token ids of each word
        self.output_counts: torch.Tensor | None = None  # [R, V] float32
        self.prompt_mask: torch.Tensor | None = None  # [R, V] bool
        # Bumped by add(): the last metadata's parameter-only part is valid while it holds.
        self._version = 0
        self._static: tuple[int, np.ndarray, SamplingMetadata] | None = None
        self._any_ban = False  # some request ever had a min-tokens ban (then checked per step)

    def add(
        self,
        slot: int,
        params: SamplingParams,
        num_output: int,
        generator: torch.Generator | None = None,
    ) -> None:
        """Record a request's parameters in its slot (staged until apply_staged_writes).

        A seeded random request gets its own generator (or `generator`), so its draws do not
        depend on the rest of the batch.
        """
        v = self.vocab_size
        self._version += 1
        greedy = params.temperature < SAMPLING_EPS
        # Truncation only matters on random rows; greedy rows get the neutral value.
        floats = (
            1.0 if greedy else params.temperature,
            1.0 if greedy else params.top_p,
            0.0 if greedy else params.min_p,
            params.presence_penalty,
            params.frequency_penalty,
            params.repetition_penalty,
        )
        self.floats_np[slot] = floats
        self.num_output_np[slot] = num_output
        self._writes[0].put_row(slot, floats)
        self._writes[2].put(slot, num_output)
        self.greedy_np[slot] = greedy
        self.penalized_np[slot] = (
            params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0
            or params.repetition_penalty != 1.0
        )
        self.uses_prompt_np[slot] = params.repetition_penalty != 1.0
        self.logprobs_np[slot] = -2 if params.logprobs is None else params.logprobs
        self.generators.pop(slot, None)
        if not greedy and (generator is not None or params.seed is not None):
            self.generators[slot] = generator or torch.Generator(device=self.device).manual_seed(
                params.seed
            )
        # Ids outside the logits' vocabulary have no logit to mask or bias.
        bias = [(t, b) for t, b in (params.logit_bias or {}).items() if 0 <= t < v]
        banned: list[int] = []
        if params.min_tokens > num_output:
            # EOS is banned even with ignore_eos, as vLLM does.
            eos = {self.eos_token_id} if self.eos_token_id is not None else set()
            banned = sorted(t for t in set(params.stop_token_ids or ()) | eos if 0 <= t < v)
        ints = (
            v if greedy or params.top_k == 0 else min(params.top_k, v),
            params.min_tokens,
            len(banned),
        )
        self._any_ban = self._any_ban or bool(banned)
        self.ints_np[slot] = ints
        self._writes[1].put_row(slot, ints)
        self.num_bias_np[slot] = len(bias)
        if bias:
            self._ensure_width(0, len(bias))
            self._table_writes[0].put_row(
                slot, _padded([t for t, _ in bias], self.bias_ids.shape[1], 0)
            )
            self._table_writes[1].put_row(
                slot, _padded([b for _, b in bias], self.bias_vals.shape[1], 0.0)
            )
        if banned:
            # Padded with a banned id again: a repeated index writes the same -inf.
            self._ensure_width(2, len(banned))
            self._table_writes[2].put_row(slot, _padded(banned, self.ban_ids.shape[1], banned[0]))
        allowed = sorted({t for t in params.allowed_token_ids or () if 0 <= t < v})
        self.restricted_np[slot] = bool(allowed)
        if allowed:
            # Padded with an allowed id again: a repeated index keeps the same logit.
            self._ensure_width(3, len(allowed))
            self._table_writes[3].put_row(
                slot, _padded(allowed, self.allowed_ids.shape[1], allowed[0])
            )
        words = [w for w in params.bad_words_token_ids or () if all(0 <= t < v for t in w)]
        if words:
            self.bad_words[slot] = words
        else:
            self.bad_words.pop(slot, None)

    def _ensure_width(self, which: int, width: int) -> None:
        if which in (0, 1):
            if self.bias_ids.shape[1] >= width:
                return
            for w in self._table_writes[:2]:
                w.apply()
            self.bias_ids = _widen(self.bias_ids, width, 0)
            self.bias_vals = _widen(self.bias_vals, width, 0.0)
            self._table_writes[0] = StagedWrites(self.bias_ids, self.h2d)
            self._table_writes[1] = StagedWrites(self.bias_vals, self.h2d)
        elif which == 2 and self.ban_ids.shape[1] < width:
            self._table_writes[2].apply()
            self.ban_ids = _widen(self.ban_ids, width, None)
            self._table_writes[2] = StagedWrites(self.ban_ids, self.h2d)
        elif which == 3 and self.allowed_ids.shape[1] < width:
            self._table_writes[3].apply()
            self.allowed_ids = _widen(self.allowed_ids, width, None)
            self._table_writes[3] = StagedWrites(self.allowed_ids, self.h2d)

    def set_penalty_tokens(
        self, slot: int, prompt_ids: torch.Tensor, output_ids: torch.Tensor
    ) -> None:
        """Start a penalized slot's counts from device token ids (its prompt and outputs)."""
        if not self.penalized_np[slot]:
            return
        r, v = self.floats.shape[0], self.vocab_size
        if self.output_counts is None:
            self.output_counts = torch.zeros((r, v), dtype=torch.float32, device=self.device)
        counts = self.output_counts[slot]
        counts.zero_()
        counts.index_add_(0, output_ids, torch.ones(output_ids.shape, device=self.device))
        if self.uses_prompt_np[slot]:
            if self.prompt_mask is None:
                self.prompt_mask = torch.zeros((r, v), dtype=torch.bool, device=self.device)
            self.prompt_mask[slot].zero_()
            self.prompt_mask[slot].index_fill_(0, prompt_ids, True)

    def apply_staged_writes(self) -> None:
        """Send the new requests' parameters to the device."""
        for writes in (*self._writes, *self._table_writes):
            writes.apply()

    def metadata(
        self, slots_np: np.ndarray, slots: torch.Tensor, history: TokenHistory | None = None
    ) -> SamplingMetadata:
        """The sampling inputs of the rows in slots (row i = slot slots[i]), gathered on the
        device; the host mirrors decide which stages run. history (the request state) gives
        bad words the tokens so far; without it bad words are not applied.

        What depends only on the requests' parameters is gathered again only when the rows or
        a parameter changed (a steady decode batch reuses it); what moves every step (output
        counts, min-tokens bans, bad words) is gathered each step."""
        cached = self._static
        if (
            cached is None
            or cached[0] != self._version
            or (cached[1] is not slots_np and not np.array_equal(cached[1], slots_np))
        ):
            cached = self._static = (
                self._version,
                slots_np,
                self._static_metadata(slots_np, slots),
            )
        md = copy.copy(cached[2])
        if md.presence_penalties is not None and self.output_counts is not None:
            md.output_counts = self.output_counts.index_select(0, slots)
        ints_np = self.ints_np[slots_np] if self._any_ban else None
        if ints_np is not None:
            below = self.num_output_np[slots_np] < ints_np[:, _MIN_TOKENS]
            if (below & (ints_np[:, _NUM_BAN] > 0)).any():
                ints = self.ints.index_select(0, slots)
                below_dev = (self.num_output.index_select(0, slots) < ints[:, _MIN_TOKENS]) & (
                    ints[:, _NUM_BAN] > 0
                )
                md.min_tokens_mask = (below_dev, self.ban_ids.index_select(0, slots))
        if self.bad_words and history is not None:
            entries = bad_words_batch(self.bad_words, slots_np, history, self.h2d)
            if entries is not None:
                md.bad_words = (history.token_ids, entries)
        return md

    def _static_metadata(self, slots_np: np.ndarray, slots: torch.Tensor) -> SamplingMetadata:
        """The fields that depend on the rows' parameters only (output counts, min-tokens bans
        and bad words left None)."""
        v = self.vocab_size
        greedy = self.greedy_np[slots_np]
        all_greedy, all_random = bool(greedy.all()), not greedy.any()
        floats = self.floats.index_select(0, slots)
        ints = self.ints.index_select(0, slots)
        floats_np, ints_np = self.floats_np[slots_np], self.ints_np[slots_np]
        top_k_np = ints_np[:, _TOP_K]
        penalized = bool(self.penalized_np[slots_np].any())
        ks = self.logprobs_np[slots_np]
        ks = np.where(ks == -1, v, np.minimum(ks, v))[ks != -2]
        generators = {}
        if self.generators:
            for row in np.flatnonzero(~greedy):
                gen = self.generators.get(int(slots_np[row]))
                if gen is not None:
                    generators[int(row)] = gen
        bias = None
        if self.num_bias_np[slots_np].any():
            bias = (self.bias_ids.index_select(0, slots), self.bias_vals.index_select(0, slots))
        allowed = None
        if self.restricted_np[slots_np].any():
            allowed = (
                _to_device(self.restricted_np[slots_np], self.h2d),
                self.allowed_ids.index_select(0, slots),
            )
        return SamplingMetadata(
            temperature=None if all_greedy else floats[:, _TEMPERATURE],
            greedy_mask=None if all_greedy or all_random else _to_device(greedy, self.h2d),
            all_greedy=all_greedy,
            all_random=all_random,
            generators=generators,
            top_k=None if (top_k_np >= v).all() else ints[:, _TOP_K],
            max_top_k=int(top_k_np[top_k_np < v].max()) if (top_k_np < v).any() else v,
            top_p=None if (floats_np[:, _TOP_P] >= 1.0).all() else floats[:, _TOP_P],
            min_p=None if (floats_np[:, _MIN_P] <= 0.0).all() else floats[:, _MIN_P],
            presence_penalties=floats[:, _PRESENCE] if penalized else None,
            frequency_penalties=floats[:, _FREQUENCY] if penalized else None,
            repetition_penalties=floats[:, _REPETITION] if penalized else None,
            output_counts=None,
            prompt_mask=(
                self.prompt_mask.index_select(0, slots)
                if self.prompt_mask is not None and self.uses_prompt_np[slots_np].any()
                else None
            ),
            min_tokens_mask=None,
            logit_bias=bias,
            max_num_logprobs=int(ks.max()) if len(ks) else None,
            allowed_token_ids=allowed,
        )

    def post_update(self, slots: torch.Tensor, slots_np: np.ndarray, sampled: torch.Tensor) -> None:
        """The rows in slots sampled `sampled`: count it in the host mirror and, for penalized
        rows, in the output counts (RequestStates.post_update counts it in num_output)."""
        if not len(slots_np):
            return
        self.num_output_np[slots_np] += 1
        if self.output_counts is not None and self.penalized_np[slots_np].any():
            self.output_counts.index_put_(
                (slots, sampled), torch.ones(sampled.shape, device=self.device), accumulate=True
            )


def _padded(values: list, width: int, pad: float | int) -> list:
    return values + [values[0] if pad is None else pad] * (width - len(values))


def _widen(t: torch.Tensor, width: int, pad: float | int | None) -> torch.Tensor:
    # Powers of two, so a stream of slightly larger requests reallocates a few times only.
    new_width = max(width, 1 << (max(width, 1) - 1).bit_length())
    out = torch.zeros((t.shape[0], new_width), dtype=t.dtype, device=t.device)
    out[:, : t.shape[1]] = t
    if pad is None and t.shape[1]:
        out[:, t.shape[1] :] = t[:, :1]  # repeat each row's first banned id
    return out


def _to_device(a: np.ndarray, h2d: HostToDevice) -> torch.Tensor:
    return h2d.copy(np.ascontiguousarray(a))[0]


class _SamplingRequest(Protocol):
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None


def build_sampling_metadata(
    requests: Sequence[_SamplingRequest],
    device: torch.device | str,
    vocab_size: int,
    eos_token_id: int | None,
) -> SamplingMetadata:
    """Metadata for a one-off batch (row i = requests[i]) through the same columns and gather
    the runner uses; for tests and tools, not the step path."""
    device = torch.device(device)
    states = SamplingStates(
        max(1, len(requests)), vocab_size, eos_token_id, device, HostToDevice(device)
    )
    for slot, r in enumerate(requests):
        states.add(slot, r.sampling_params, len(r.output_token_ids), r.generator)
    states.apply_staged_writes()
    for slot, r in enumerate(requests):
        states.set_penalty_tokens(
            slot,
            torch.tensor(r.prompt_token_ids, dtype=torch.int64, device=device),
            torch.tensor(r.output_token_ids, dtype=torch.int64, device=device),
        )
    slots_np = np.arange(len(requests), dtype=np.int64)
    return states.metadata(
        slots_np, torch.from_numpy(slots_np).to(device), _History(requests, device)
    )


class _History:
    """The TokenHistory of a one-off batch: slot i holds requests[i]'s prompt and outputs."""

    def __init__(self, requests: Sequence[_SamplingRequest], device: torch.device) -> None:
        rows = [list(r.prompt_token_ids) + list(r.output_token_ids) for r in requests]
        width = max([1, *map(len, rows)])
        self.token_ids = torch.tensor(
            [row + [0] * (width - len(row)) for row in rows] or [[0]],
            dtype=torch.int64,
            device=device,
        )
        self.num_tokens_np = np.array([len(row) for row in rows], dtype=np.int64)
        self.prompt_len_np = np.array([len(r.prompt_token_ids) for r in requests], dtype=np.int64)
