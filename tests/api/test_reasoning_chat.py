"""--reasoning-parser end to end: `engine serve --reasoning-parser deepseek_r1` on a tiny random
model whose tokenizer has <think> and </think> (added to the default model's) and DeepSeek-R1's
chat template (its prompt opens the reasoning). The model's lm_head is edited so that greedy
decoding writes </think> as its k-th token, so the reply has reasoning and an answer: the chat
reply carries the reasoning as reasoning and reasoning_content, the answer as content, streamed
or not; a structured output constrains the answer only; tool_choice "required" reads its call
from the answer."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from frontend.chat_args import check_reasoning_parser
from tests.serve.conftest import Server, SseStream, http_request
from tests.tiny_models import make_tiny_model

TEMPLATE = Path(__file__).resolve().parent.parent / "fixtures" / "chat_templates"
R1 = TEMPLATE / "deepseek_r1_distill_qwen.jinja"
ASK = [{"role": "user", "content": "What is 2 + 3?"}]
K = 4  # greedy writes </think> as its K-th token (0-based) or the first fitting one after


def _free_tokens(path: Path, n: int) -> list[int]:
    from frontend.llm import LLM
    from protocol.sampling_params import SamplingParams

    llm = LLM(str(path), engine_process=False, device="cpu", max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    [out] = llm.chat(ASK, params, use_tqdm=False, chat_template=R1.read_text())
    return list(out.outputs[0].token_ids)


@pytest.fixture(scope="module")
def reasoning_model(tmp_path_factory) -> tuple[Path, str, str]:
    """The model folder, and the reasoning and the text after it that greedy decoding writes."""
    import safetensors.torch
    from transformers import AutoTokenizer

    from config.default_model import resolve_model_path

    path = tmp_path_factory.mktemp("reasoning") / "tiny"
    tok = AutoTokenizer.from_pretrained(resolve_model_path(None))
    tok.add_tokens(["<think>", "</think>"])  # as DeepSeek-R1's: added, not special
    make_tiny_model(path, vocab_size=len(tok))
    tok.save_pretrained(path)
    shutil.copy(R1, path / "chat_template.jinja")
    free = _free_tokens(path, 16)
    k = next(i for i in range(K, len(free)) if free[i] not in free[:i])
    # </think> takes over the lm_head row of the token greedy decoding writes at k: the same
    # tokens before k (that token was not the argmax there), </think> at k.
    end = tok.convert_tokens_to_ids("</think>")
    weights_file = path / "model.safetensors"
    weights = safetensors.torch.load_file(weights_file)
    head = weights["lm_head.weight"]
    head[end] = head[free[k]]
    head[free[k]] = 0.0
    safetensors.torch.save_file(weights, weights_file, metadata={"format": "pt"})
    ids = _free_tokens(path, 24)
    assert ids[:k] == free[:k] and ids[k] == end, (ids, free, k)
    return path, tok.decode(ids[:k]), tok.decode(ids[k + 1 :])


@pytest.fixture(scope="module")
def server(reasoning_model):
    path = reasoning_model[0]
    srv = Server(
        [
            *("--model", str(path), "--device", "cpu", "--kv-cache-memory", "16MiB"),
            *("--max-model-len", "256", "--served-model-name", "tiny"),
            *("--reasoning-parser", "deepseek_r1"),
        ]
    )
    assert srv.ready and srv.api_url, srv.stderr
    yield srv
    assert srv.stop() == 0, srv.stderr


def _chat(server, **body):
    body = {"model": "tiny", "messages": ASK, "temperature": 0.0, "max_tokens": 24, **body}
    status, _, raw = http_request(server, "POST", "/v1/chat/completions", body)
    assert status == 200, raw
    return json.loads(raw)["choices"][0]


def _streamed(server, **body):
    body = {"model": "tiny", "messages": ASK, "temperature": 0.0, "max_tokens": 24, **body}
    stream = SseStream(server, "/v1/chat/completions", body)
    try:
        events = [json.loads(e) for e in stream.rest() if e != "[DONE]"]
    finally:
        stream.close()
    deltas = [c["delta"] for e in events for c in e["choices"]]
    reasoning = "".join(d.get("reasoning", "") for d in deltas)
    assert reasoning == "".join(d.get("reasoning_content", "") for d in deltas)
    return reasoning, "".join(d.get("content") or "" for d in deltas), deltas


def test_reply_carries_reasoning_apart_from_content(server, reasoning_model):
    _, reasoning, answer = reasoning_model
    message = _chat(server, ignore_eos=True)["message"]
    assert message["reasoning"] == message["reasoning_content"] == reasoning
    assert message["content"] == answer
    assert "</think>" not in message["content"]


def test_streamed_reply_splits_the_same(server, reasoning_model):
    _, reasoning, answer = reasoning_model
    streamed_reasoning, content, deltas = _streamed(server, ignore_eos=True)
    assert (streamed_reasoning, content) == (reasoning, answer)
    # Reasoning deltas come before any content, and no delta mixes in the tag.
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all(not d.get("reasoning") for d in deltas[first_content + 1 :])


def test_include_reasoning_false_drops_it(server, reasoning_model):
    _, _, answer = reasoning_model
    message = _chat(server, ignore_eos=True, include_reasoning=False)["message"]
    assert "reasoning" not in message or message["reasoning"] is None
    assert message["content"] == answer
    reasoning, content, _ = _streamed(server, ignore_eos=True, include_reasoning=False)
    assert reasoning == "" and content == answer


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_structured_output_constrains_the_answer_only(server, reasoning_model, stream):
    _, reasoning, _ = reasoning_model
    fmt = {"structured_outputs": {"regex": "[0-9]{4}"}}
    if stream:
        got_reasoning, content, _ = _streamed(server, **fmt)
    else:
        message = _chat(server, **fmt)["message"]
        got_reasoning, content = message["reasoning"], message["content"]
    assert got_reasoning == reasoning  # the model's own tokens: no mask before </think>
    assert re.fullmatch("[0-9]{4}", content), content


def test_required_tool_call_is_read_from_the_answer(server, reasoning_model):
    _, reasoning, _ = reasoning_model
    tool = {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer", "maximum": 9}},
                "required": ["a"],
                "additionalProperties": False,
            },
        },
    }
    choice = _chat(
        server,
        tools=[tool],
        tool_choice="required",
        max_tokens=200,
        structured_outputs={"disable_any_whitespace": True},  # no room for a random model
    )
    message = choice["message"]
    assert message["reasoning"] == reasoning, choice
    assert message["tool_calls"] and choice["finish_reason"] == "tool_calls", choice
    for call in message["tool_calls"]:  # the random model may call more than once
        assert call["function"]["name"] == "add"
        assert set(json.loads(call["function"]["arguments"])) == {"a"}


def test_parser_and_model_must_match():
    check_reasoning_parser("qwen3", "qwen3")
    check_reasoning_parser("openai_gptoss", "gpt_oss")
    with pytest.raises(ValueError, match="reads gpt-oss's harmony channels"):
        check_reasoning_parser("openai_gptoss", "llama")
    with pytest.raises(ValueError, match="harmony analysis channel"):
        check_reasoning_parser("deepseek_r1", "gpt_oss")


def test_llm_chat_constrains_after_the_reasoning(reasoning_model):
    from frontend.llm import LLM
    from protocol.sampling_params import SamplingParams, StructuredOutputsParams

    path, reasoning, _ = reasoning_model
    llm = LLM(
        str(path),
        engine_process=False,
        device="cpu",
        max_model_len=256,
        reasoning_parser="deepseek_r1",
    )
    params = SamplingParams(
        temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(regex="[0-9]{4}")
    )
    [out] = llm.chat(ASK, params, use_tqdm=False)
    text = out.outputs[0].text
    assert text.startswith(reasoning + "</think>"), text
    assert re.fullmatch("[0-9]{4}", text[len(reasoning) + len("</think>") :]), text
    with pytest.raises(ValueError, match="harmony channels"):
        LLM(str(path), engine_process=False, device="cpu", reasoning_parser="openai_gptoss")


def test_enable_thinking_reaches_the_template(server, reasoning_model):
    from transformers import AutoTokenizer

    qwen3 = (TEMPLATE / "qwen3.jinja").read_text()
    tok = AutoTokenizer.from_pretrained(reasoning_model[0])
    for kwargs, tail in (
        ({"enable_thinking": False}, "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
        ({}, "<|im_start|>assistant\n"),
    ):
        body = {"model": "tiny", "messages": ASK, "max_tokens": 1, "return_token_ids": True}
        body |= {"chat_template": qwen3, "chat_template_kwargs": kwargs}
        status, _, raw = http_request(server, "POST", "/v1/chat/completions", body)
        assert status == 200, raw
        prompt = tok.decode(json.loads(raw)["prompt_token_ids"])
        assert prompt.endswith(tail), prompt
