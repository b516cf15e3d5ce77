"""Fixtures: `engine serve` as a child process, and a tiny random model with a real tokenizer."""

from __future__ import annotations

import http.client
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.tiny_models import make_tiny_model_with_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class Server:
    """A running `engine serve`: its process, addresses and captured output."""

    def __init__(
        self,
        args: list[str],
        timeout: float = 120.0,
        wait: bool = True,
        env: dict[str, str] | None = None,
    ) -> None:
        """Start it; wait: until it is ready (else call wait_ready). env: added variables."""
        if "--port" not in args:  # a free port, so servers never collide
            args = [*args, "--port", "0"]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "serve.cli", "serve", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        )
        self.stdout: queue.Queue[str | None] = queue.Queue()
        self.stderr_lines: list[str] = []
        threading.Thread(
            target=self._pump, args=(self.proc.stdout, self.stdout.put), daemon=True
        ).start()
        threading.Thread(
            target=self._pump, args=(self.proc.stderr, self.stderr_lines.append), daemon=True
        ).start()
        self.core_address = ""
        self.tokenizer_addresses: list[str] = []
        self.api_url = ""  # http://host:port of the API servers, when there are any
        self.ready = self.wait_ready(timeout) if wait else False

    @staticmethod
    def _pump(stream, sink) -> None:
        for line in stream:
            sink(line)
        sink(None)

    def wait_ready(self, timeout: float = 120.0) -> bool:
        """Read its output until `engine serve: ready` (True) or its exit (False)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.stdout.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(
                    f"engine serve not ready in {timeout} s: {self.stderr}"
                ) from None
            if line is None:
                return False  # exited during start-up
            if m := re.match(r"engine core listening on (\S+):", line):
                self.core_address = m.group(1)
            if m := re.match(r"tokenizer \d+ listening on (\S+)", line):
                self.tokenizer_addresses.append(m.group(1))
            if m := re.match(r"API servers? \(\d+\) listening on (\S+)", line):
                self.api_url = m.group(1)
            if line.startswith("engine serve: ready"):
                return True

    @property
    def stderr(self) -> str:
        return "".join(line for line in self.stderr_lines if line)

    def child(self, name: str) -> int:
        """The pid of the live child called name (/proc/<pid>/comm)."""
        return next(pid for pid, comm in self.children().items() if comm == name)

    def children(self) -> dict[int, str]:
        """pid -> /proc/<pid>/comm of each live child of the launcher."""
        found = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                if ppid == self.proc.pid:
                    found[int(entry)] = Path(f"/proc/{entry}/comm").read_text().strip()
            except (OSError, ValueError, IndexError):
                continue
        return found

    def stop(self) -> int:
        """SIGTERM the launcher and return its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


def pid_gone(pid: int) -> bool:
    """True when pid no longer runs (a zombie counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def kill_mid_generation(server: Server, pid: int) -> Exception:
    """Start a long request, SIGKILL pid once it streams, and return the error the request
    ends with (AssertionError if it ends without one)."""
    from protocol.sampling_params import SamplingParams
    from protocol.tokenizer import GenerateRequest
    from tokenizer_proc.client import BlockingTokenizerClient, TokenizerRequestError

    client = BlockingTokenizerClient(server.tokenizer_addresses)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        client.send(GenerateRequest("doomed", params, prompt="Hello"))
        next(client.deltas("doomed"))
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(TokenizerRequestError) as err:
            list(client.deltas("doomed", timeout=20))
        return err.value
    finally:
        client.close()


def wait_until(condition, timeout: float = 10.0) -> bool:
    """Poll condition() until it is true or timeout seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random llama with the default model's tokenizer (so vocab_size is 49152)."""
    return make_tiny_model_with_tokenizer(tmp_path_factory.mktemp("serve") / "tiny")


@pytest.fixture
def tiny_args(tiny_model) -> list[str]:
    """Engine flags for the tiny model on the CPU."""
    return [
        "--model",
        str(tiny_model),
        "--device",
        "cpu",
        "--kv-cache-memory",
        "16MiB",
        "--max-model-len",
        "256",
    ]


class SseStream:
    """A streaming HTTP request to the API servers, read event by event."""

    def __init__(self, server: Server, path: str, body: dict) -> None:
        url = urlsplit(server.api_url)
        self.conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
        self.conn.request(
            "POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"}
        )
        self.response = self.conn.getresponse()
        assert self.response.status == 200, self.response.read()
        # Which API server answered (its --index).
        self.api_server = int(self.response.getheader("X-Engine-Api-Server"))

    def next_event(self) -> str | None:
        """The next event's data (`[DONE]` last), or None when the stream ends without one."""
        while True:
            line = self.response.readline()
            if not line:
                return None
            if line.startswith(b"data: "):
                return line[len(b"data: ") :].decode().strip()

    def rest(self) -> list[str]:
        """The events left, up to the end of the stream."""
        events = []
        while (event := self.next_event()) is not None:
            events.append(event)
        return events

    def close(self) -> None:
        self.conn.close()


def http_request(
    server: Server, method: str, path: str, body: dict | None = None
) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one request to the API servers; ConnectionError if refused."""
    url = urlsplit(server.api_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        conn.request(
            method,
            path,
            None if body is None else json.dumps(body),
            {"Content-Type": "application/json"},
        )
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


# A completion that runs until its engine core is stopped or the request is cut.
LONG_COMPLETION = {"prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "temperature": 0.0}
