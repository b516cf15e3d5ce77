"""The chat flags of `engine serve` (tiny random model): --chat-template (a file; inline is
read the same way) renders both /tokenize in the API server and chat prompts in the tokenizer
process, a request's chat_template and chat_template_kwargs win over it, --response-role names
the answer's role, and bad flags fail before anything starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from frontend.chat_args import ChatOptions
from serve.cli import build_parser
from tests.api.test_openai import _http
from tests.serve.conftest import Server, tiny_model  # noqa: F401 - tiny_model is a fixture

TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    "{% if tools %}tools: {% for t in tools %}{{ t.function.name }} {% endfor %}\n"
    "{% endif %}{{ greeting | default('') }}"
    "{% if add_generation_prompt %}[answer]{% endif %}"
)
MESSAGES = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather"}}]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "template.jinja"
    path.write_text(TEMPLATE)
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
            "--chat-template",
            str(path),
            "--response-role",
            "bot",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
        ]
    )
    assert srv.ready and srv.api_url, srv.stderr
    yield srv
    assert srv.stop() == 0, srv.stderr


def _rendered(server, **fields) -> tuple[str, int]:
    """The prompt text /tokenize renders, and the prompt tokens a chat completion counts."""
    status, tok = _http(server, "POST", "/tokenize", {"messages": MESSAGES, **fields}, key=None)
    assert status == 200, tok
    status, detok = _http(server, "POST", "/detokenize", {"tokens": tok["tokens"]}, key=None)
    status, chat = _http(
        server,
        "POST",
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": 1, **fields},
        key=None,
    )
    assert status == 200, chat
    return detok["prompt"], chat["usage"]["prompt_tokens"] - tok["count"]


def test_served_template_renders_tokenize_and_chat(server):
    text, difference = _rendered(server)
    # the template knows no developer role: that message is a system one
    assert text == "[system] Be brief.\n[user] Hi\n[answer]" and difference == 0


def test_request_fields_win(server):
    text, difference = _rendered(server, chat_template="{{ messages[-1].content }}!")
    assert text == "Hi!" and difference == 0
    text, difference = _rendered(server, chat_template_kwargs={"greeting": "Hello. "}, tools=TOOLS)
    assert text.endswith("[user] Hi\ntools: get_weather Hello. [answer]") and difference == 0


def test_response_role_and_auto_tool_choice(server):
    status, chat = _http(
        server,
        "POST",
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": 2, "tools": TOOLS},
        key=None,
    )
    assert status == 200, chat  # "auto" is served: the flags are set
    assert chat["choices"][0]["message"]["role"] == "bot"


@pytest.mark.parametrize(
    "flags,words",
    [
        (["--chat-template", "/no/such/template.jinja"], "looks like a file path"),
        (["--enable-auto-tool-choice"], "needs --tool-call-parser"),
    ],
)
def test_bad_flags_fail_before_start(flags, words):
    proc = subprocess.run(
        [sys.executable, "-m", "serve.cli", "serve", "--port", "0", *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and words in proc.stderr, proc.stderr


def test_inline_template_flag():
    args = build_parser().parse_args(
        [
            "serve",
            "--chat-template",
            "{{ messages[0].content }}\\n",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "llama3_json",
        ]
    )
    chat = ChatOptions.from_args(args)
    assert chat.chat_template == "{{ messages[0].content }}\n"
    assert chat.argv("/tmp/t.jinja") == [
        "--response-role",
        "assistant",
        "--chat-template",
        "/tmp/t.jinja",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "llama3_json",
    ]
