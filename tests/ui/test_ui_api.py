"""The page's data endpoints without a browser: JSON shape, the API key, the numbers of /metrics,
one view across API server processes, and --disable-ui."""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse

from tests.serve.conftest import Server, wait_until
from tests.ui.conftest import API_KEY, MODEL, get, metrics_now


def _json(url: str, key: str | None = API_KEY) -> dict:
    status, _, body = get(url, key)
    assert status == 200, body
    return json.loads(body)


def test_page_is_open_and_data_needs_the_key(ui_server):
    url = ui_server.api_url
    for path in ("/", "/ui", "/ui/app.js", "/ui/app.css"):
        status, headers, body = get(url + path, key=None)
        assert status == 200 and body, path
    status, headers, body = get(url + "/", key=None)
    assert headers["Content-Type"].startswith("text/html") and b"ui/app.js" in body
    for path in ("/ui/api/stats", "/ui/api/requests", "/ui/api/requests/x"):
        assert get(url + path, key=None)[0] == 401, path
        assert get(url + path, key="wrong")[0] == 401, path
    assert get(url + "/ui/api/nothing")[0] == 404
    assert get(url + "/ui/api/requests/no-such-id")[0] == 404


def test_stats_shape_and_numbers_equal_metrics(ui_server):
    url = ui_server.api_url
    status, _, body = get(
        url + "/v1/completions", body={"model": MODEL, "prompt": "a b c d e f", "max_tokens": 5}
    )
    assert status == 200, body
    # Idle now: gauges settle at 0 once the engine reports the step after the request.
    assert wait_until(lambda: metrics_now(url).get("vllm:num_requests_running", 1) == 0, 10)
    # The live view is at most a second old: wait for one computed after the engine went idle.
    idle_at = time.time()
    answers = []  # each API server has its own: wait for one computed since
    assert wait_until(
        lambda: answers.append(_json(url + "/ui/api/stats")) or answers[-1]["time"] > idle_at, 10
    )
    stats = answers[-1]
    prom = metrics_now(url)
    m = stats["metrics"]
    assert m["running"] == prom["vllm:num_requests_running"]
    assert m["waiting"] == prom["vllm:num_requests_waiting"]
    assert m["kv_cache_usage"] == prom["vllm:kv_cache_usage_perc"]
    for key, name in (
        ("prompt_tokens", "vllm:prompt_tokens_total"),
        ("generation_tokens", "vllm:generation_tokens_total"),
        ("prefix_cache_queries", "vllm:prefix_cache_queries_total"),
        ("prefix_cache_hits", "vllm:prefix_cache_hits_total"),
        ("preemptions", "vllm:num_preemptions_total"),
        ("requests_finished", "vllm:request_success_total"),
    ):
        assert m[key] == prom.get(name, 0.0), key
    assert m["generation_tokens"] >= 5 and m["requests_finished"] >= 1
    for key, name in (
        ("ttft", "vllm:time_to_first_token_seconds"),
        ("itl", "vllm:inter_token_latency_seconds"),
    ):
        h = m[key]
        assert h["count"] == prom[name + "_count"] and h["sum"] == prom[name + "_sum"]
        assert h["le"] == sorted(h["le"]) and len(h["le"]) == len(h["cumulative"])
        assert h["cumulative"] == sorted(h["cumulative"]) and h["cumulative"][-1] <= h["count"]
    cfg = stats["config"]
    assert cfg["model"] == MODEL and cfg["max_model_len"] == 256 and cfg["block_size"] == 16
    assert cfg["num_kv_blocks"] > 0 and cfg["device"] == "cpu" and cfg["dtype"] == "float32"
    assert cfg["tensor_parallel_size"] == 1 and cfg["tokenizer_workers"] == 1
    procs = stats["processes"]
    assert procs[0]["role"] == "launcher" and procs[0]["pid"] == ui_server.proc.pid
    roles = sorted(p["role"] for p in procs[1:])
    assert roles == ["API server", "API server", "engine core", "tokenizer"], procs
    children = ui_server.children()
    assert {p["pid"]: p["name"] for p in procs[1:]} == children
    assert all(p["alive"] for p in procs)


