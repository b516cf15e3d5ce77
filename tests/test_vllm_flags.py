"""vLLM's command line and keyword arguments without a server: names, aliases, refusals, the
generation-config defaults and the CORS answers."""

from __future__ import annotations

import json
import logging

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from config.args import engine_kwargs
from config.engine import engine_config_from_kwargs
from config.errors import ConfigError
from config.generation_config import check_generation_config, default_sampling_params
from config.model import ModelConfig
from engine_core.generation_config import cap_unset_max_tokens, check_sampling_defaults
from engine_core.remote_code import remote_code_notice
from frontend.api_server import apply_generation_defaults
from frontend.cors import CorsPolicy
from frontend.http_options import HttpOptions
from frontend.openai_protocol import ChatCompletionRequest, CompletionRequest
from protocol.engine_core import EngineCoreRequest
from protocol.sampling_params import SamplingParams
from serve.cli import build_parser, main


def _serve_args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_model_positional_and_vllm_names():
    args = _serve_args(
        "my/model",
        "--enforce-eager",
        "--trust-remote-code",
        "--served-model-name",
        "a",
        "b",
        "--kv-cache-memory-bytes",
        "1GiB",
        "--disable-log-requests",
        "--disable-log-stats",
        "--uvicorn-log-level",
        "warning",
        "--generation-config",
        "vllm",
        "--override-generation-config",
        '{"temperature": 0.5}',
        "--swap-space",
        "4",
        "--kv-cache-dtype",
        "fp8_e4m3",
    )
    kwargs = engine_kwargs(args)
    assert kwargs["model"] == "my/model"
    assert kwargs["served_model_name"] == ["a", "b"]
    assert kwargs["kv_cache_memory"] == "1GiB"  # --kv-cache-memory stays an alias
    assert kwargs["enable_log_requests"] is False and kwargs["disable_log_stats"] is True
    assert kwargs["log_level"] == "warning"
    assert engine_kwargs(_serve_args("--kv-cache-memory", "2GiB"))["kv_cache_memory"] == "2GiB"
    assert engine_kwargs(_serve_args("--model", "m"))["model"] == "m"
    with pytest.raises(ValueError, match="given twice"):
        engine_kwargs(_serve_args("m1", "--model", "m2"))
    config = engine_config_from_kwargs(**kwargs)
    assert config.model.served_model_name == "a"
    assert config.model.served_model_names == ["a", "b"]
    assert config.model.enforce_eager and config.model.trust_remote_code
    assert config.cache.kv_cache_memory == 2**30
    assert config.cache.kv_cache_dtype == "fp8"  # e4m3, vLLM's fp8
    assert config.model.override_generation_config == {"temperature": 0.5}


def test_vllm_flags_the_engine_cannot_honour_are_refused_by_name(capsys):
    code = main(
        [
            "serve",
            "m",
            "--calculate-kv-scales",
            "--enable-lora",
            "--pipeline-parallel-size",
            "2",
            "--middleware",
            "x.y",
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    for flag in (
        "--calculate-kv-scales",
        "--enable-lora",
        "--pipeline-parallel-size 2",
        "--middleware x.y",
    ):
        assert flag in err
    # Read now (issue 33): an empty object names what it lacks, in one line, status 2.
    code = main(["generate", "hi", "--speculative-config", "{}"])
    assert code == 2 and "speculative_config: give a method" in capsys.readouterr().err


def test_llm_keyword_arguments_as_vllm_names_them():
    config = engine_config_from_kwargs(
        kv_cache_memory_bytes=10**8,
        swap_space=4,
        enforce_eager=True,
        served_model_name=["x", "y"],
        disable_log_stats=True,
        enable_chunked_prefill=True,
    )
    assert config.cache.kv_cache_memory == 10**8
    assert config.model.served_model_names == ["x", "y"]
    assert config.observability.disable_log_stats
    with pytest.raises(ConfigError, match="enable_lora is not supported.*calculate_kv_scales"):
        engine_config_from_kwargs(enable_lora=True, calculate_kv_scales=True)
    assert engine_config_from_kwargs(kv_cache_dtype="fp8").cache.kv_cache_dtype == "fp8"
    with pytest.raises(ConfigError, match="kv_cache_dtype fp8_e5m2 is not supported: .* e4m3"):
        engine_config_from_kwargs(kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3"):
        engine_config_from_kwargs(kv_cache_dtype="int8")
    with pytest.raises(ConfigError, match="not both"):
        engine_config_from_kwargs(kv_cache_memory_bytes=1, kv_cache_memory=2)
    with pytest.raises(ConfigError, match="unknown engine argument"):
        engine_config_from_kwargs(no_such_thing=1)
    with pytest.raises(ConfigError, match="served_model_name"):
        ModelConfig(served_model_name=[])


def _model_dir(tmp_path, generation: dict | None, auto_map: bool = False):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                **({"auto_map": {"AutoModel": "m.M"}} if auto_map else {}),
            }
        )
    )
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return str(tmp_path)


