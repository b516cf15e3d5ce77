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

# sha256 of each seed's trace, recorded from the scheduler at 305660f.
GOLDEN = {
    0: "3d40dffaab69f8188f61929f0b02973813534f231fb83693960ea719c9a881ef",
    1: "e0c71f60e263f1987e095d131c98d2d77fc24d8c314059bbffe963779f9a4e39",
    2: "ec9d6ee9910b6408918b620623ca391459ccde0971e05c33a3b27b64190f835c",
    3: "adbf26e1114de016b536841b644bee913967b3da0122a4a3a3bc0bfbc5d36cc3",
    4: "dc6b019e8c8b9540c20ec01149089fa7b8c7a05f2729c530fa7a4137829a9d51",
    5: "19ea2d159517933c45838d691fe2abcca8b5a2a0376744444c90b3754772d6ab",
    6: "45809954bf3d8aee128eecc0fbb077b152fde3fdde6129b5ccc23d74d239771d",
    7: "a46fa22fa658128e9d68878c86b9d9012d6d74343da91f62c5685a44279c3e24",
    8: "6392a32b37adeb8f5e4e223d971cb834628afe413b1bda006f4f18320994392c",
    9: "79eee4908465f546fed03e7e73446f63b3e8712b39ca16613dbf43d62f233ac6",
    10: "d781d7a0c3cee893dde90f18b9c1cca1cd6015c0c1109bfa12ce5fdc77db6a05",
    11: "8ff318dfbcfbed7fdd09888a6652162ddc98480266c5a08ec00e05c091dea771",
    12: "082af794e64963734cb52a13e418955fc78f66965ab2302e6f7ba96d6501e780",
    13: "f90a5b0f5d7e7c91c5c0e370978909558b7d87b06926dbd4a907a279cc644977",
    14: "af715a1286e42aefa4b2f483d3570326c057d560b729c605980eb6899e9d9024",
    15: "cee4a57e3ed02df63bfd9e3a099b368acef6779e9245488af6772e8d3df7dfcb",
    16: "9044c91f31f94b6190d7d9a1a346873846e0fe305cf93f60c819c8ebee6b6f11",
    17: "2f996188ef47fbde63b107a035f1bfb551a07ef85c3868d235a2b6cec88454ea",
    18: "b90acd18ffea26f4d5d910a2fb513c20ba78107e8fe131bebefb5f7ec641b4c0",
    19: "0bc08df981bafdd211fe0acc42a9ea02202754510dd8c2a89c9f2cf84e5cdc0c",
    20: "72e7945cd67183c459029f7e3f437b0ab007d50a041f745635f4da1579687887",
    21: "1f5613d134d446c77fbf4d3f48e84b2d3f9f2ccb0663cb6b8dafcc603a7074f8",
    22: "ef3af84ca0e2ee7b50029d2efd5dd047f467b76c084d75b024e04a1ca446941d",
    23: "fcc01aee19bf5ef8d296bb67f264155db7ac3b3076b03c1d03339439cd421302",
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
