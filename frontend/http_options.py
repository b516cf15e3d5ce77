"""The HTTP flags of `engine serve` with vLLM's names: a Unix socket (--uds), CORS, TLS,
--root-path, X-Request-Id headers and --disable-fastapi-docs. The CLI checks them before
anything starts; the launcher passes them on to the API servers (HttpOptions.argv)."""

from __future__ import annotations

import argparse
import json
import ssl
from dataclasses import dataclass, fields

from config.vllm_only_args import ANY, ENGINE_ONLY, add_vllm_only_args, refuse_vllm_only

# vLLM's frontend flags this server has no setting for (see config.vllm_only_args).
FRONTEND_ONLY: dict[str, tuple[bool, tuple[str, ...], str]] = {
    "disable_uvicorn_access_log": (False, (ANY,), "the API servers write no access log"),
    "enable_server_load_tracking": (False, (ANY,), "GET /load always counts requests in flight"),
    "disable_frontend_multiprocessing": (
        False,
        (),
        "the API servers always run in their own processes",
    ),
    "enable_ssl_refresh": (
        False,
        (),
        "certificates are read once at start-up; restart to change them",
    ),
    "middleware": (True, (), "the API servers take no extra middleware"),
    "lora_modules": (True, (), "there are no LoRA adapters"),
    "tool_server": (True, (), "there is no Responses API with built-in tools"),
    "tool_parser_plugin": (True, (), "tool parsers are built in (--tool-call-parser)"),
    "log_config_file": (True, (), "logging is configured with --log-level"),
    "enable_log_outputs": (False, (), "generated text is not logged"),
    "enable_tokenizer_info_endpoint": (
        False,
        (),
        "there is no /tokenizer_info route; POST /tokenize gives the tokens",
    ),
    "tokens_only": (False, (), "there is no tokens-only mode"),
    "chat_template_content_format": (
        True,
        ("auto", "string"),
        "message content reaches the template as a string",
    ),
    "exclude_tools_when_tool_choice_none": (
        False,
        (),
        'tools reach the template also with tool_choice "none"',
    ),
    "h11_max_incomplete_event_size": (
        True,
        (),
        "the HTTP server is aiohttp, with its own limits (and --max-request-body)",
    ),
    "h11_max_header_count": (True, (), "the HTTP server is aiohttp, with its own limits"),
    "log_error_stack": (
        False,
        (),
        "internal errors (500) are logged with their stack; request errors are not",
    ),
    "trust_request_chat_template": (False, (ANY,), "a request's chat_template is always used"),
}


def _json_list(value: str) -> list[str]:
    """vLLM parses --allowed-origins and friends with json.loads: '["*"]'."""
    try:
        parsed = json.loads(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a JSON list: {value!r} (e.g. '[\"https://example.com\"]')"
        ) from None
    if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
        raise argparse.ArgumentTypeError(f"not a JSON list of strings: {value!r}")
    return parsed


def add_http_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Add the HTTP flags to parser (defaults as vLLM's)."""
    parser.add_argument(
        "--uds", metavar="PATH", help="serve on this Unix domain socket instead of --host/--port"
    )
    parser.add_argument(
        "--root-path",
        default="",
        help="path prefix a proxy serves the API under, e.g. /llm: routes "
        "answer with and without it; /openapi.json names it",
    )
    parser.add_argument(
        "--allowed-origins",
        type=_json_list,
        default=["*"],
        metavar="JSON",
        help="CORS: origins a browser page may call from (default '[\"*\"]')",
    )
    parser.add_argument(
        "--allowed-methods",
        type=_json_list,
        default=["*"],
        metavar="JSON",
        help="CORS: methods allowed (default '[\"*\"]')",
    )
    parser.add_argument(
        "--allowed-headers",
        type=_json_list,
        default=["*"],
        metavar="JSON",
        help="CORS: request headers allowed (default '[\"*\"]')",
    )
    parser.add_argument(
        "--allow-credentials",
        action="store_true",
        help="CORS: allow cookies and Authorization from browser pages",
    )
    parser.add_argument("--ssl-keyfile", help="TLS: the private key file (PEM)")
    parser.add_argument(
        "--ssl-certfile", help="TLS: the certificate chain file (PEM); serves https"
    )
    parser.add_argument(
        "--ssl-ca-certs", help="TLS: CA certificates to check client certificates with"
    )
    parser.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=int(ssl.CERT_NONE),
        choices=(0, 1, 2),
        help="TLS: client certificates: 0 none (default), 1 optional, 2 required",
    )
    parser.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help="answer with an X-Request-Id header: the client's, else the request's id",
    )
    parser.add_argument(
        "--disable-fastapi-docs",
        action="store_true",
        help="do not serve /docs and /openapi.json (vLLM's name)",
    )