def test_generation_config_defaults(tmp_path):
    path = _model_dir(
        tmp_path,
        {
            "temperature": 0.6,
            "top_p": 0.9,
            "top_k": 20,
            "max_new_tokens": 64,
            "do_sample": True,
            "eos_token_id": 2,
            "min_p": None,
        },
    )
    auto = ModelConfig()
    assert default_sampling_params(auto, path) == {
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 20,
        "max_tokens": 64,
    }
    assert default_sampling_params(ModelConfig(generation_config="vllm"), path) == {}
    override = ModelConfig(
        generation_config="vllm", override_generation_config='{"repetition_penalty": 1.1}'
    )
    assert default_sampling_params(override, path) == {"repetition_penalty": 1.1}
    merged = ModelConfig(override_generation_config={"temperature": 0.1})
    assert default_sampling_params(merged, path)["temperature"] == 0.1
    folder = ModelConfig(generation_config=str(tmp_path))
    assert default_sampling_params(folder, "/elsewhere")["top_k"] == 20
    with pytest.raises(ConfigError, match="no generation_config.json"):
        check_generation_config(ModelConfig(generation_config=str(tmp_path / "none")), path)
    with pytest.raises(ConfigError, match="do_sample cannot be a request default"):
        check_generation_config(ModelConfig(override_generation_config={"do_sample": True}), path)
    negative = ModelConfig(override_generation_config={"temperature": -1})
    check_generation_config(negative, path)  # the keys are right; the value is checked next

    class Config:  # what check_sampling_defaults reads of an EngineConfig
        sampling_defaults = default_sampling_params(negative, path)

    with pytest.raises(ConfigError, match="temperature"):
        check_sampling_defaults(Config)


def test_generation_defaults_fill_only_unset_fields():
    defaults = {"temperature": 0.6, "top_k": 20, "max_tokens": 10}
    req = CompletionRequest(prompt="x", temperature=1.0)
    apply_generation_defaults(req, defaults)
    assert (req.temperature, req.top_k, req.max_tokens) == (1.0, 20, 10)  # 16 capped at 10
    chat = ChatCompletionRequest(messages=[], max_completion_tokens=5)
    apply_generation_defaults(chat, defaults)
    assert (chat.temperature, chat.max_completion_tokens, chat.max_tokens) == (0.6, 5, None)
    unset = ChatCompletionRequest(messages=[])
    apply_generation_defaults(unset, defaults)
    assert unset.max_tokens is None and unset.max_completion_tokens is None


def test_unset_max_tokens_capped_by_max_new_tokens(tmp_path):
    path = _model_dir(tmp_path, {"max_new_tokens": 8})

    class Config:  # what cap_unset_max_tokens reads of an EngineConfig
        sampling_defaults = default_sampling_params(ModelConfig(), path)
        max_model_len = 20

    def capped(prompt_len: int, max_tokens: int | None) -> int | None:
        req = EngineCoreRequest("r", list(range(prompt_len)), SamplingParams(max_tokens=max_tokens))
        return cap_unset_max_tokens(req, Config).sampling_params.max_tokens

    assert capped(4, None) == 8
    assert capped(15, None) == 5  # the rest of the context is smaller
    assert capped(4, 12) == 12  # set: the API server capped it already


def test_remote_code_notice(tmp_path):
    plain, custom = tmp_path / "plain", tmp_path / "custom"
    plain.mkdir()
    custom.mkdir()
    assert remote_code_notice(_model_dir(plain, None), True) is None
    notice = remote_code_notice(_model_dir(custom, None, auto_map=True), True)
    assert "never runs remote code" in notice and "AutoModel" in notice


