"""The OpenAI-compatible API of `engine serve` (tiny random model), through the official
`openai` client: completions, chat, streaming, n, logprobs, echo, stop, seed, errors, models,
health and tokenize."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from tests.api.conftest import API_KEY, MAX_BODY, MODEL

PROMPT = "The capital of France is"
MESSAGES = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "Name a color."},
]
GREEDY = dict(temperature=0.0, max_tokens=8, extra_body={"ignore_eos": True})


def _http(
    server, method: str, path: str, body=None, key: str | None = API_KEY, raw: bytes | None = None
) -> tuple[int, dict | None]:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(server.api_url + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            text = resp.read()
            return resp.status, json.loads(text) if text else None
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# ---- discovery ----


def test_health_version_models(server, client):
    assert _http(server, "GET", "/health", key=None) == (200, None)
    status, body = _http(server, "GET", "/version", key=None)
    assert status == 200 and body["version"]
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].max_model_len == 256
    status, body = _http(server, "GET", "/openapi.json")
    assert status == 200 and "/v1/chat/completions" in body["paths"]


def test_tokenize_round_trip(server):
    status, body = _http(
        server, "POST", "/tokenize", {"model": MODEL, "prompt": PROMPT, "return_token_strs": True}
    )
    assert status == 200 and body["count"] == len(body["tokens"]) == len(body["token_strs"])
    assert body["max_model_len"] == 256
    status, back = _http(server, "POST", "/detokenize", {"model": MODEL, "tokens": body["tokens"]})
    assert status == 200 and back["prompt"] == PROMPT
    status, chat = _http(server, "POST", "/tokenize", {"messages": MESSAGES})
    assert status == 200 and chat["count"] > body["count"]


# ---- completions ----


def test_completion(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY)
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert len(out.choices) == 1 and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8


def test_completion_streaming_equals_non_streaming(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert len({c.id for c in chunks}) == 1
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_list_of_prompts(client):
    text = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY).choices[0].text
    out = client.completions.create(model=MODEL, prompt=[PROMPT, "Hello"], n=2, **GREEDY)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]  # prompt index * n + i
    assert out.choices[0].text == out.choices[1].text == text
    assert out.usage.completion_tokens == 32


def test_token_id_prompts(server, client):
    _, tok = _http(server, "POST", "/tokenize", {"prompt": PROMPT})
    text = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY).choices[0].text
    one = client.completions.create(model=MODEL, prompt=tok["tokens"], **GREEDY)
    assert one.choices[0].text == text
    two = client.completions.create(model=MODEL, prompt=[tok["tokens"], tok["tokens"]], **GREEDY)
    assert [c.text for c in two.choices] == [text, text]
    assert two.usage.prompt_tokens == 2 * tok["count"]


def test_n(client):
    out = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        n=3,
        temperature=1.0,
        seed=7,
        max_tokens=6,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == 18
    assert len({c.text for c in out.choices}) > 1
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            n=3,
            temperature=1.0,
            seed=7,
            max_tokens=6,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    streamed = {
        i: "".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(3)
    }
    assert streamed == {c.index: c.text for c in out.choices}


def test_seed(client):
    kwargs = dict(
        model=MODEL, prompt=PROMPT, temperature=1.0, max_tokens=8, extra_body={"ignore_eos": True}
    )
    a = client.completions.create(seed=1234, **kwargs).choices[0].text
    b = client.completions.create(seed=1234, **kwargs).choices[0].text
    assert a == b


def test_completion_logprobs(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and top[token] == logprob and 3 <= len(top) <= 4
        assert logprob == max(top.values())  # greedy: the sampled token is the likeliest


def test_echo(server, client):
    _, tok = _http(server, "POST", "/tokenize", {"prompt": PROMPT})
    plain = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY).choices[0].text
    out = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=1, **GREEDY)
    choice = out.choices[0]
    assert choice.text == PROMPT + plain
    lp = choice.logprobs
    assert len(lp.tokens) == tok["count"] + 8
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == choice.text
    streamed = list(
        client.completions.create(model=MODEL, prompt=PROMPT, echo=True, stream=True, **GREEDY)
    )
    assert "".join(c.choices[0].text for c in streamed) == PROMPT + plain


def test_prompt_logprobs_as_vllm_returns_them(server, client):
    _, tok = _http(server, "POST", "/tokenize", {"prompt": PROMPT})
    ids = tok["tokens"]
    out = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        echo=True,
        logprobs=1,
        extra_body={"prompt_logprobs": 2, "ignore_eos": True},
        temperature=0.0,
        max_tokens=2,
    )
    choice = out.choices[0]
    positions = choice.model_extra["prompt_logprobs"]
    assert len(positions) == len(ids) and positions[0] is None
    for i, position in enumerate(positions[1:], start=1):
        assert str(ids[i]) in position, "the prompt's own token is always there"
        assert 2 <= len(position) <= 3
        assert sorted(e["rank"] for e in position.values() if e["rank"] <= 2)[:2] == [1, 2]
        # The same number echo's logprobs report for that prompt token.
        assert position[str(ids[i])]["logprob"] == pytest.approx(
            choice.logprobs.token_logprobs[i], abs=1e-5
        )
        assert position[str(ids[i])]["decoded_token"] == choice.logprobs.tokens[i]
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={"prompt_logprobs": 0}
    )
    chat_positions = chat.model_extra["prompt_logprobs"]
    assert chat_positions[0] is None and len(chat_positions) == chat.usage.prompt_tokens
    assert all(len(p) in (1, 2) for p in chat_positions[1:])  # own token (+ the top one)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY).choices[0]
    assert plain.model_extra.get("prompt_logprobs") is None


@pytest.mark.parametrize(
    "body, message",
    [
        (
            {"prompt": PROMPT, "prompt_logprobs": 1, "stream": True},
            "not available when `stream=True`",
        ),
        ({"prompt": PROMPT, "prompt_logprobs": -2}, "must be -1"),
        ({"prompt": PROMPT, "prompt_logprobs": 10**6}, "exceeds the engine's max_logprobs (20)"),
    ],
)
def test_bad_prompt_logprobs_are_refused(server, body, message):
    status, answer = _http(server, "POST", "/v1/completions", {"model": MODEL, **body})
    assert status == 400, answer
    assert message in answer["error"]["message"]


def test_stop(client):
    text = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY).choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    out = client.completions.create(model=MODEL, prompt=PROMPT, stop=[stop], **GREEDY)
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.text == text[: text.index(stop)]
    assert choice.model_extra["stop_reason"] == stop
    streamed = list(
        client.completions.create(model=MODEL, prompt=PROMPT, stop=stop, stream=True, **GREEDY)
    )
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    assert streamed[-1].choices[0].finish_reason == "stop"


# ---- chat ----


def test_chat(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    msg = out.choices[0].message
    assert msg.role == "assistant" and msg.content and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 8
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name a color."}]}]
    assert client.chat.completions.create(model=MODEL, messages=parts, **GREEDY).choices[0]
    capped = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=0.0,
        max_completion_tokens=3,
        extra_body={"ignore_eos": True},
    )
    assert capped.usage.completion_tokens == 3


def test_chat_streaming_equals_non_streaming(client):
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    text_chunks = [c for c in chunks if c.choices]
    assert (
        "".join(c.choices[0].delta.content or "" for c in text_chunks)
        == full.choices[0].message.content
    )
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_chat_logprobs(client):
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=2, **GREEDY
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 8
    assert "".join(c.token for c in content) == out.choices[0].message.content
    for entry in content:
        assert bytes(entry.bytes).decode() == entry.token
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy


# ---- errors ----


def _error(exc_info) -> dict:
    return (
        exc_info.value.body
        if "error" not in (exc_info.value.body or {})
        else exc_info.value.body["error"]
    )


def test_bad_request_names_the_field(client):
    cases = [
        (dict(prompt=PROMPT, suffix="x"), "suffix"),
        (dict(prompt=PROMPT, best_of=2), "best_of"),
        (dict(prompt=PROMPT, logit_bias={"5": 500}), "logit_bias"),
        (dict(prompt=PROMPT, extra_body={"tools": [{"type": "function"}]}), "tools"),
        (dict(prompt=PROMPT, temperature=-1), "temperature"),
        (dict(prompt=PROMPT, max_tokens="many"), "max_tokens"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, **kwargs)
        err = _error(info)
        assert info.value.status_code == 400 and err["param"] == param, err
        assert err["code"] == 400 and err["type"] == "BadRequestError" and err["message"]
    with pytest.raises(openai.BadRequestError) as info:  # "auto" needs the server's flags
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=[{"type": "function", "function": {"name": "f"}}]
        )
    assert _error(info)["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "objekt"}},
            },
        )
    assert _error(info)["param"] == "response_format"


def test_prompt_too_long(server, client):
    _, tok = _http(server, "POST", "/tokenize", {"prompt": "hello " * 300})
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hello " * 300, max_tokens=4)
    message = _error(info)["message"]
    assert "256" in message and str(tok["count"]) in message  # the limit and the prompt length
    with pytest.raises(openai.BadRequestError):  # before any event is sent: a plain 400
        list(client.completions.create(model=MODEL, prompt="hello " * 300, stream=True))


def test_unauthorized(server):
    bad = openai.OpenAI(base_url=server.api_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    status, body = _http(server, "POST", "/v1/completions", {"prompt": "x"}, key=None)
    assert status == 401 and body["error"]["code"] == 401
    assert _http(server, "GET", "/health", key=None)[0] == 200
    assert _http(server, "GET", "/version", key="wrong")[0] == 200


def test_unknown_model(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    assert _error(info)["param"] == "model" and "nope" in _error(info)["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES)


def test_body_too_large(server):
    status, body = _http(
        server,
        "POST",
        "/v1/completions",
        raw=json.dumps({"prompt": "x" * (MAX_BODY + 10)}).encode(),
    )
    assert (
        status == 413 and body["error"]["code"] == 413 and str(MAX_BODY) in body["error"]["message"]
    )


def test_malformed_and_unknown_routes(server):
    status, body = _http(server, "POST", "/v1/completions", raw=b"{not json")
    assert status == 400 and "JSON" in body["error"]["message"]
    status, body = _http(server, "GET", "/v1/nothing")
    assert status == 404 and body["error"]["code"] == 404


# ---- disconnects ----


def _engine_stats(server) -> dict:
    from engine_core.client import EngineCoreClient

    with EngineCoreClient(server.core_address) as core:
        return core.call_utility("get_stats", timeout=10)


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", {"prompt": PROMPT, "stream": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}),
        ("/v1/completions", {"prompt": [PROMPT, "Hello"], "stream": True}),
        ("/v1/completions", {"prompt": PROMPT, "stream": False}),
    ],
)
def test_client_disconnect_aborts_the_request(server, path, body):
    import http.client
    import time
    from urllib.parse import urlsplit

    from tests.serve.conftest import wait_until

    max_tokens = 200
    before = _engine_stats(server)["num_generation_tokens"]
    url = urlsplit(server.api_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    conn.request(
        "POST",
        path,
        json.dumps({**body, "max_tokens": max_tokens, "ignore_eos": True, "n": 2}),
        {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
    )
    if body["stream"]:
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.readline().startswith(b"data: ")
    else:  # wait until it runs in the engine core
        assert wait_until(lambda: _engine_stats(server)["num_unfinished_requests"] > 0, 10)
    conn.sock.shutdown(2)
    conn.close()
    time.sleep(0.2)
    assert wait_until(lambda: _engine_stats(server)["num_unfinished_requests"] == 0, 10)
    generated = _engine_stats(server)["num_generation_tokens"] - before
    prompts = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1
    assert generated < prompts * 2 * max_tokens, generated  # all would be 2 * 200 per prompt


def test_metrics_endpoint_shows_all_processes_with_vllm_names(server, client):
    client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY)
    with urllib.request.urlopen(server.api_url + "/metrics", timeout=30) as resp:  # no API key
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    # Engine-core gauges and counters and tokenizer-process histograms, in one exposition.
    for name in (
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:e2e_request_latency_seconds_count",
        'vllm:request_success_total{engine="0",finished_reason="length"',
        "vllm:prompt_tokens_cached_total",
        'source="local_cache_hit"',
        "vllm:cache_config_info{",
        "vllm:request_inference_time_seconds_count",
        "vllm:request_time_per_output_token_seconds_count",
        "vllm:request_params_n_bucket",
        "vllm:request_params_max_tokens_bucket",
    ):
        assert name in text, f"{name} missing from /metrics"
    assert f'model_name="{MODEL}"' in text