def add_vllm_frontend_args(parser: argparse.ArgumentParser) -> None:
    """Accept vLLM's frontend flags this server lacks, so that it can say why it refuses them."""
    add_vllm_only_args(parser, FRONTEND_ONLY)


def refuse_vllm_serve_flags(args: argparse.Namespace) -> None:
    """ValueError naming every vLLM flag of `engine serve` (engine and frontend alike) given
    with a value this engine cannot honour."""
    refuse_vllm_only(args, {**ENGINE_ONLY, **FRONTEND_ONLY})


@dataclass(frozen=True)
class HttpOptions:
    """The HTTP flags, checked."""

    uds: str | None = None
    root_path: str = ""
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = int(ssl.CERT_NONE)
    enable_request_id_headers: bool = False
    disable_fastapi_docs: bool = False

    def __post_init__(self) -> None:
        root = self.root_path
        if root and (not root.startswith("/") or root.endswith("/")):
            raise ValueError(
                f"--root-path must start with / and not end with one, e.g. /llm; got {root!r}"
            )
        if self.ssl_keyfile and not self.ssl_certfile:
            raise ValueError("--ssl-keyfile needs --ssl-certfile")
        if (self.ssl_ca_certs or self.ssl_cert_reqs) and not self.ssl_certfile:
            raise ValueError("--ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> HttpOptions:
        """The options of parsed flags; ValueError when they do not go together or a
        certificate does not load."""
        values = {f.name: getattr(args, f.name) for f in fields(cls)}
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            values[name] = tuple(values[name])
        options = cls(**values)
        options.ssl_context()  # a missing or mismatched file fails before anything starts
        return options

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile else "http"

    def url(self, host: str, port: int) -> str:
        """Where the API servers listen, for the start-up message."""
        if self.uds:
            return f"unix:{self.uds}"
        host = f"[{host}]" if ":" in host else host
        return f"{self.scheme}://{host}:{port}{self.root_path}"

    def ssl_context(self) -> ssl.SSLContext | None:
        """The server's TLS context (vLLM's settings), or None without --ssl-certfile."""
        if not self.ssl_certfile:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(self.ssl_certfile, self.ssl_keyfile)
            if self.ssl_ca_certs:
                context.load_verify_locations(self.ssl_ca_certs)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"cannot load the TLS certificate or key: {e}") from None
        context.verify_mode = ssl.VerifyMode(self.ssl_cert_reqs)
        return context

    def argv(self) -> list[str]:
        """The flags for an API server's command line."""
        out = ["--root-path", self.root_path, "--ssl-cert-reqs", str(self.ssl_cert_reqs)]
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            out += [f"--{name.replace('_', '-')}", json.dumps(list(getattr(self, name)))]
        for name in ("uds", "ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
            if getattr(self, name):
                out += [f"--{name.replace('_', '-')}", getattr(self, name)]
        for name in ("allow_credentials", "enable_request_id_headers", "disable_fastapi_docs"):
            if getattr(self, name):
                out.append(f"--{name.replace('_', '-')}")
        return out
