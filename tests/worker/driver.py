"""A minimal step driver for model-runner tests: allocates blocks and builds SchedulerOutputs.

Not the engine's scheduler: it only feeds the runner the way a scheduler would, so the runner
can be tested alone (one request at a time, all together, prompts in chunks).
"""

from __future__ import annotations

from gpu_worker.model_runner import ModelRunner
from protocol.sampling_params import SamplingParams
from protocol.step import CachedRequestData, NewRequestData, SchedulerOutput


class StepDriver:
    def __init__(self, runner: ModelRunner, num_blocks: int, block_size: int) -> None:
        self.runner, self.block_size = runner, block_size
        self.free = list(range(num_blocks))
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.tokens: dict[str, int] = {}
        self.outputs: dict[str, list[int]] = {}
        self.logprobs: dict[str, list] = {}
        self.prompt_logprobs: dict[str, object] = {}

    def _grow(self, req_id: str, upto: int) -> list[int]:
        need = -(-upto // self.block_size) - len(self.blocks[req_id])
        new = [self.free.pop(0) for _ in range(max(0, need))]
        self.blocks[req_id].extend(new)
        return new

    def run(
        self,
        prompts: dict[str, list[int]],
        params: SamplingParams,
        max_new: int,
        chunk: int | None = None,
        rope_long: bool = False,
    ) -> dict[str, list[int]]:
        """Generate max_new tokens for every prompt, at most `chunk` prompt tokens per step;
        rope_long: every request turns with LongRoPE's long factors (the engine core's choice
        for a request beyond the original context)."""
        new_reqs = []
        for req_id, prompt in prompts.items():
            self.blocks[req_id], self.computed[req_id] = [], 0
            self.tokens[req_id], self.outputs[req_id], self.logprobs[req_id] = len(prompt), [], []
        pending = dict(prompts)
        while any(len(self.outputs[r]) < max_new for r in prompts):
            num_sched, cached = {}, CachedRequestData()
            new_reqs = []
            for req_id in prompts:
                if len(self.outputs[req_id]) >= max_new:
                    continue
                todo = self.tokens[req_id] - self.computed[req_id]
                n = todo if chunk is None else min(todo, chunk)
                new_blocks = self._grow(req_id, self.computed[req_id] + n)
                if req_id in pending:
                    new_reqs.append(
                        NewRequestData(
                            req_id,
                            pending.pop(req_id),
                            params,
                            list(self.blocks[req_id]),
                            0,
                            rope_long=rope_long,
                        )
                    )
                else:
                    cached.req_ids.append(req_id)
                    cached.new_block_ids.append(new_blocks)
                    cached.num_computed_tokens.append(self.computed[req_id])
                num_sched[req_id] = n
            finished = [r for r in prompts if len(self.outputs[r]) >= max_new and r in self.blocks]
            out = self.runner.execute_model(
                SchedulerOutput(
                    scheduled_new_reqs=new_reqs,
                    scheduled_cached_reqs=cached,
                    num_scheduled_tokens=num_sched,
                    total_num_scheduled_tokens=sum(num_sched.values()),
                    finished_req_ids=finished,
                )
            )
            for r in finished:
                self.free.extend(self.blocks.pop(r))
            for req_id, sampled, lp in zip(out.req_ids, out.sampled_token_ids, out.logprobs):
                self.computed[req_id] += num_sched[req_id]
                if sampled:
                    self.outputs[req_id].extend(sampled)
                    self.tokens[req_id] += len(sampled)
                    self.logprobs[req_id].append(lp)
            self.prompt_logprobs.update(out.prompt_logprobs)
        self.runner.execute_model(SchedulerOutput(finished_req_ids=list(self.blocks)))
        for r in list(self.blocks):
            self.free.extend(self.blocks.pop(r))
        return {r: self.outputs[r] for r in prompts}
