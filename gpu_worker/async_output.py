"""A step's results on their way to the host.

The sampled ids and logprobs are copied to pinned host memory on a side stream, after the step's
kernels, and an event marks the copy done; get_output() is the only place that waits, and the
engine core calls it only when it needs the step (one step later under async scheduling). On
the CPU the tensors already are host memory and nothing waits.
"""

from __future__ import annotations

import numpy as np
import torch

from gpu_worker.sampler import LogprobsTensors
from protocol.step import LogprobsLists, ModelRunnerOutput


class DeviceToHost:
    """Copies a step's result tensors to the host on one side stream, in step order."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def start(
        self, tensors: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
        """Host copies of tensors (filled once the event fires) and that event."""
        if self.stream is None:
            return tensors, None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        event = torch.cuda.Event()
        with torch.cuda.stream(self.stream):
            host = []
            for t in tensors:
                t.record_stream(self.stream)  # keep it alive until the copy has read it
                host.append(t.to("cpu", non_blocking=True))  # pinned, from torch's host cache
            event.record(self.stream)
        return host, event


class AsyncOutput:
    """What one step produced; get_output() waits for its copy and builds the message."""

    def __init__(
        self,
        d2h: DeviceToHost,
        req_ids: list[str],
        sample_rows: np.ndarray,
        sampled: torch.Tensor | None,
        logprobs: LogprobsTensors | None,
        num_logprobs: np.ndarray,
        prompt_chunks: list[LogprobsTensors],
        verify_starts: np.ndarray | None = None,
        drafts: torch.Tensor | None = None,
    ) -> None:
        """sampled: a token per sampling row [S], or with speculative decoding each row's
        tokens [S, K + 1] padded with -1, whose logprobs rows start at verify_starts[j];
        drafts [S, K] (-1 padded): the proposals for each sampling row's next step."""
        self._req_ids = req_ids
        self._sample_rows = sample_rows
        self._num_logprobs = num_logprobs  # per sampling row: K asked, -1 all, -2 none
        self._verify_starts = verify_starts
        tensors: list[torch.Tensor] = [] if sampled is None else [sampled]
        if logprobs is not None:
            tensors.extend(logprobs)
        for chunk in prompt_chunks:
            tensors.extend(chunk)
        if drafts is not None:
            tensors.append(drafts)
        host, self._event = d2h.start(tensors)
        self._drafts = host.pop() if drafts is not None else None
        self._sampled = host[0] if sampled is not None else None
        self._logprobs = LogprobsTensors(*host[1:4]) if logprobs is not None else None
        start = (sampled is not None) + 3 * (logprobs is not None)
        #: host copies of prompt_chunks, in order; valid once this output is ready
        self.prompt_chunks = [LogprobsTensors(*host[i : i + 3]) for i in range(start, len(host), 3)]
        #: request -> its prompt logprobs, complete with this step (set by the runner)
        self.prompt_logprobs: dict[str, tuple[list[LogprobsTensors], int]] = {}

    def ready(self) -> bool:
        """True once get_output() would not wait."""
        return self._event is None or self._event.query()

    def get_output(self) -> ModelRunnerOutput:
        """Wait for the copy, then the output in the order of the step's requests."""
        if self._event is not None:
            self._event.synchronize()
        logprob_lists: list[LogprobsLists | None] = [None] * len(self._req_ids)
        if self._verify_starts is not None:
            return self._verified_output(logprob_lists)
        tokens = self._sampled.tolist() if self._sampled is not None else []
        if len(tokens) == len(self._req_ids):  # every row sampled (all decodes)
            sampled_lists = list(map(list, zip(tokens)))  # [[token], ...] at C speed
        else:
            sampled_lists = [[] for _ in self._req_ids]
            for row, token in zip(self._sample_rows.tolist(), tokens):
                sampled_lists[row] = [token]
        if self._logprobs is not None:  # only with sampled tokens
            lp = _to_lists(self._logprobs)
            for j, (row, k) in enumerate(
                zip(self._sample_rows.tolist(), self._num_logprobs.tolist())
            ):
                if k != -2:
                    ids, lps, rank = _one_position(lp, j, k)
                    logprob_lists[row] = LogprobsLists([ids], [lps], [rank])
        return self._message(sampled_lists, logprob_lists)

    def _verified_output(self, logprob_lists: list[LogprobsLists | None]) -> ModelRunnerOutput:
        """A speculative step's output: each sampling row's kept tokens (-1 ends them), their
        logprobs from its verification rows, and the drafts for its next step."""
        assert self._sampled is not None and self._verify_starts is not None
        sampled_lists: list[list[int]] = [[] for _ in self._req_ids]
        rows = self._sample_rows.tolist()
        for row, tokens in zip(rows, self._sampled.tolist()):
            sampled_lists[row] = tokens[: tokens.index(-1)] if -1 in tokens else tokens
        if self._logprobs is not None:
            lp = _to_lists(self._logprobs)
            for row, k, start in zip(
                rows, self._num_logprobs.tolist(), self._verify_starts.tolist()
            ):
                if k != -2:
                    kept = [_one_position(lp, start + j, k) for j in range(len(sampled_lists[row]))]
                    logprob_lists[row] = LogprobsLists(
                        [p[0] for p in kept], [p[1] for p in kept], [p[2] for p in kept]
                    )
        return self._message(sampled_lists, logprob_lists)

    def _message(
        self, sampled_lists: list[list[int]], logprob_lists: list[LogprobsLists | None]
    ) -> ModelRunnerOutput:
        prompt = {}
        for req_id, (chunks, k) in self.prompt_logprobs.items():
            ids: list[list[int]] = []
            lps: list[list[float]] = []
            ranks: list[int] = []
            for chunk in chunks:
                lp = _to_lists(chunk)
                for j in range(len(lp[2])):
                    i, v, r = _one_position(lp, j, k)
                    ids.append(i)
                    lps.append(v)
                    ranks.append(r)
            prompt[req_id] = LogprobsLists(ids, lps, ranks)
        spec_token_ids: list[list[int]] = []
        if self._drafts is not None:
            spec_token_ids = [[] for _ in self._req_ids]
            for row, drafts in zip(self._sample_rows.tolist(), self._drafts.tolist()):
                spec_token_ids[row] = drafts[: drafts.index(-1)] if -1 in drafts else drafts
        return ModelRunnerOutput(
            req_ids=self._req_ids,
            sampled_token_ids=sampled_lists,
            logprobs=logprob_lists,
            prompt_logprobs=prompt,
            spec_token_ids=spec_token_ids,
        )


class ReadyOutput:
    """An output known without the device (a step that computed nothing)."""

    def __init__(self, output: ModelRunnerOutput) -> None:
        self._output = output

    def ready(self) -> bool:
        return True

    def get_output(self) -> ModelRunnerOutput:
        return self._output


_Lists = tuple[list[list[int]], list[list[float]], list[int]]


def _to_lists(t: LogprobsTensors) -> _Lists:
    return t.token_ids.tolist(), t.logprobs.tolist(), t.ranks.tolist()


def _one_position(lp: _Lists, j: int, k: int) -> tuple[list[int], list[float], int]:
    """Row j as [sampled or prompt token, top-1..top-k]; k == -1 keeps every column."""
    width = len(lp[0][j]) if k == -1 else k + 1
    return lp[0][j][:width], lp[1][j][:width], lp[2][j]
