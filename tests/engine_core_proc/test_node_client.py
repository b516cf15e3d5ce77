"""The Node.js client (clients/node) against `engine core --listen`: the Python client's tokens."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from engine_core.client import EngineCoreClient
from protocol.engine_core import EngineCoreRequest
from protocol.sampling_params import SamplingParams
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
        [
            "node",
            str(NODE_CLIENT / "generate.mjs"),
            "--address",
            address,
            "--max-tokens",
            "10",
            "--ignore-eos",
            *map(str, prompt),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert [int(line) for line in run.stdout.split()] == expected
    assert "finish_reason: length" in run.stderr


@pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")
def test_node_client_decodes_logprob_array_frames(engine_args):
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=3, logprobs=-1)
    with EngineCoreClient(engine_args={**engine_args, "max_logprobs": -1}) as client:
        client.add_request(EngineCoreRequest("py-lp", PROMPTS[0], params))
        expected = []
        while not expected or not expected[-1].finished:
            expected += client.get_output().outputs
        run = subprocess.run(
            [
                "node",
                str(NODE_CLIENT / "generate.mjs"),
                "--address",
                client.address,
                "--max-tokens",
                "3",
                "--ignore-eos",
                "--logprobs=-1",
                *map(str, PROMPTS[0]),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert run.returncode == 0, run.stderr
    lines = [line.split() for line in run.stdout.splitlines()]
    assert [int(token) for token, _, _ in lines] == [o.new_token_ids[0] for o in expected]
    for (_, logprob, width), out in zip(lines, expected):
        assert isinstance(out.new_logprobs.logprobs, np.ndarray), "should travel as a frame"
        assert float(logprob) == pytest.approx(float(out.new_logprobs.logprobs[0][0]), abs=1e-6)
        assert int(width) == out.new_logprobs.token_ids.shape[1]
