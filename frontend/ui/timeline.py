"""The last requests' timelines, shared by every API server process of one `engine serve`.

Each API server observes the deltas of the requests it serves (TimelineClient wraps its
TokenizerClient) and, when a request ends, appends one JSON line to its own file in a directory
all API servers share (under the metrics directory the launcher creates); a reader merges every
process's file, so any API server answers with the same list. Texts go to a second file, read
only when someone opens a request.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from protocol.tokenizer import GenerateRequest, RequestDelta
from tokenizer_proc.client import TokenizerClient

# Output batches kept per request for the timeline's ticks (evenly thinned beyond this).
MAX_TICKS = 64


def _prompt_text(request: GenerateRequest) -> str:
    if request.prompt is not None:
        return request.prompt
    if request.messages is not None:
        lines = []
        for m in request.messages:
            content = m.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            lines.append(f"{m.get('role', '?')}: {content or ''}")
        return "\n".join(lines)
    return f"<{len(request.prompt_token_ids or ())} prompt token ids>"


class _Trace:
    """One request's timeline while it runs."""

    def __init__(self, request: GenerateRequest, api_server: int) -> None:
        self.request = request
        self.api_server = api_server
        self.arrival = request.arrival_time or time.time()
        self.first_token: float | None = None
        self.ticks: list[float] = []
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.output_tokens = 0
        self.prefill_chunks: list[tuple[float, int]] = []
        self.texts: dict[int, list[str]] = {}
        self.finish_reasons: dict[int, str] = {}

    def on_delta(self, delta: RequestDelta, now: float) -> None:
        if delta.num_prompt_tokens:
            self.prompt_tokens = delta.num_prompt_tokens
        if delta.num_cached_tokens:
            self.cached_tokens = delta.num_cached_tokens
        if delta.prefill_chunks and not self.prefill_chunks:  # n > 1: the first completion's
            self.prefill_chunks = delta.prefill_chunks
        if delta.token_ids:
            if self.first_token is None:
                self.first_token = now
            self.output_tokens += len(delta.token_ids)
            self.ticks.append(now)
        if delta.text:
            self.texts.setdefault(delta.index, []).append(delta.text)
        if delta.finish_reason is not None:
            self.finish_reasons[delta.index] = delta.finish_reason

    def record(self, finish: float, failed: str | None) -> dict[str, Any]:
        ticks = self.ticks
        if len(ticks) > MAX_TICKS:
            step = len(ticks) / MAX_TICKS
            ticks = [ticks[int(i * step)] for i in range(MAX_TICKS)]
        reasons = sorted(set(self.finish_reasons.values()))
        reason = failed or ("/".join(reasons) if reasons else "abort")
        return {
            "id": self.request.request_id,
            "api_server": self.api_server,
            "kind": "completion" if self.request.messages is None else "chat",
            "arrival": self.arrival,
            "first_token": self.first_token,
            "finish": finish,
            "ticks": [round(t - self.arrival, 6) for t in ticks],
            "prefill_chunks": [[round(t - self.arrival, 6), n] for t, n in self.prefill_chunks],
            "finish_reason": reason,
            "n": self.request.sampling_params.n,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "cached_tokens": self.cached_tokens,
        }


class RequestTimeline:
    """This process's finished requests, written where every API server reads them."""

    def __init__(self, directory: str | None, capacity: int = 100, text_limit: int = 8192) -> None:
        self.capacity = capacity
        self.text_limit = text_limit
        self.dir = Path(directory) if directory else None
        self._records: deque[dict[str, Any]] = deque(maxlen=capacity)
        self._texts: deque[dict[str, Any]] = deque(maxlen=capacity)
        self._lines = 0
        # path -> ((mtime_ns, size), its records): unchanged files are not parsed again.
        self._parsed: dict[Path, tuple[tuple[int, int], list[dict[str, Any]]]] = {}
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            pid = os.getpid()
            self._records_file = self.dir / f"requests-{pid}.jsonl"
            self._texts_file = self.dir / f"texts-{pid}.jsonl"

    def add(self, record: dict[str, Any], prompt: str, outputs: list[str]) -> None:
        """Keep a finished request's record and its texts (each cut at text_limit characters)."""
        text = {
            "id": record["id"],
            "prompt": prompt[: self.text_limit],
            "outputs": [o[: self.text_limit] for o in outputs],
        }
        self._records.append(record)
        self._texts.append(text)
        if self.dir is None:
            return
        self._lines += 1
        if self._lines > 2 * self.capacity:  # rewrite, so the files stay small
            self._rewrite(self._records_file, self._records)
            self._rewrite(self._texts_file, self._texts)
            self._lines = len(self._records)
        else:
            self._append(self._records_file, record)
            self._append(self._texts_file, text)

    @staticmethod
    def _append(path: Path, obj: dict[str, Any]) -> None:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(obj) + "\n")

    @staticmethod
    def _rewrite(path: Path, objs: deque[dict[str, Any]]) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(o) + "\n" for o in objs), encoding="utf-8")
        os.replace(tmp, path)

    def _read_all(self, prefix: str, local: deque[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.dir is None:
            return list(local)
        out = []
        for path in self.dir.glob(f"{prefix}-*.jsonl"):
            with contextlib.suppress(OSError):
                out.extend(self._read_file(path))
        return out

    def _read_file(self, path: Path) -> list[dict[str, Any]]:
        """The file's last `capacity` records, parsed again only when it has changed."""
        st = path.stat()
        key = (st.st_mtime_ns, st.st_size)
        cached = self._parsed.get(path)
        if cached is not None and cached[0] == key:
            return cached[1]
        records = []
        for line in path.read_text(encoding="utf-8").splitlines()[-self.capacity :]:
            with contextlib.suppress(ValueError):  # a line being written
                records.append(json.loads(line))
        self._parsed[path] = (key, records)
        return records

    def recent(self) -> list[dict[str, Any]]:
        """The last `capacity` finished requests of every API server, oldest first."""
        records = self._read_all("requests", self._records)
        records.sort(key=lambda r: r["finish"])
        return records[-self.capacity :]

    def texts(self, request_id: str) -> dict[str, Any] | None:
        """A recent request's prompt and output texts, None when it is not kept."""
        found = None
        for t in self._read_all("texts", self._texts):
            if t.get("id") == request_id:
                found = t
        return found


class TimelineClient:
    """A TokenizerClient that also records each request's timeline in a RequestTimeline."""

    def __init__(self, client: TokenizerClient, timeline: RequestTimeline, api_server: int) -> None:
        self._client = client
        self._timeline = timeline
        self._api_server = api_server

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestDelta]:
        trace = _Trace(request, self._api_server)
        failed: str | None = "abort"  # unless the stream runs to its end
        gen = self._client.generate(request)
        try:
            async with contextlib.aclosing(gen):
                async for delta in gen:
                    trace.on_delta(delta, time.time())
                    yield delta
            failed = None
        except Exception:
            failed = "error"
            raise
        finally:
            outputs = ["".join(trace.texts.get(i, ())) for i in range(request.sampling_params.n)]
            self._timeline.add(trace.record(time.time(), failed), _prompt_text(request), outputs)
