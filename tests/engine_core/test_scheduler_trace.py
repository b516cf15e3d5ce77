"""The scheduler's whole-run differential trace: golden digests of seeded random workloads.

Each seed drives a Scheduler and the FakeRunner through a random workload (chunked prefill,
preemption under block pressure, prefix caching with salts, FCFS and priority policies, async
scheduling's placeholders, EOS and stop ids with min_tokens, length caps, aborts, logprobs and
prompt logprobs, constrained requests whose grammars compile late or fail) and hashes every
step's SchedulerOutput and EngineCoreOutputs (with the scheduler's stats), msgpack-encoded. The
digests were recorded from the scheduler before schedule() was restructured: a refactor of the
scheduler must leave every decision, and so every digest, byte-identical. A digest that changes
means behaviour changed; record new ones only for an intended change, and say so.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections import deque
from concurrent.futures import Future

import msgspec
import numpy as np
import pytest

from engine_core.request import Request, RequestStatus
from protocol.engine_core import EngineCoreOutputs
from protocol.step import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from tests.engine_core.test_scheduler_random import check_invariants
from tests.engine_core.utils import EOS, FakeRunner, make_request, make_scheduler
from tests.structured_output.test_scheduling import FakeGrammar, FakeManager

_encode = msgspec.msgpack.Encoder().encode

# sha256 of each seed's trace, recorded from the scheduler at 305660f; re-recorded when
# NewRequestData gained rope_long (one more encoded field; with that field removed, the
# scheduler's LongRoPE changes still gave the 305660f digests).
GOLDEN = {
    0: "cb685c832a16a0b353585421114b85801550712874d697387cb8c2a92cdfd59e",
    1: "3d11b7fa1a7a8d1aebb87602f4c586cd08e44c8be16c81e0cf9bff3a3cad87b4",
    2: "ec9d6ee9910b6408918b620623ca391459ccde0971e05c33a3b27b64190f835c",
    3: "242fbaac4b0c97e25c08dfb1133ec4e981ba99a7bf8b86a6f6c63a2af85cf41f",
    4: "680e7362904ec08a30ffbb82d63245be44e6f2ebecd03e48aef2ed494a01da3e",
    5: "a454477d79d5222daa6fe4ce1284faf162099722e31760c21c17d6b1ed02840d",
    6: "334e949f00beaf5008f41bb3a6dc5d50ff459086de6c389b9c22740a83e1f71f",
    7: "81189be30c472ca10e678e28ef6527d53f6c548c31ff6449e7d2f11d295d8ee4",
    8: "964b17a43caca6972f0cc262c19977414c34fb806da11f17f1112d6edf0ad933",
    9: "c20ffa4ddccf33df2c401d7832dc302716ed8e25e53ba256d778bd21bfc00603",
    10: "868b50e371c74af45469905c0c1bef8ca166ea57604a5f56e1d83e3f2da91516",
    11: "02aa5efc82ef59c2c269e7871153299c2476b43d06e01a7b9ec63aeb2d43f353",
    12: "592a2c4e1a8ccbdc6d8076b9c669e9c5f46cc10a03bab216f6bdef47e664427f",
    13: "2c0ad79dcbb107697f904e79112f68d43ddfc93999e68e7d5357d91ca678db23",
    14: "0f627d4b15a0310898e9fdbe8d4130f430d4fdba4060c01f53051e6cf23a878e",
    15: "f1261d83fc3c3bf254bae3573f86e0e35467a6126eb93da44fc2e846e28eabbf",
    16: "4fa3da89bfe29c6ffc86f9a46ae09f8659d586af31905cab6b628551449fa425",
    17: "120a09ace833d85ebd4850bfb96db3f80f5adc74f1958cd9af85e88430282603",
    18: "3429a49d4ab8651d21db42485013ecd2fbb6d03620dbb8d0ad4a90fdc08d1149",
    19: "b7c7f575cfeb99974ea486f3238d8c5a961505326bb01e0197e8ff64726f412d",
    20: "98f84cd01bf28ff9d30f3ecb6b6bc73ae9ce3001962018e29273e8f591aa668c",
    21: "5a8403d14c2dd2c1352d80f4c772979dc6fec9f95a44e04d98e6b16e8bf0fdf7",
    22: "6d2e688c0302ca8b881608f1ef621063c15efade83fb341e0adfffa83b0d014f",
    23: "b5c7c922e10ba59b23cda6ccd1479f70d22ec959174ab29f122e15926c7f299e",
}


class _TraceRunner(FakeRunner):
    """The FakeRunner, plus: a constrained request samples the token its bitmask row allows
    (rarely another, which its grammar refuses), and requests asking for logprobs or prompt
    logprobs get fake ones."""

    def __init__(self, scheduler, rng: random.Random) -> None:
        super().__init__(scheduler, sample=self._sample)
        self._rng = rng
        self._allowed: dict[str, int] = {}
        self._params: dict[str, tuple[int | None, int | None]] = {}
        self._prompt_done: set[str] = set()

    def _sample(self, req_id: str, num_outputs: int) -> int:
        rng = self._rng
        allowed = self._allowed.get(req_id)
        if allowed is not None and rng.random() < 0.95:
            return allowed
        r = rng.random()
        return EOS if r < 0.04 else 5 + int(r * 4)

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._allowed = dict(
            zip(
                so.structured_output_request_ids,
                np.frombuffer(so.grammar_bitmask, dtype="<i4").tolist(),
                strict=True,
            )
        )
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            self._params[new.req_id] = (params.logprobs, params.prompt_logprobs)
        out = super().execute(so)
        prompt_logprobs: dict[str, LogprobsLists] = {}
        for i, (req_id, sampled) in enumerate(zip(out.req_ids, out.sampled_token_ids)):
            logprobs, prompt_lps = self._params.get(req_id, (None, None))
            if sampled and logprobs is not None:
                out.logprobs[i] = LogprobsLists([[sampled[0]] * (logprobs + 1)], [[-0.5]], [1])
            if sampled and prompt_lps is not None and req_id not in self._prompt_done:
                self._prompt_done.add(req_id)
                prompt_logprobs[req_id] = LogprobsLists([[1, 2]], [[-1.0, -2.0]], [2])
        out.prompt_logprobs = prompt_logprobs
        return out


def _add_request(sched, rng: random.Random, i: int, pending: list[Future]) -> None:
    params: dict = {"max_tokens": rng.choice([None, rng.randint(1, 40)])}
    if rng.random() < 0.3:
        params["stop_token_ids"] = [rng.choice([6, 7])]
        params["min_tokens"] = rng.randint(0, params["max_tokens"] or 10)
    if rng.random() < 0.2:
        params["ignore_eos"] = True
    if rng.random() < 0.1:
        params["logprobs"] = rng.randint(0, 2)
    if rng.random() < 0.05:
        params["prompt_logprobs"] = 1
    prefix = rng.choice([[], list(range(500, 516)), list(range(600, 627)), list(range(500, 540))])
    prompt = prefix + [rng.randrange(10, 50) for _ in range(rng.randint(1, 30))]
    request = make_request(
        f"r{i}",
        prompt[: sched.max_model_len],
        arrival_time=float(i),
        priority=rng.randint(0, 3),
        cache_salt=rng.choice([None, None, None, "tenant"]),
        **params,
    )
    if rng.random() < 0.12:  # constrained: its grammar may still be compiling
        req = Request.from_engine_core_request(request, EOS, sched.block_hasher)
        grammar = FakeGrammar(ready=rng.random() < 0.6)
        if not grammar.ready:
            pending.append(grammar.compiled)
        req.grammar = grammar  # type: ignore[assignment]
        sched.structured_output = FakeManager()
        sched.add_request(req)
    else:
        sched.add_request(request)


def _trace_digest(seed: int, monkeypatch: pytest.MonkeyPatch) -> str:
    """The sha256 of one seeded workload's every SchedulerOutput and EngineCoreOutputs."""
    clock = [1000.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])  # prefill_chunks' times: the step
    rng = random.Random(seed)
    overlapped = seed % 2 == 1
    sched = make_scheduler(
        num_blocks=rng.choice([10, 16, 24, 80]),
        block_size=rng.choice([1, 8, 16]),
        max_num_seqs=rng.choice([2, 4, 8, 16]),
        max_num_batched_tokens=rng.choice([8, 24, 64, 128]),
        max_model_len=rng.choice([48, 96, 128]),
        enable_prefix_caching=seed % 3 != 2,
        policy="priority" if seed % 4 >= 2 else "fcfs",
        hash_algo=rng.choice(["sha256", "builtin"]),
        async_scheduling=overlapped,
    )
    runner = _TraceRunner(sched, random.Random(f"sample/{seed}"))
    digest = hashlib.sha256()
    in_flight: deque = deque()
    compiling: list[Future] = []
    for i in range(8000):
        clock[0] += 1.0
        if i < 250 and rng.random() < 0.4:
            _add_request(sched, rng, i, compiling)
        if compiling and rng.random() < 0.3:
            compiled = compiling.pop(rng.randrange(len(compiling)))
            if rng.random() < 0.1:
                compiled.set_exception(RuntimeError("compile failed"))
            else:
                compiled.set_result(None)
        if sched.requests and rng.random() < 0.04:
            victims = rng.sample(list(sched.requests), min(len(sched.requests), rng.randint(1, 2)))
            sched.finish_requests(victims, RequestStatus.FINISHED_ABORTED)
        work = sched.has_unfinished_requests() or sched.has_finished_requests()
        if i >= 250 and not work and not in_flight and not compiling:
            break
        if work and len(in_flight) < (2 if overlapped else 1):
            so = sched.schedule()
            digest.update(_encode(so))
            if so.total_num_scheduled_tokens or so.finished_req_ids or not in_flight:
                in_flight.append((so, runner.execute(so)))
                if overlapped and len(in_flight) == 1 and so.total_num_scheduled_tokens:
                    continue
        if not in_flight:
            continue
        so, out = in_flight.popleft()
        outputs = sched.update_from_output(so, out)
        digest.update(_encode(EngineCoreOutputs(outputs, sched.make_stats())))
        if not sched.waiting_for_grammar:  # (check_invariants counts no request aside)
            check_invariants(sched)
    assert not sched.has_unfinished_requests()
    return digest.hexdigest()


@pytest.mark.parametrize("seed", sorted(GOLDEN))
def test_trace_matches_golden(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _trace_digest(seed, monkeypatch) == GOLDEN[seed]
