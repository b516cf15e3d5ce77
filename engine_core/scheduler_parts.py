"""Two parts of the Scheduler (engine_core/scheduler.py) in files of their own: admitting
constrained requests once their grammars compile, and preempting a running request (for blocks,
or to recompute it with LongRoPE's long factors). Mixins over the Scheduler's own state."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from engine_core.request import Request, RequestStatus
from protocol.engine_core import EngineCoreOutput

if TYPE_CHECKING:
    from engine_core.kv_cache_manager import KVCacheManager
    from engine_core.request_queue import FcfsQueue, PriorityQueue
    from engine_core.structured_output.manager import StructuredOutputManager

logger = logging.getLogger("engine_core.scheduler")


class GrammarAdmission:
    """Constrained requests wait aside (waiting_for_grammar) until their grammar compiles."""

    waiting_for_grammar: list[Request]
    waiting: FcfsQueue | PriorityQueue
    running: list[Request]
    structured_output: StructuredOutputManager | None
    _finish_outputs: list[EngineCoreOutput]

    if TYPE_CHECKING:

        def _free(self, req: Request) -> None: ...

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


class Preemption:
    """Taking a running request back: its blocks freed, recomputed later from the queue."""

    running: list[Request]
    waiting: FcfsQueue | PriorityQueue
    kv: KVCacheManager
    priority_policy: bool
    _num_preemptions: int
    _finished_req_ids: dict[str, None]

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
        req.spec_token_ids = []
        req.num_preemptions += 1
        self._num_preemptions += 1
        self._finished_req_ids[req.request_id] = None
        self.waiting.add_preempted(req)

    def _switch_to_long(self, req: Request) -> None:
        """Recompute a running request with LongRoPE's long factors from its first token, as
        transformers' Phi-3 generate() drops its cache and re-encodes the whole sequence once
        it outgrows the original context (transformers PR 33129): its KV is freed, its block
        hashes carry the long flag, and it waits at the front of the queue, resumed like a
        preempted request (the runner drops its row and takes it anew, with rope_long). Not
        counted as a preemption: no block shortage caused it."""
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.set_rope_long()
        self._finished_req_ids[req.request_id] = None
        self.waiting.add_preempted(req)
