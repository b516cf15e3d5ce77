"""vLLM's request fields on both completion endpoints, against one `engine serve` of the tiny
model with --enable-prompt-tokens-details: bad_words, allowed_token_ids, truncate_prompt_tokens,
return_token_ids, request_id, cached tokens in usage, continuous usage stats, beam search,
annotation fields (metadata, user, store, service_tier), the API key from $VLLM_API_KEY, and
what is refused (priority under fcfs, suffix, best_of)."""

from __future__ import annotations

import json

import pytest
import requests

from tests.api.conftest import API_KEY, MODEL
from tests.serve.conftest import Server

PROMPT = [100 + 7 * i for i in range(40)]


@pytest.fixture(scope="module")
def server(tiny_model):
    srv = Server(
        [
            "--model",
            str(tiny_model),
            "--device",
            "cpu",
            "--kv-cache-memory",
            "16MiB",
            "--max-model-len",
            "256",
            "--served-model-name",
            MODEL,
            "--enable-prompt-tokens-details",
        ],
        # The key from vLLM's variable, not the command line (where `ps` shows it).
        env={"VLLM_API_KEY": API_KEY},
    )
    assert srv.ready and srv.api_url, srv.stderr
    yield srv
    assert srv.stop() == 0, srv.stderr


def post(server, path: str, body: dict, stream: bool = False) -> requests.Response:
    return requests.post(
        server.api_url + path,
        json={"model": MODEL, **body},
        stream=stream,
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=120,
    )


def complete(server, **body) -> dict:
    r = post(
        server,
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True, **body},
    )
    assert r.status_code == 200, r.text
    return r.json()


def events(r: requests.Response) -> list[dict]:
    assert r.status_code == 200, r.text
    lines = [line[6:] for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_return_token_ids_request_id_and_cached_tokens(server):
    first = complete(server, return_token_ids=True, request_id="my-id-1")
    assert first["id"] == "cmpl-my-id-1"
    choice = first["choices"][0]
    assert choice["prompt_token_ids"] == PROMPT and len(choice["token_ids"]) == 6
    again = complete(server)
    assert again["choices"][0]["token_ids"] is None
    assert again["choices"][0]["text"] == choice["text"]
    # The second time the prompt's full blocks come from the prefix cache.
    assert first["usage"]["prompt_tokens"] == again["usage"]["prompt_tokens"] == len(PROMPT)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
    chat = post(
        server,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "temperature": 0.0,
            "return_token_ids": True,
            "request_id": "c1",
        },
    ).json()
    tokenized = requests.post(
        server.api_url + "/tokenize",
        json={"messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": f"Bearer {API_KEY}"},
    ).json()["tokens"]
    assert chat["id"] == "chatcmpl-c1" and chat["prompt_token_ids"] == tokenized
    assert len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"]
    assert "cached_tokens" in chat["usage"]["prompt_tokens_details"]


def test_streamed_token_ids_and_continuous_usage(server):
    chunks = events(
        post(
            server,
            "/v1/completions",
            {
                "prompt": PROMPT,
                "max_tokens": 5,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "return_token_ids": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            },
            True,
        )
    )
    assert all(c["usage"] is not None for c in chunks)
    token_chunks = [c for c in chunks if c["choices"]]
    assert token_chunks[0]["choices"][0]["prompt_token_ids"] == PROMPT
    assert sum(len(c["choices"][0]["token_ids"]) for c in token_chunks) == 5
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    chat = events(
        post(
            server,
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "return_token_ids": True,
                "stream_options": {"continuous_usage_stats": True},
            },
            True,
        )
    )
    assert chat[0]["prompt_token_ids"] and all(c["usage"] for c in chat)
    assert sum(len(c["choices"][0].get("token_ids") or []) for c in chat if c["choices"]) == 3