def test_http_options_checked_before_start(tmp_path):
    with pytest.raises(ValueError, match="root-path"):
        HttpOptions(root_path="llm/")
    with pytest.raises(ValueError, match="TLS certificate"):
        HttpOptions(ssl_certfile=str(tmp_path / "missing.pem")).ssl_context()
    args = _serve_args("--allowed-origins", '["https://a.example"]', "--uds", "/tmp/x.sock")
    options = HttpOptions.from_args(args)
    assert (
        options.allowed_origins == ("https://a.example",)
        and options.url("h", 1) == "unix:/tmp/x.sock"
    )
    assert build_parser().parse_args(["serve", *options.argv()]).allowed_origins == [
        "https://a.example"
    ]
    assert main(["serve", "--uds", "/tmp/x.sock", "--api-server-count", "2"]) == 2
    with pytest.raises(SystemExit):
        _serve_args("--allowed-origins", "https://a.example")  # vLLM takes JSON lists


def _preflight(
    policy: CorsPolicy,
    origin: str,
    method: str = "POST",
    headers: str | None = "content-type, authorization",
) -> web.Response | None:
    h = {"Origin": origin, "Access-Control-Request-Method": method}
    if headers is not None:
        h["Access-Control-Request-Headers"] = headers
    return policy.preflight(make_mocked_request("OPTIONS", "/v1/completions", headers=h))


def test_cors_preflight_and_simple_answers():
    anyone = CorsPolicy()
    ok = _preflight(anyone, "https://a.example")
    assert ok.status == 200 and ok.headers["Access-Control-Allow-Origin"] == "*"
    assert "POST" in ok.headers["Access-Control-Allow-Methods"]
    assert ok.headers["Access-Control-Allow-Headers"] == "content-type, authorization"
    strict = CorsPolicy(
        origins=("https://a.example",),
        methods=("GET", "POST"),
        headers=("Authorization",),
        credentials=True,
    )
    ok = _preflight(strict, "https://a.example")
    assert ok.status == 200 and ok.headers["Access-Control-Allow-Origin"] == "https://a.example"
    assert ok.headers["Access-Control-Allow-Credentials"] == "true"
    bad = _preflight(strict, "https://evil.example", method="DELETE", headers="x-custom")
    assert bad.status == 400 and bad.text == "Disallowed CORS origin, method, headers"
    assert _preflight(strict, "https://a.example", headers=None).status == 200
    plain = make_mocked_request("OPTIONS", "/v1/models", headers={"Origin": "https://a.example"})
    assert strict.preflight(plain) is None  # not a preflight: the route answers
    response = web.Response()
    strict.add_headers(
        make_mocked_request("GET", "/v1/models", headers={"Origin": "https://a.example"}), response
    )
    assert response.headers["Access-Control-Allow-Origin"] == "https://a.example"
    response = web.Response()
    strict.add_headers(
        make_mocked_request("GET", "/v1/models", headers={"Origin": "https://evil.example"}),
        response,
    )
    assert "Access-Control-Allow-Origin" not in response.headers


def test_log_level_applies_to_the_project_loggers():
    from config.observability import ObservabilityConfig
    from engine_core.log_options import _LOGGERS, apply_log_options

    stats, proc = logging.getLogger("metrics.engine_stats"), logging.getLogger("engine_core")
    names = (*_LOGGERS, "metrics.engine_stats")
    before = {name: logging.getLogger(name).level for name in names}
    try:
        apply_log_options(ObservabilityConfig(log_level="debug", disable_log_stats=True))
        assert proc.getEffectiveLevel() == logging.DEBUG
        assert stats.getEffectiveLevel() == logging.WARNING
        with pytest.raises(ConfigError, match="log_level"):
            ObservabilityConfig(log_level="loud")
    finally:
        for name, level in before.items():
            logging.getLogger(name).setLevel(level)


def test_openapi_describes_every_route():
    from frontend.api_server import build_app
    from frontend.openapi import openapi_schema
    from frontend.serving import ServingContext

    app = build_app(ServingContext("m", 16, 16, client=None, tokenizer=None))
    routes = {
        (r.resource.canonical, r.method.lower()) for r in app.router.routes() if r.method != "HEAD"
    }
    described = {
        (path, method) for path, methods in openapi_schema()["paths"].items() for method in methods
    }
    assert routes == described
    docs_off = build_app(
        ServingContext("m", 16, 16, client=None, tokenizer=None),
        http=HttpOptions(disable_fastapi_docs=True),
    )
    assert not {"/docs", "/openapi.json"} & {r.resource.canonical for r in docs_off.router.routes()}


