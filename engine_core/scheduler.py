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
from engine_core.block_hash import make_block_hasher
from engine_core.kv_cache_manager import KVCacheManager
from engine_core.request import Request, RequestStatus
from engine_core.request_queue import FcfsQueue, PriorityQueue
from protocol.engine_core import EngineCoreOutput, EngineCoreRequest, Logprobs, SchedulerStats
from protocol.step import (
    CachedRequestData,
    LogprobsLists,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)

if TYPE_CHECKING:
    from engine_core.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class Scheduler:
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
        self.async_scheduling = sched.async_scheduling
        self.eos_token_id = eos_token_id
        self.kv = KVCacheManager(
            num_blocks, cache.block_size, cache.enable_prefix_caching, self.max_model_len
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

    def _admit_compiled(self) -> None:
        """Move constrained requests whose compile ended to the waiting queue (or end them
        when it failed: the grammar was checked on arrival, so that is an internal error)."""
        still = []
        for req in self.waiting_for_grammar:
            grammar = req.grammar
            assert grammar is not None
            if not grammar.ready:
                still.append(req)
            elif grammar.error is not None:
                logger.error(
                    "request %s: grammar compile failed: %s", req.request_id, grammar.error
                )
                req.status = RequestStatus.FINISHED_ABORTED
                self._free(req)
                self._finish_outputs.append(
                    EngineCoreOutput(
                        req.request_id, [], finish_reason=RequestStatus.finish_reason(req.status)
                    )
                )
            else:
                self.waiting.add(req)
        self.waiting_for_grammar = still

    def wait_for_grammars(self, timeout: float) -> None:
        """Nothing else to do: block until a compile ends, or timeout seconds."""
        grammars = [r.grammar for r in self.waiting_for_grammar if r.grammar is not None]
        if grammars and self.structured_output is not None:
            self.structured_output.wait_any(grammars, timeout)

    def only_waiting_for_grammars(self) -> bool:
        """True when every unfinished request waits for its grammar's compile."""
        return bool(self.waiting_for_grammar) and not self.running and not len(self.waiting)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts; advances their num_computed_tokens."""
        if self.waiting_for_grammar:
            self._admit_compiled()
        kv, max_model_len = self.kv, self.max_model_len
        budget = self.max_num_batched_tokens
        placeholders = self.async_scheduling
        now = time.time()
        # The scheduled running requests, in order: ids, token counts, new block ids and
        # num_computed_tokens before this step. Each request is advanced as it is scheduled.
        run_ids: list[str] = []
        run_counts: list[int] = []
        # The new block ids of the scheduled running requests given any (most get none).
        block_of: dict[str, list[int]] = {}
        run_computed: list[int] = []
        run_reqs: list[Request] = []
        constrained: list[Request] = []
        new_reqs: list[Request] = []
        preempted = False

        running = self.running
        add_id, add_count = run_ids.append, run_counts.append
        add_computed = run_computed.append
        add_req = run_reqs.append
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            pending = req.num_output_placeholders
            computed = req.num_computed_tokens
            total = len(req.all_token_ids) + pending
            # A constrained request's next bitmask needs the token in flight; one that the
            # tokens in flight will end by a length cap (max_tokens, max_model_len) is done.
            if pending and (
                req.grammar is not None or total >= req.max_tokens_total or total >= max_model_len
            ):
                i += 1
                continue
            n = total - computed
            if (
                0 < n <= budget
                and total <= max_model_len
                and (
                    total <= req.alloc_limit
                    # Async scheduling: the token that fills the last block is in flight; the
                    # block is cached once it is known (a step later), nothing to do now.
                    or (total <= req.block_room and total - pending < req.cache_due_at)
                )
            ):
                # The steady path: a decode (or a prompt chunk) that fits the budget and the
                # blocks it holds, completing no block: nothing to allocate or cache.
                add_id(req.request_id)
                add_count(n)
                add_req(req)
                add_computed(computed)
                budget -= n
                req.num_computed_tokens = total
                if computed < req.prompt_len == len(req.all_token_ids):  # no output yet
                    req.prefill_chunks.append((now, n))
                if req.grammar is not None:
                    constrained.append(req)
                if placeholders:
                    req.num_output_placeholders = pending + 1
                i += 1
                continue
            if total > max_model_len:
                total = max_model_len
                n = total - computed
            if n <= 0:
                i += 1
                continue
            if n > budget:
                n = budget
            while (blocks := kv.allocate_slots(req, n)) is None:
                victim, vi = self._pick_victim()
                del running[vi]
                if vi < i:  # already scheduled this step (priority policy): take it back
                    j = run_ids.index(victim.request_id)
                    budget += run_counts[j]
                    victim.num_computed_tokens = run_computed[j]
                    kv.uncache_uncomputed_blocks(victim)
                    if (
                        run_computed[j] < victim.prompt_len
                        and len(victim.all_token_ids) == victim.prompt_len
                    ):
                        victim.prefill_chunks.pop()
                    if victim.grammar is not None and victim in constrained:
                        constrained.remove(victim)
                    # (its entry in block_of, if any, is read only for ids in run_ids)
                    del run_ids[j], run_counts[j], run_computed[j], run_reqs[j]
                    i -= 1
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if blocks is None:
                break
            add_id(req.request_id)
            add_count(n)
            if blocks:
                block_of[req.request_id] = [b.block_id for b in blocks]
            add_computed(computed)
            add_req(req)
            budget -= n
            self._advance(req, computed, n, now, constrained)
            i += 1

        # As vLLM: after a preemption nothing is admitted, or the freed blocks would thrash.
        waiting = self.waiting
        num_scheduled = dict(zip(run_ids, run_counts))
        while not preempted and len(waiting) and budget > 0 and len(running) < self.max_num_seqs:
            req = waiting.peek()
            hit_blocks, num_hit = kv.get_computed_blocks(req)
            n = min(req.num_tokens, max_model_len) - num_hit
            n = min(n, budget)
            if kv.allocate_slots(req, n, hit_blocks) is None:
                break
            waiting.pop()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            running.append(req)
            new_reqs.append(req)
            num_scheduled[req.request_id] = n
            budget -= n

        run_blocks = (
            [block_of.get(r, _NO_BLOCKS) for r in run_ids]
            if block_of
            else [_NO_BLOCKS] * len(run_ids)
        )
        output = SchedulerOutput(
            scheduled_new_reqs=[
                NewRequestData(
                    r.request_id,
                    r.prompt_token_ids,
                    r.sampling_params,
                    kv.get_block_ids(r.request_id),
                    r.num_computed_tokens,
                    r.output_token_ids,
                )
                for r in new_reqs
            ],
            scheduled_cached_reqs=CachedRequestData(run_ids, run_blocks, run_computed),
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=self.max_num_batched_tokens - budget,
            finished_req_ids=list(self._finished_req_ids),
        )
        self._finished_req_ids = {}
        if output.total_num_scheduled_tokens:
            run_reqs += new_reqs
            self._scheduled.append((output, run_reqs))
        for r in new_reqs:
            self._advance(r, r.num_computed_tokens, num_scheduled[r.request_id], now, constrained)
        if constrained:
            assert self.structured_output is not None
            output.structured_output_request_ids = [r.request_id for r in constrained]
            output.grammar_bitmask = self.structured_output.fill_bitmask(
                [r.grammar for r in constrained]
            )  # type: ignore[misc]
        self._num_scheduled_tokens += output.total_num_scheduled_tokens
        return output

    def _advance(
        self, req: Request, computed: int, n: int, now: float, constrained: list[Request]
    ) -> None:
        """Count n scheduled tokens as computed; a request that samples gets a placeholder."""
        if computed < req.prompt_len == len(req.all_token_ids):  # no output yet
            req.prefill_chunks.append((now, n))
        req.num_computed_tokens = computed = computed + n
        if computed >= len(req.all_token_ids) + req.num_output_placeholders:  # it samples
            if req.grammar is not None:
                constrained.append(req)
            if self.async_scheduling:
                req.num_output_placeholders += 1  # this step samples its next token

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Apply sampled tokens and stop checks; an output per request that sampled or ended."""
        outputs, self._finish_outputs = self._finish_outputs, []
        requests = self.requests
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
                req = requests.get(req_id)  # preempted; the same lookup when not known
                if req is None or req.status != running:
                    continue
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
            status = self._check_stop(req, token)
            if status is None and req.grammar is not None:
                status = self._advance_grammar(req, token)
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

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        """Stop tokens win over length caps; EOS and stop ids wait for min_tokens."""
        params = req.sampling_params
        num_output = len(req.all_token_ids) - req.prompt_len
        if num_output >= params.min_tokens:
            if token == req.eos_token_id and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token in req.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if (params.max_tokens is not None and num_output >= params.max_tokens) or len(
            req.all_token_ids
        ) >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    @staticmethod
    def _advance_grammar(req: Request, token: int) -> RequestStatus | None:
        """Feed a sampled token to the request's matcher; STOPPED once the grammar has ended."""
        grammar = req.grammar
        assert grammar is not None
        if not grammar.accept(token):
            # Only when the mask left nothing (min_tokens forbidding the one stop token the
            # finished grammar allows); the request goes on from the grammar's last state.
            logger.warning(
                "request %s: sampled token %d is outside its grammar", req.request_id, token
            )
            return None
        if grammar.terminated:
            if token != req.eos_token_id:
                req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        return None

    def _pick_victim(self) -> tuple[Request, int]:
        """The running request to preempt, and its index in self.running."""
        running = self.running
        if not self.priority_policy:
            return running[-1], len(running) - 1
        # Lowest priority (highest value); ties go to the latest arrival, then the latest started.
        vi = max(
            range(len(running) - 1, -1, -1),
            key=lambda j: (running[j].priority, running[j].arrival_time),
        )
        return running[vi], vi

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_output_placeholders = 0  # the in-flight step's token is thrown away
        req.num_preemptions += 1
        self._num_preemptions += 1
        self._finished_req_ids[req.request_id] = None
        self.waiting.add_preempted(req)

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
        )
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


_UNKNOWN = _Unknown()
# A running request's new block ids when it gets none: one shared, immutable empty sequence
# (the runner only tests it), not a new list per request per step.
_NO_BLOCKS: list[int] = ()  # type: ignore[assignment]


def _wire(lp: LogprobsLists | None) -> Logprobs | None:
    """The runner's logprobs as the engine core's protocol types them (same fields)."""
    return None if lp is None else Logprobs(lp.token_ids, lp.logprobs, lp.ranks)