def test_bad_words_and_allowed_token_ids(server, tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    words = ["cat", "dog", "fish", "bird"]
    # Each word alone and after a space: single tokens, so vLLM bans both forms.
    allowed = [t for w in words for t in (tok.encode(w)[0], tok.encode(" " + w)[0])]
    got = complete(server, return_token_ids=True, allowed_token_ids=allowed)["choices"][0]
    assert set(got["token_ids"]) <= set(allowed)
    first = tok.decode(got["token_ids"][:1]).strip()
    banned = complete(server, return_token_ids=True, allowed_token_ids=allowed, bad_words=[first])[
        "choices"
    ][0]
    assert set(banned["token_ids"]) <= set(allowed)
    assert first not in banned["text"]
    # A two-token word bans its second token only right after its first.
    pair = tok.decode(got["token_ids"][:2])
    if (
        tok.encode(pair.lstrip()) == got["token_ids"][:2]
        and got["token_ids"][1] != got["token_ids"][0]
    ):
        after = complete(
            server, return_token_ids=True, allowed_token_ids=allowed, bad_words=[pair]
        )["choices"][0]["token_ids"]
        assert after[0] == got["token_ids"][0] and after[1] != got["token_ids"][1]
    chat = post(
        server,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "temperature": 1.0,
            "allowed_token_ids": allowed,
            "return_token_ids": True,
            "ignore_eos": True,
            "bad_words": words[:3],
        },
    ).json()
    assert set(chat["choices"][0]["token_ids"]) <= set(allowed[6:])


def test_truncate_prompt_tokens(server):
    out = complete(server, truncate_prompt_tokens=5, return_token_ids=True)
    assert out["usage"]["prompt_tokens"] == 5
    assert out["choices"][0]["prompt_token_ids"] == PROMPT[-5:]
    r = post(server, "/v1/completions", {"prompt": PROMPT, "truncate_prompt_tokens": 1000})
    assert r.status_code == 400 and "truncate_prompt_tokens" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"priority": 1}, None),
        ({"suffix": "x"}, "suffix"),
        ({"best_of": 2}, "best_of"),
        ({"allowed_token_ids": [10**6]}, None),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"use_beam_search": True, "logprobs": 2}, "logprobs"),
    ],
)
def test_refusals_name_the_field(server, body, param):
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    key = next(iter(body)) if param is None else param
    assert key.split("_")[0] in error["message"].lower()
    if param is not None:
        assert error["param"] == param


def test_beam_search_over_http(server):
    greedy = complete(server, return_token_ids=True)["choices"][0]["token_ids"]
    one = complete(server, use_beam_search=True, n=1, return_token_ids=True)
    assert one["choices"][0]["token_ids"] == greedy
    three = complete(server, use_beam_search=True, n=3, return_token_ids=True, length_penalty=0.8)
    beams = [c["token_ids"] for c in three["choices"]]
    assert len(beams) == 3 and len({tuple(b) for b in beams}) == 3
    assert [c["index"] for c in three["choices"]] == [0, 1, 2]
    streamed = events(
        post(
            server,
            "/v1/completions",
            {
                "prompt": PROMPT,
                "max_tokens": 6,
                "temperature": 0.0,
                "ignore_eos": True,
                "use_beam_search": True,
                "n": 3,
                "stream": True,
                "length_penalty": 0.8,
            },
            True,
        )
    )
    assert [c["choices"][0]["text"] for c in streamed] == [c["text"] for c in three["choices"]]
    chat = post(
        server,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "use_beam_search": True,
            "n": 2,
            "ignore_eos": True,
        },
    ).json()
    assert len(chat["choices"]) == 2 and chat["usage"]["completion_tokens"] == 6


ANNOTATIONS = {"metadata": {"k": "v"}, "user": "u", "store": False, "service_tier": "auto"}


def test_annotation_fields_accepted_on_both_endpoints(server):
    """Fields that only annotate a request are accepted everywhere chat accepts them."""
    assert complete(server, **ANNOTATIONS)["choices"][0]["text"]
    r = post(
        server,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **ANNOTATIONS},
    )
    assert r.status_code == 200, r.text


def test_api_key_from_vllm_variable(server):
    """The server took its key from $VLLM_API_KEY: no key or a wrong one is a 401."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    url = server.api_url + "/v1/completions"
    assert requests.post(url, json=body, timeout=60).status_code == 401
    wrong = {"Authorization": "Bearer not-the-key"}
    assert requests.post(url, json=body, headers=wrong, timeout=60).status_code == 401