def test_llm_default_sampling_params_from_the_generation_config(tmp_path):
    from config.engine import EngineConfig
    from frontend.llm import LLM

    llm = object.__new__(LLM)  # its config only: no engine started
    llm.config = EngineConfig(model=ModelConfig(override_generation_config={"top_k": 5}))
    llm.config.model_path = _model_dir(tmp_path, {"temperature": 0.3, "max_new_tokens": 7})
    llm.config._check_generation_config()  # the part of resolve() that reads the defaults
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_k, params.max_tokens) == (0.3, 5, 7)


def test_max_model_len_as_vllm_reads_it():
    def parsed(value: str):
        return engine_kwargs(_serve_args("--max-model-len", value)).get("max_model_len")

    assert (parsed("4096"), parsed("32k"), parsed("32K"), parsed("1.5k")) == (
        4096,
        32000,
        32768,
        1500,
    )
    assert parsed("auto") is None and parsed("-1") is None  # the model's own limit


def test_docs_name_every_refused_or_ignored_vllm_flag():
    from pathlib import Path

    from config.vllm_only_args import ENGINE_ONLY, flag_name
    from frontend.http_options import FRONTEND_ONLY

    docs = (Path(__file__).parent.parent / "docs" / "serve.md").read_text()
    missing = [
        flag_name(n) for n in (*ENGINE_ONLY, *FRONTEND_ONLY) if f"`{flag_name(n)}`" not in docs
    ]
    assert not missing


def test_a_request_id_in_flight_is_not_taken_twice():
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from frontend.api_server import build_app
    from frontend.server_state import STATE
    from frontend.serving import ServingContext
    from protocol.tokenizer import RequestDelta

    release = asyncio.Event()

    class Client:  # one delta, then waits until released
        async def generate(self, request):
            yield RequestDelta(request.request_id, 0, "a", [1], num_prompt_tokens=1)
            await release.wait()
            yield RequestDelta(
                request.request_id, 0, "b", [2], num_prompt_tokens=1, finish_reason="length"
            )

    async def run():
        app = build_app(ServingContext("m", 64, 16, Client(), None))
        async with TestClient(TestServer(app)) as client:
            body = {"prompt": "x", "max_tokens": 2}
            headers = {"X-Request-Id": "same"}
            first = asyncio.create_task(client.post("/v1/completions", json=body, headers=headers))
            while not app[STATE].live_ids:
                await asyncio.sleep(0.01)
            second = await client.post("/v1/completions", json=body, headers=headers)
            other_kind = asyncio.create_task(
                client.post(
                    "/v1/chat/completions",
                    headers=headers,
                    json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
                )
            )
            release.set()
            first, chat = await first, await other_kind
            return (
                second.status,
                (await second.json())["error"]["message"],
                first.status,
                (await first.json())["id"],
                chat.status,
            )

    status, message, first, first_id, chat = asyncio.run(run())
    assert status == 400 and "'same' is already in use" in message
    assert (first, first_id, chat) == (200, "cmpl-same", 200)


def test_enable_log_requests_logs_each_request_cut_at_max_log_len(caplog):
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from config.observability import ObservabilityConfig
    from frontend.api_server import build_app
    from frontend.serving import ServingContext
    from protocol.tokenizer import RequestDelta

    class Client:
        async def generate(self, request):
            yield RequestDelta(
                request.request_id, 0, "a", [1], num_prompt_tokens=1, finish_reason="length"
            )

    async def run(log: ObservabilityConfig | None) -> None:
        app = build_app(ServingContext("m", 64, 16, Client(), None), log_requests=log)
        async with TestClient(TestServer(app)) as client:
            r = await client.post(
                "/v1/completions",
                json={"prompt": "x" * 50, "max_tokens": 1},
                headers={"X-Request-Id": "logged"},
            )
            assert r.status == 200

    with caplog.at_level(logging.INFO, logger="api_server"):
        asyncio.run(run(None))
        assert "Received request" not in caplog.text
        asyncio.run(run(ObservabilityConfig(enable_log_requests=True, max_log_len=20)))
    line = next(r.getMessage() for r in caplog.records if "Received request" in r.getMessage())
    assert line == 'Received request cmpl-logged: /v1/completions {"prompt": "xxxxxxxx'
