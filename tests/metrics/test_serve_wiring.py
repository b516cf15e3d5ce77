"""`engine serve`: the engine core and tokenizer processes record into the launcher's metrics
directory, and an API server's GET /metrics shows their exact values in one view."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from protocol.sampling_params import SamplingParams
from protocol.tokenizer import GenerateRequest
from tests.serve.conftest import Server, tiny_args, tiny_model  # noqa: F401 (fixtures)
from tokenizer_proc.client import BlockingTokenizerClient


def test_processes_record_into_the_metrics_dir(tiny_args) -> None:
    server = Server([*tiny_args, "--served-model-name", "tiny"])
    assert server.ready, server.stderr
    client = BlockingTokenizerClient(server.tokenizer_addresses)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        client.generate(GenerateRequest("m1", params, prompt_token_ids=[5, 6, 7, 8]), timeout=60)
        with urllib.request.urlopen(server.api_url + "/metrics", timeout=30) as resp:
            body = resp.read()
    finally:
        client.close()
        assert server.stop() == 0, server.stderr
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(body.decode())
        for s in f.samples
    }
    model = (("engine", "0"), ("model_name", "tiny"))

    def reason(r: str) -> tuple[tuple[str, str], ...]:  # label pairs in sorted order
        return (model[0], ("finished_reason", r), model[1])

    assert samples[("vllm:prompt_tokens_total", model)] == 4
    assert samples[("vllm:generation_tokens_total", model)] == 5
    assert samples[("vllm:request_success_total", reason("length"))] == 1
    assert samples[("vllm:request_generation_tokens_sum", model)] == 5
    assert samples[("vllm:time_to_first_token_seconds_count", model)] == 1
    assert samples[("vllm:inter_token_latency_seconds_count", model)] == 4
