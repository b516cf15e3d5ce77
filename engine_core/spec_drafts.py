"""Speculative decoding in the scheduler: which drafts a step verifies, what the runner's
verdict rolls back, and the drafts proposed for the next step.

A running request keeps the drafts the runner proposed after its last step
(Request.spec_token_ids). The scheduler gives a decode with drafts 1 + k tokens (k as its
limits allow: engine_core/scheduler.py) and, once the step is committed, the step carries the
k drafts (scheduled_drafts). The runner's output holds the m tokens the request kept (the
accepted drafts and one more): the k + 1 - m positions computed past them are rolled back
(roll_back_rejected), and the new proposals replace the old (take_drafts).
"""

from __future__ import annotations

from engine_core.request import Request, RequestStatus
from protocol.engine_core import SpecDecodingStats
from protocol.step import ModelRunnerOutput


def scheduled_drafts(requests: list[Request]) -> dict[str, list[int]]:
    """The drafts each scheduled request verifies this step: as many of its proposed ones as
    it was scheduled tokens past its known ones (committed: num_computed_tokens is the step's
    end). A scheduled request's proposals are used or dropped now; new ones come with the
    step's output."""
    spec: dict[str, list[int]] = {}
    for req in requests:
        drafts = req.spec_token_ids
        if drafts:
            k = req.num_computed_tokens - len(req.all_token_ids)
            if k > 0:
                spec[req.request_id] = drafts[:k]
            req.spec_token_ids = []
    return spec


def roll_back_rejected(
    requests: dict[str, Request],
    spec: dict[str, list[int]],
    output: ModelRunnerOutput,
    stats: SpecDecodingStats,
) -> None:
    """A request that verified k drafts and got m tokens back computed only m positions that
    hold its tokens; its num_computed_tokens goes back over the k + 1 - m rejected ones (their
    KV slots are written again next step; its blocks stay). Counts the drafts in stats, as
    vLLM does: one draft per verifying request, accepted tokens per position."""
    per_pos = stats.num_accepted_tokens_per_pos
    for req_id, sampled in zip(output.req_ids, output.sampled_token_ids):
        drafts = spec.get(req_id)
        if not drafts or not sampled:
            continue
        req = requests.get(req_id)
        if req is None or req.status != RequestStatus.RUNNING:
            continue
        accepted = len(sampled) - 1
        req.num_computed_tokens -= len(drafts) - accepted
        stats.num_drafts += 1
        stats.num_draft_tokens += len(drafts)
        stats.num_accepted_tokens += accepted
        for j in range(accepted):
            per_pos[j] += 1


def take_drafts(requests: dict[str, Request], output: ModelRunnerOutput) -> None:
    """Keep the drafts the runner proposed for each running request's next step."""
    for req_id, drafts in zip(output.req_ids, output.spec_token_ids):
        if drafts:
            req = requests.get(req_id)
            if req is not None and req.status == RequestStatus.RUNNING:
                req.spec_token_ids = drafts
