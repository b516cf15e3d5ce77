"""The scheduler and constrained requests: waiting for a compile, bitmask rows, stopping when
the grammar ends, and sitting out async steps while a token is in flight (no model: a fake
grammar and the fake runner of the scheduler tests)."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np

from engine_core.request import Request, RequestStatus
from protocol.step import ModelRunnerOutput
from tests.engine_core.utils import EOS, make_request, make_scheduler


class FakeGrammar:
    """A grammar that allows tokens 7, 8, 9 in turn, then only EOS; a controllable compile."""

    def __init__(self, ready: bool = True) -> None:
        self.compiled: Future = Future()
        if ready:
            self.compiled.set_result(None)
        self.accepted: list[int] = []

    @property
    def ready(self) -> bool:
        return self.compiled.done()

    @property
    def error(self):
        return self.compiled.exception() if self.compiled.done() else None

    def allowed(self) -> int:
        return 7 + len(self.accepted) if len(self.accepted) < 3 else EOS

    def accept(self, token: int) -> bool:
        if token != self.allowed():
            return False
        self.accepted.append(token)
        return True

    @property
    def terminated(self) -> bool:
        return bool(self.accepted) and self.accepted[-1] == EOS


class FakeManager:
    """Fills one row per grammar: the row's first word holds its one allowed token's id."""

    def fill_bitmask(self, grammars) -> bytes:
        return np.array([[g.allowed()] for g in grammars], dtype="<i4").tobytes()

    @staticmethod
    def wait_any(grammars, timeout):
        pass


def _constrained(scheduler, req_id: str, prompt: int = 5, ready: bool = True, **params):
    req = Request.from_engine_core_request(
        make_request(req_id, prompt, **params), EOS, scheduler.block_hasher
    )
    req.grammar = FakeGrammar(ready)
    scheduler.structured_output = FakeManager()
    scheduler.add_request(req)
    return req


def _run_step(scheduler, so, sample=None):
    """Every request that reaches the end of its tokens samples: a constrained one the token
    its bitmask row allows, others token 5."""
    allowed = dict(
        zip(
            so.structured_output_request_ids,
            np.frombuffer(so.grammar_bitmask, dtype="<i4").tolist(),
        )
    )
    req_ids = list(so.num_scheduled_tokens)
    sampled = []
    for r in req_ids:
        req = scheduler.requests.get(r)
        samples = req is not None and req.num_computed_tokens >= req.num_tokens
        sampled.append([allowed.get(r, 5)] if samples or r in allowed else [])
    return scheduler.update_from_output(
        so, ModelRunnerOutput(req_ids, sampled, [None] * len(req_ids))
    )


def test_request_waits_for_its_compile_while_others_run():
    s = make_scheduler()
    req = _constrained(s, "c", ready=False)
    s.add_request(make_request("free", 5))
    so = s.schedule()
    assert list(so.num_scheduled_tokens) == ["free"] and s.waiting_for_grammar == [req]
    assert not s.only_waiting_for_grammars()
    req.grammar.compiled.set_result(None)
    _run_step(s, so)
    so = s.schedule()
    assert "c" in so.num_scheduled_tokens and not s.waiting_for_grammar


def test_bitmask_rows_only_for_sampling_constrained_requests_and_stop_at_grammar_end():
    s = make_scheduler(max_num_batched_tokens=4)  # the 6-token prompt takes two chunks
    _constrained(s, "c", prompt=6, max_tokens=50)
    s.add_request(make_request("free", 2))
    so = s.schedule()
    assert so.structured_output_request_ids == []  # "c" is mid-prompt
    _run_step(s, so)
    tokens: list[int] = []
    finish = None
    for _ in range(10):
        so = s.schedule()
        if "c" in so.num_scheduled_tokens:
            assert so.structured_output_request_ids == ["c"]
            assert len(so.grammar_bitmask) == 4
        for out in _run_step(s, so):
            if out.request_id == "c":
                tokens += out.new_token_ids
                finish = out.finish_reason
        if finish is not None:
            break
    assert tokens == [7, 8, 9, EOS] and str(finish) == "stop"


def test_max_tokens_ends_a_constrained_request_with_length():
    s = make_scheduler()
    _constrained(s, "c", max_tokens=2)
    outs = _run_step(s, s.schedule()) + _run_step(s, s.schedule())
    assert [t for o in outs for t in o.new_token_ids] == [7, 8]
    assert str(outs[-1].finish_reason) == "length"


def test_abort_while_compiling():
    s = make_scheduler()
    _constrained(s, "c", ready=False)
    assert s.only_waiting_for_grammars()
    s.finish_requests("c", RequestStatus.FINISHED_ABORTED)
    assert not s.waiting_for_grammar
    outs = s.update_from_output(s.schedule(), ModelRunnerOutput())
    assert [(o.request_id, str(o.finish_reason)) for o in outs] == [("c", "abort")]
    assert not s.has_unfinished_requests()


def test_failed_compile_ends_the_request():
    s = make_scheduler()
    req = _constrained(s, "c", ready=False)
    req.grammar.compiled.set_exception(RuntimeError("boom"))
    so = s.schedule()
    assert not so.num_scheduled_tokens
    outs = s.update_from_output(so, ModelRunnerOutput())
    assert [(o.request_id, str(o.finish_reason)) for o in outs] == [("c", "abort")]


def test_async_constrained_request_sits_out_while_its_token_is_in_flight():
    s = make_scheduler(async_scheduling=True)
    _constrained(s, "c", max_tokens=50)
    s.add_request(make_request("free", 5, max_tokens=50))
    first = s.schedule()
    assert set(first.num_scheduled_tokens) == {"c", "free"}
    second = s.schedule()  # scheduled while the first is in flight
    assert set(second.num_scheduled_tokens) == {"free"}
    assert second.structured_output_request_ids == []
    _run_step(s, first)
    third = s.schedule()
    assert "c" in third.num_scheduled_tokens and third.structured_output_request_ids == ["c"]