def test_stats_answer_is_shared_for_a_second(ui_server):
    """Pollers within a second get the same computed answer; a second later, a new one."""
    parsed = urllib.parse.urlsplit(ui_server.api_url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=60)
    headers = {"Authorization": f"Bearer {API_KEY}"}

    def stats_time() -> tuple[str, float]:  # one connection: always the same API server
        conn.request("GET", "/ui/api/stats", headers=headers)
        resp = conn.getresponse()
        body = json.loads(resp.read())
        assert resp.status == 200, body
        return resp.getheader("X-Engine-Api-Server"), body["time"]

    try:
        server, first = stats_time()
        t0 = time.monotonic()
        again = stats_time()
        if time.monotonic() - t0 < 0.5:  # else the box was too slow to tell
            assert again == (server, first)
        time.sleep(1.1)
        later = stats_time()
        assert later[0] == server and later[1] > first
    finally:
        conn.close()


def test_requests_after(ui_server):
    url = ui_server.api_url
    for i in range(2):
        status, _, body = get(
            url + "/v1/completions",
            body={"model": MODEL, "max_tokens": 2, "prompt": f"after test {i}"},
        )
        assert status == 200, body
    records = _json(url + "/ui/api/requests")["requests"]
    assert len(records) >= 2
    cut = records[-2]["finish"]
    newer = _json(url + f"/ui/api/requests?after={cut}")["requests"]
    assert newer == [r for r in records if r["finish"] > cut] and newer
    assert _json(url + f"/ui/api/requests?after={records[-1]['finish']}")["requests"] == []
    status, _, body = get(url + "/ui/api/requests?after=yesterday")
    assert status == 400 and b"after must be" in body


def test_request_timeline_is_one_view_across_api_servers(ui_server):
    url = ui_server.api_url
    prompt = "the timeline test prompt"
    status, _, body = get(
        url + "/v1/completions", body={"model": MODEL, "prompt": prompt, "max_tokens": 6, "n": 2}
    )
    assert status == 200, body
    choices = json.loads(body)["choices"]
    seen: dict[str, list] = {}
    # Connections spread over both API servers (one shared socket); each lists the same requests.
    for _ in range(40):
        status, headers, body = get(url + "/ui/api/requests")
        seen.setdefault(headers["X-Engine-Api-Server"], json.loads(body)["requests"])
        if len(seen) == 2:
            break
    assert len(seen) == 2, "the kernel sent every connection to one API server"
    lists = list(seen.values())
    assert lists[0] == lists[1]
    rec = lists[0][-1]
    assert rec["kind"] == "completion" and rec["finish_reason"] == "length" and rec["n"] == 2
    assert rec["output_tokens"] == 12 and rec["prompt_tokens"] > 0
    assert rec["arrival"] <= rec["first_token"] <= rec["finish"]
    assert len(rec["ticks"]) >= 6 and rec["ticks"] == sorted(rec["ticks"])
    assert 0 <= rec["cached_tokens"] <= rec["prompt_tokens"]
    # When the engine core scheduled the prompt (one host, one clock): after arrival, before
    # the first token; a short prompt is one chunk.
    ((queued, prefilled),) = rec["prefill_chunks"]
    assert 0 <= queued <= rec["first_token"] - rec["arrival"]
    assert prefilled == rec["prompt_tokens"] - rec["cached_tokens"]
    text = _json(url + "/ui/api/requests/" + rec["id"])
    assert text["prompt"] == prompt
    assert sorted(text["outputs"]) == sorted(c["text"] for c in choices)


def test_disable_ui(tiny_args):
    srv = Server([*tiny_args, "--disable-ui"])
    try:
        assert srv.ready, srv.stderr
        for path in ("/", "/ui", "/ui/app.js", "/ui/api/stats", "/ui/api/requests"):
            status, _, body = get(srv.api_url + path, key=None)
            assert status == 404, path
            assert "no route" in json.loads(body)["error"]["message"]
        assert get(srv.api_url + "/health", key=None)[0] == 200
    finally:
        assert srv.stop() == 0, srv.stderr
