"""The Node.js client (clients/node) against `engine core --listen`: the Python client's tokens."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from engine_core.client import EngineCoreClient
from tests.engine_core_proc.utils import PROMPTS, collect, greedy_request

NODE_CLIENT = Path(__file__).resolve().parents[2] / "clients" / "node"


def _skip_reason() -> str | None:
    if shutil.which("node") is None:
        return "node is not installed"
    for package in ("zeromq", "@msgpack/msgpack"):
        if not (NODE_CLIENT / "node_modules" / package).is_dir():
            return f"npm package {package} is missing: run `npm ci` in clients/node"
    return None


@pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")
@pytest.mark.parametrize("prompt", [PROMPTS[0], PROMPTS[3]])
def test_node_client_streams_the_same_tokens(address, prompt):
    with EngineCoreClient(address) as client:
        client.add_request(greedy_request("py-ref", prompt, max_tokens=10))
        expected, _ = collect(client, {"py-ref"})["py-ref"]
    run = subprocess.run(
        ["node", str(NODE_CLIENT / "generate.mjs"), "--address", address, "--max-tokens", "10",
         "--ignore-eos", *map(str, prompt)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert [int(line) for line in run.stdout.split()] == expected
    assert "finish_reason: length" in run.stderr
