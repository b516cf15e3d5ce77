"""The scheduler's records of a step: one per scheduled request, committed once all are chosen.

schedule() first chooses (a running request's tokens and blocks, preempting when blocks run
out, then the admitted ones) and only then commits: each record advances its request and
becomes a row of the step's SchedulerOutput. Nothing is advanced while requests are chosen, so
a preemption that takes back a request scheduled earlier in the step just drops its record.
"""

from __future__ import annotations

from itertools import chain, islice
from operator import itemgetter

from engine_core.request import Request
from protocol.step import CachedRequestData, NewRequestData, SchedulerOutput

# One request scheduled this step: (request, tokens scheduled, num_computed_tokens before the
# step, its new block ids (every block, for an admitted one), whether it samples: its tokens
# reach the end of the known and in-flight ones). A tuple: one is built per request per step.
Scheduled = tuple[Request, int, int, list[int], bool]

# A running request's new block ids when it gets none: one shared, immutable empty sequence
# (the runner only tests it), not a new list per request per step.
NO_BLOCKS: list[int] = ()  # type: ignore[assignment]

_COMPUTED, _NEW_BLOCK_IDS = itemgetter(2), itemgetter(3)


def commit(
    running: list[Scheduled],
    new: list[Scheduled],
    num_tokens: int,
    finished_req_ids: list[str],
    now: float,
    async_scheduling: bool,
) -> tuple[SchedulerOutput, list[Request], list[Request]]:
    """Advance each request by its record (running ones first, then the admitted ones) and
    build the step's output of num_tokens tokens: the running requests' new blocks, the
    admitted ones in full.

    Returns the output, its requests in the order of num_scheduled_tokens, and the constrained
    ones among them that sample (their bitmask rows are due). A prompt chunk is logged in the
    request's prefill_chunks at now; with async scheduling a request that samples gets an
    output placeholder.
    """
    num_scheduled: dict[str, int] = {}
    constrained: list[Request] = []
    requests: list[Request] = []
    add = requests.append
    for req, n, computed, _, samples in chain(running, new) if new else running:
        num_scheduled[req.request_id] = n
        add(req)
        if computed < req.prompt_len == len(req.all_token_ids):  # a prompt chunk, no output
            req.prefill_chunks.append((now, n))
        req.num_computed_tokens = computed + n
        if samples:
            if req.grammar is not None:
                constrained.append(req)
            if async_scheduling:
                req.num_output_placeholders += 1
    # The running records went in first (a dict keeps insertion order); passes in C over the
    # records measured faster than appending ids and counts inside the loop.
    cached = CachedRequestData(
        list(islice(num_scheduled, len(running))) if new else list(num_scheduled),
        list(map(_NEW_BLOCK_IDS, running)),
        list(map(_COMPUTED, running)),
    )
    output = SchedulerOutput(
        scheduled_new_reqs=[
            NewRequestData(
                r.request_id,
                r.prompt_token_ids,
                r.sampling_params,
                block_ids,
                num_hit,
                r.output_token_ids,
                r.rope_long,
            )
            for r, _, num_hit, block_ids, _ in new
        ],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=num_scheduled,
        total_num_scheduled_tokens=num_tokens,
        finished_req_ids=finished_req_ids,
    )
    return output, requests, constrained
