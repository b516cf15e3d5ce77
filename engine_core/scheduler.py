"""Scheduler: vLLM V1 continuous batching with chunked prefill, prefix caching and preemption.

Each step first serves running requests in the order they started, then admits waiting ones.
A request is owed num_tokens - num_computed_tokens tokens; it gets as many as the token budget
allows (a long prompt is chunked across steps). When blocks run out, the most recently started
(or, with the priority policy, the lowest-priority) running request is preempted: its blocks
are freed and it waits to be recomputed, usually from its own blocks still in the prefix cache.

With async scheduling the next step is scheduled before the current one's sampled tokens are
known: a request sampling in a step in flight holds an output placeholder, counts as one token
longer, and is scheduled for that token's position (the worker fills in the token it sampled).
A request that will be finished by max_tokens or max_model_len once its placeholders land is
not scheduled again; one that stops on EOS or a stop id has one step's token thrown away.

Structured outputs: a constrained request waits aside until its grammar is compiled; each step
carries the token bitmask of the constrained requests that sample in it, filled by their
matchers, which then accept the tokens sampled. A constrained request needs its previous token
to fill its next bitmask, so with async scheduling it sits out the steps scheduled while its
last token is in flight (vLLM defers such requests too); it ends (stop) when its grammar is
complete and the model emits a stop token, which is then the only token the grammar allows.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from itertools import repeat
from typing import TYPE_CHECKING

from config.engine import EngineConfig
from config.kv_window import freed_window
from config.rope_arch import long_rope_threshold
from engine_core.block_hash import make_block_hasher
from engine_core.block_pool import KVCacheBlock
from engine_core.kv_cache_manager import KVCacheManager
from engine_core.request import Request, RequestStatus
from engine_core.request_queue import FcfsQueue, PriorityQueue
from engine_core.scheduler_parts import GrammarAdmission, Preemption
from engine_core.spec_drafts import roll_back_rejected, scheduled_drafts, take_drafts
from engine_core.step_records import NO_BLOCKS, Scheduled, commit
from engine_core.stop_checks import advance_grammar, check_stop
from protocol.engine_core import (
    EngineCoreOutput,
    EngineCoreRequest,
    Logprobs,
    SchedulerStats,
    SpecDecodingStats,
)
from protocol.step import LogprobsLists, ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from engine_core.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class Scheduler(GrammarAdmission, Preemption):
    """Decides each step which requests compute how many tokens, and applies what they sampled."""

    # update_from_output applies a sampled token that only completes a block (its hash is due)
    # inline, not through _update_one (off: the differential tests' full path).
    boundary_path = True

    def __init__(self, config: EngineConfig, num_blocks: int, eos_token_id: int | None) -> None:
        sched, cache = config.scheduler, config.cache
        assert sched.max_num_batched_tokens is not None, "EngineConfig.resolve() not called"
        self.max_num_seqs = sched.max_num_seqs
        self.max_num_batched_tokens = sched.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.priority_policy = sched.scheduling_policy == "priority"
        self.async_scheduling = bool(sched.async_scheduling)  # None (unresolved): off
        self.eos_token_id = eos_token_id
        # LongRoPE: the token count past which a request turns with the long factors (None:
        # every request stays short); see _switch_to_long.
        scaling = config.arch.rope_scaling if config.arch is not None else None
        self.long_rope_at = long_rope_threshold(scaling, self.max_model_len)
        self.kv = KVCacheManager(
            num_blocks,
            cache.block_size,
            cache.enable_prefix_caching,
            self.max_model_len,
            freed_window(config),
        )
        self.block_hasher = (
            make_block_hasher(cache.block_size, cache.prefix_caching_hash_algo)
            if cache.enable_prefix_caching
            else None
        )
        self.requests: dict[str, Request] = {}
        self.waiting: FcfsQueue | PriorityQueue = (
            PriorityQueue() if self.priority_policy else FcfsQueue()
        )
        self.running: list[Request] = []
        # Constrained requests whose grammar is still compiling, in arrival order.
        self.waiting_for_grammar: list[Request] = []
        # Set by the engine core with the first constrained request.
        self.structured_output: StructuredOutputManager | None = None
        # Finished, aborted and preempted since the last schedule(): the runner drops their rows.
        # A dict keeps them in order (an ordered set).
        self._finished_req_ids: dict[str, None] = {}
        self._finish_outputs: list[EngineCoreOutput] = []
        # The last few steps scheduled (at most two are in flight) and their requests in the
        # order of num_scheduled_tokens: update_from_output reads them without a dict lookup.
        self._scheduled: deque[tuple[SchedulerOutput, list[Request]]] = deque(maxlen=4)
        self._num_preemptions = 0
        self._num_scheduled_tokens = 0
        self._num_prompt_tokens = 0
        self._num_cached_prompt_tokens = 0
        self._num_generation_tokens = 0
        # Speculative decoding: drafts a request may verify per step, and the positions past a
        # step's tokens whose KV the proposer writes (a draft model's or EAGLE head's drafts;
        # n-gram writes none), which the request's blocks must cover.
        spec = config.speculative
        self.num_spec_tokens = spec.num_speculative_tokens if spec is not None else 0
        self.num_lookahead_tokens = (
            self.num_spec_tokens if spec is not None and spec.method != "ngram" else 0
        )
        self._spec_stats: SpecDecodingStats | None = None

    def add_request(self, request: Request | EngineCoreRequest) -> None:
        """Queue a request; an EngineCoreRequest is wrapped with this scheduler's block hasher."""
        if isinstance(request, EngineCoreRequest):
            request = Request.from_engine_core_request(
                request, self.eos_token_id, self.block_hasher
            )
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r} is already scheduled")
        if not 0 < request.num_prompt_tokens <= self.max_model_len:
            raise ValueError(
                f"prompt of {request.num_prompt_tokens} tokens; it must have 1 to "
                f"max_model_len ({self.max_model_len}) tokens"
            )
        if self.long_rope_at is not None and request.num_prompt_tokens > self.long_rope_at:
            request.set_rope_long()  # a prompt beyond the original context starts long
        self.requests[request.request_id] = request
        if request.grammar is not None and not request.grammar.ready:
            self.waiting_for_grammar.append(request)
        else:
            self.waiting.add(request)

    def finish_requests(self, req_ids: str | Iterable[str], status: RequestStatus) -> None:
        """End requests (e.g. aborts) and free their blocks now; unknown ids are ignored."""
        if isinstance(req_ids, str):
            req_ids = (req_ids,)
        from_running = from_waiting = False
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                from_running = True
            else:
                from_waiting = True
            req.status = status
            self._free(req)
            self._finish_outputs.append(
                EngineCoreOutput(req_id, [], finish_reason=RequestStatus.finish_reason(status))
            )
        if from_running:
            self.running = [r for r in self.running if not r.is_finished]
        if from_waiting:
            self.waiting.drop_finished()
            if self.waiting_for_grammar:
                self.waiting_for_grammar = [
                    r for r in self.waiting_for_grammar if not r.is_finished
                ]

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts; advances their num_computed_tokens.

        Design. There is no prefill or decode phase: a request is owed its tokens (prompt,
        outputs and, with async scheduling, the placeholders of steps in flight) beyond
        num_computed_tokens, and one token budget pays them: running requests first, in the
        order they started, then waiting ones. A running request asks the KV cache manager for
        blocks only when this step's tokens pass what its blocks cover (the steady decode asks
        nothing); when no block is free, requests are preempted until it fits, and then no
        waiting request is admitted this step. Each scheduled request leaves one record; once
        every request is chosen, the records advance their requests and become the output.
        """
        if self.waiting_for_grammar:
            self._admit_compiled()
        now = time.time()
        running, budget, preempted = self._schedule_running(self.max_num_batched_tokens)
        new: list[Scheduled] = []
        if not preempted:  # As vLLM: admitting after a preemption would thrash the freed blocks.
            new, budget = self._schedule_waiting(budget)
        output, requests, constrained = commit(
            running,
            new,
            self.max_num_batched_tokens - budget,
            list(self._finished_req_ids),
            now,
            self.async_scheduling,
        )
        self._finished_req_ids = {}
        if self.num_spec_tokens:
            output.scheduled_spec_decode_tokens = scheduled_drafts(requests)
        if output.total_num_scheduled_tokens:
            self._scheduled.append((output, requests))
        if constrained:
            assert self.structured_output is not None
            output.structured_output_request_ids = [r.request_id for r in constrained]
            grammars = [r.grammar for r in constrained if r.grammar is not None]
            spec = output.scheduled_spec_decode_tokens
            output.grammar_bitmask = (
                self.structured_output.fill_bitmask(
                    grammars, [spec.get(r.request_id, []) for r in constrained]
                )
                if spec
                else self.structured_output.fill_bitmask(grammars)
            )
        self._num_scheduled_tokens += output.total_num_scheduled_tokens
        return output

    def _schedule_running(self, budget: int) -> tuple[list[Scheduled], int, bool]:
        """The running requests' records for this step, the budget left, and whether a request
        was preempted for blocks. Requests are not advanced yet: a preemption may take one back."""
        kv, max_model_len, no_blocks = self.kv, self.max_model_len, NO_BLOCKS
        running = self.running
        scheduled: list[Scheduled] = []
        record = scheduled.append
        preempted = False
        i, num_running = 0, len(running)
        while i < num_running and budget > 0:
            req = running[i]
            i += 1
            pending = req.num_output_placeholders
            num_tokens = len(req.all_token_ids) + pending
            # A constrained request's next bitmask needs the token in flight; one that the
            # tokens in flight will end by a length cap (max_tokens, max_model_len) is done.
            if pending and (
                req.grammar is not None
                or num_tokens >= req.max_tokens_total
                or num_tokens >= max_model_len
            ):
                continue
            computed = req.num_computed_tokens
            end = num_tokens if num_tokens <= max_model_len else max_model_len
            n = end - computed
            if n <= 0:
                continue
            if n > budget:  # a prompt chunk
                n = budget
                end = computed + n
            elif n == 1 and req.spec_token_ids:
                # A decode with drafts verifies as many as its limits allow: positions within
                # max_model_len, outputs within max_tokens, tokens within the budget, and a
                # constrained request's drafts within its grammar.
                grammar = req.grammar
                k = min(
                    len(req.spec_token_ids)
                    if grammar is None
                    else grammar.valid_drafts(req.spec_token_ids),
                    max_model_len - num_tokens,
                    req.max_tokens_total - num_tokens - 1,
                    budget - 1,
                )
                if k > 0:
                    n += k
                    end += k
            if self.long_rope_at is not None and end > self.long_rope_at and not req.rope_long:
                # Crossing LongRoPE's original context: recomputed with the long factors,
                # once the token in flight (sampled with the short ones) is known.
                if not pending:
                    i -= 1
                    num_running -= 1
                    del running[i]
                    self._switch_to_long(req)
                continue
            new_block_ids = no_blocks
            alloc_n, alloc_end = n, end
            if self.num_lookahead_tokens:
                alloc_n = min(n + self.num_lookahead_tokens, max_model_len - computed)
                alloc_end = computed + alloc_n
            # The steady case skips the KV cache manager: its blocks hold end, and no block
            # completes (with async scheduling, the token that fills the last block may be in
            # flight: the block is cached once that token is known, a step later).
            if alloc_end > req.alloc_limit and not (
                alloc_end <= req.block_room and num_tokens - pending < req.cache_due_at
            ):
                blocks = kv.allocate_slots(req, alloc_n)
                if blocks is None:
                    preempted = True
                    blocks, returned, num_before = self._preempt_for(req, alloc_n, i - 1, scheduled)
                    budget += returned
                    i -= num_before
                    num_running = len(running)
                    if blocks is None:  # req itself was preempted
                        break
                if blocks:
                    new_block_ids = [b.block_id for b in blocks]
            record((req, n, computed, new_block_ids, end >= num_tokens))
            budget -= n
        return scheduled, budget, preempted

    def _preempt_for(
        self, req: Request, n: int, index: int, scheduled: list[Scheduled]
    ) -> tuple[list[KVCacheBlock] | None, int, int]:
        """Preempt running requests until n more tokens of req (self.running[index]) fit.

        Returns req's new blocks (None: req itself was preempted), the tokens of the requests
        taken back (scheduled earlier this step: only the priority policy picks those), and how
        many running requests before req were preempted (req's index moves down by as many).
        """
        running = self.running
        returned = num_before = 0
        while True:
            victim, vi = self._pick_victim()
            del running[vi]
            if vi < index:
                returned += self._take_back(victim, scheduled)
                num_before += 1
                index -= 1
            self._preempt(victim)
            if victim is req:
                return None, returned, num_before
            blocks = self.kv.allocate_slots(req, n)
            if blocks is not None:
                return blocks, returned, num_before

    def _take_back(self, req: Request, scheduled: list[Scheduled]) -> int:
        """Drop the record of a request scheduled earlier this step; returns its tokens (0 when
        it sat this step out: in flight and constrained or length-capped, or owed nothing)."""
        j = next((j for j, record in enumerate(scheduled) if record[0] is req), None)
        if j is None:
            return 0
        _, n, _, _, _ = scheduled.pop(j)
        # Records are not advanced yet: num_computed_tokens is still the step's start.
        self.kv.uncache_uncomputed_blocks(req)
        return n

    def _schedule_waiting(self, budget: int) -> tuple[list[Scheduled], int]:
        """Admit waiting requests in queue order while the budget, max_num_seqs and the free
        blocks allow; their records (with every block they hold) and the budget left."""
        kv, waiting, running = self.kv, self.waiting, self.running
        new: list[Scheduled] = []
        while len(waiting) and budget > 0 and len(running) < self.max_num_seqs:
            req = waiting.peek()
            long_at = self.long_rope_at
            if long_at is not None and not req.rope_long and req.num_tokens > long_at:
                req.set_rope_long()  # before the prefix-cache lookup: long blocks only
            hit_blocks, num_hit = kv.get_computed_blocks(req)
            n = min(min(req.num_tokens, self.max_model_len) - num_hit, budget)
            alloc_n = n
            if self.num_lookahead_tokens:
                alloc_n = min(n + self.num_lookahead_tokens, self.max_model_len - num_hit)
            if kv.allocate_slots(req, alloc_n, hit_blocks) is None:
                break
            waiting.pop()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            running.append(req)
            blocks = kv.get_block_ids(req.request_id)
            new.append((req, n, num_hit, blocks, num_hit + n >= len(req.all_token_ids)))
            budget -= n
        return new, budget

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Apply sampled tokens and stop checks; an output per request that sampled or ended."""
        outputs, self._finish_outputs = self._finish_outputs, []
        requests = self.requests
        if scheduler_output.scheduled_spec_decode_tokens:
            if self._spec_stats is None:
                self._spec_stats = SpecDecodingStats(
                    num_accepted_tokens_per_pos=[0] * self.num_spec_tokens
                )
            roll_back_rejected(
                requests,
                scheduler_output.scheduled_spec_decode_tokens,
                model_runner_output,
                self._spec_stats,
            )
        logprobs = model_runner_output.logprobs
        prompt_logprobs = model_runner_output.prompt_logprobs
        self._any_finished = False
        num_generated = 0
        running = RequestStatus.RUNNING
        checked = self._apply_checked
        append_output = outputs.append
        req_ids = model_runner_output.req_ids
        for req_id, sampled, lp, req in zip(
            req_ids,
            model_runner_output.sampled_token_ids,
            logprobs or repeat(None),
            self._scheduled_requests(scheduler_output, req_ids),
        ):
            if req.status != running:  # finished (its id may name a new request now) or
                found = requests.get(req_id)  # preempted; the same lookup when not known
                if found is None or found.status != running:
                    continue
                req = found
            # Mid-prompt; or preempted after this step was scheduled (then recomputed
            # from its tokens) and running again: its status is not told apart, as before.
            if not sampled:
                continue
            # The steady path: one token, no stop id, below every length cap and block
            # boundary (check_at, in tokens), no grammar or logprobs; the rest goes through
            # _apply_checked.
            token = sampled[0]
            all_ids = req.all_token_ids
            plp = prompt_logprobs.get(req_id) if prompt_logprobs else None
            if (
                len(all_ids) + 1 >= req.check_at
                or token in req.stop_check_ids
                or len(sampled) != 1
                or lp is not None
                or req.grammar is not None
                or plp is not None
            ):
                num_generated += checked(req, req_id, sampled, lp, plp, outputs)
                continue
            pending = req.num_output_placeholders
            if pending:
                req.num_output_placeholders = pending - 1
            all_ids.append(token)
            append_output(EngineCoreOutput(req_id, sampled))
            num_generated += 1
        if self._any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        self._num_generation_tokens += num_generated
        if model_runner_output.spec_token_ids:
            take_drafts(requests, model_runner_output)
        return outputs

    def _apply_checked(
        self,
        req: Request,
        req_id: str,
        sampled: list[int],
        lp: LogprobsLists | None,
        plp: LogprobsLists | None,
        outputs: list[EngineCoreOutput],
    ) -> int:
        """Apply a request's sampled tokens off the steady path; returns the tokens kept."""
        num_tokens = len(req.all_token_ids) + 1
        token = sampled[0]
        if (
            self.boundary_path
            and num_tokens < req.max_tokens_total
            and num_tokens < self.max_model_len
            and num_tokens != req.prompt_len + 1
            and token not in req.stop_check_ids
            and len(sampled) == 1
            and lp is None
            and req.grammar is None
            and plp is None
        ):
            # Only check_at's block boundary (a block completes: its hash is due), not the
            # first output, no stop, no length cap: what _update_one does then.
            pending = req.num_output_placeholders
            if pending:
                req.num_output_placeholders = pending - 1
            req.append_output_token(token)
            self._set_check_at(req)
            outputs.append(EngineCoreOutput(req_id, sampled))
            return 1
        return self._update_one(req, sampled, outputs, lp, plp)

    def _scheduled_requests(
        self, scheduler_output: SchedulerOutput, req_ids: list[str]
    ) -> list[Request]:
        """The requests of req_ids as schedule() recorded them for this output; otherwise a
        stand-in whose status sends update_from_output to its dict lookup."""
        scheduled = self._scheduled
        for k, (output, reqs) in enumerate(scheduled):
            if output is scheduler_output:
                for _ in range(k + 1):  # it, and any older step never applied
                    scheduled.popleft()
                # In-process the runner's ids are the scheduler's own strings: `==` compares
                # identities only.
                if len(reqs) == len(req_ids) and req_ids == list(output.num_scheduled_tokens):
                    return reqs
                break
        return [_UNKNOWN] * len(req_ids)

    def _update_one(
        self,
        req: Request,
        sampled: list[int],
        outputs: list[EngineCoreOutput],
        logprobs: LogprobsLists | None,
        prompt_logprobs: LogprobsLists | None,
    ) -> int:
        """Apply one request's sampled tokens with every check; returns the tokens kept."""
        if req.num_output_placeholders:
            req.num_output_placeholders -= len(sampled)
        new_tokens, status = sampled, None
        for k, token in enumerate(sampled):
            req.append_output_token(token)
            status = check_stop(req, token, self.max_model_len)
            if status is None and req.grammar is not None:
                status = advance_grammar(req, token)
            if status is not None:
                new_tokens = sampled[: k + 1]
                break
        out = EngineCoreOutput(req.request_id, new_tokens, _wire(logprobs), _wire(prompt_logprobs))
        if len(req.all_token_ids) - req.prompt_len == len(new_tokens):
            out.num_cached_tokens = max(req.num_cached_tokens, 0)
            out.prefill_chunks, req.prefill_chunks = req.prefill_chunks, []
            # vLLM counts a prompt when its first token comes: every token, cached or not.
            self._num_prompt_tokens += req.num_prompt_tokens
            self._num_cached_prompt_tokens += out.num_cached_tokens
        if status is not None:
            req.status = status
            out.finish_reason = RequestStatus.finish_reason(status)
            out.stop_reason = req.stop_reason
            self._free(req)
            self._any_finished = True
        else:
            self._set_check_at(req)
        outputs.append(out)
        return len(new_tokens)

    def _set_check_at(self, req: Request) -> None:
        """The token count at which update_from_output next needs its full checks: a length
        cap (max_tokens, max_model_len) or a block completing (its hash is due)."""
        check_at = min(self.max_model_len, req.max_tokens_total)
        hash_len = req.next_hash_len
        if hash_len is not None and hash_len < check_at:
            check_at = hash_len
        req.check_at = check_at

    def _free(self, req: Request) -> None:
        self.kv.free(req)
        del self.requests[req.request_id]
        self._finished_req_ids[req.request_id] = None

    def has_unfinished_requests(self) -> bool:
        """True while any request waits or runs."""
        return bool(self.requests)

    def has_finished_requests(self) -> bool:
        """True when the next step has finished ids or finish outputs to deliver."""
        return bool(self._finished_req_ids or self._finish_outputs)

    def get_num_unfinished_requests(self) -> int:
        """Waiting plus running requests."""
        return len(self.requests)

    def make_stats(self) -> SchedulerStats:
        """Queue sizes and KV usage now; token, cache-hit and preemption counts since last call."""
        queries, hits = self.kv.make_prefix_cache_stats()
        stats = SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            num_preemptions=self._num_preemptions,
            num_scheduled_tokens=self._num_scheduled_tokens,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generation_tokens=self._num_generation_tokens,
            num_cached_prompt_tokens=self._num_cached_prompt_tokens,
            spec_decoding=self._spec_stats,
        )
        self._spec_stats = None
        self._num_preemptions = self._num_scheduled_tokens = 0
        self._num_prompt_tokens = self._num_generation_tokens = 0
        self._num_cached_prompt_tokens = 0
        return stats

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks; False (nothing changed) while requests hold blocks."""
        return self.kv.reset_prefix_cache()


class _Unknown:
    """Stands for a request update_from_output must look up by id."""

    __slots__ = ()
    status = RequestStatus.FINISHED_ABORTED


# Typed as a Request: update_from_output reads only its status before looking the id up.
_UNKNOWN: Request = _Unknown()  # type: ignore[assignment]


def _wire(lp: LogprobsLists | None) -> Logprobs | None:
    """The runner's logprobs as the engine core's protocol types them (same fields)."""
    return None if lp is None else Logprobs(lp.token_ids, lp.logprobs, lp.ranks)
