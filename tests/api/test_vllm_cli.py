"""A vLLM user's command line, run unchanged against `engine serve` (tiny random model), with
realistic requests of each kind through real clients: the openai client and urllib over TLS
with a self-signed certificate, CORS preflight from a browser origin, X-Request-Id, the
SageMaker routes, --root-path; and a server on a Unix socket through aiohttp."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import shutil
import ssl
import subprocess
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass

import openai
import pytest

from tests.serve.conftest import Server

KEY = "vllm-style-key"
ORIGIN = "https://app.example"
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name a color."}]


def _self_signed(folder) -> tuple[str, str]:
    """(certificate, key) files for 127.0.0.1 and localhost; skips without a way to make them."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor the openssl command is here")
        subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-keyout",
                str(key),
                "-out",
                str(cert),
                "-days",
                "1",
                "-subj",
                "/CN=localhost",
                "-addext",
                "subjectAltName=IP:127.0.0.1,DNS:localhost",
            ],
            check=True,
            capture_output=True,
        )
        return str(cert), str(key)
    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(private.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(private, hashes.SHA256())
    )
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(cert), str(key)


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    return _self_signed(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def server(tiny_model, tls, tmp_path_factory):
    generation = tmp_path_factory.mktemp("generation")
    # top_k 1: every request that leaves top_k unset decodes greedily, whatever its temperature.
    (generation / "generation_config.json").write_text(json.dumps({"top_k": 1, "temperature": 0.7}))
    cert, key = tls
    srv = Server(
        [
            str(tiny_model),
            "--enforce-eager",
            "--disable-log-requests",
            "--served-model-name",
            "a",
            "b",
            "--max-model-len",
            "256",
            "--kv-cache-memory-bytes",
            str(16 * 2**20),
            "--gpu-memory-utilization",
            "0.9",
            "--generation-config",
            str(generation),
            "--override-generation-config",
            '{"max_new_tokens": 6}',
            "--trust-remote-code",
            "--disable-log-stats",
            "--uvicorn-log-level",
            "warning",
            "--swap-space",
            "4",
            "--disable-uvicorn-access-log",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--api-key",
            KEY,
            "other-key",
            "--enable-request-id-headers",
            "--allowed-origins",
            json.dumps([ORIGIN]),
            "--root-path",
            "/llm",
            "--ssl-keyfile",
            key,
            "--ssl-certfile",
            cert,
            "--seed",
            "0",
            "--max-num-seqs",
            "8",
            "--device",
            "cpu",
        ]
    )
    assert srv.ready and srv.api_url.startswith("https://"), srv.stderr
    yield srv
    assert srv.stop() == 0, srv.stderr


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    text: str

    def json(self):
        return json.loads(self.text)


class Http:
    """urllib against the server over TLS, trusting the test's certificate."""

    def __init__(self, base: str, cafile: str, key: str | None = KEY) -> None:
        self.base = base
        self.context = ssl.create_default_context(cafile=cafile)
        self.key = key

    def request(self, method: str, path: str, body=None, headers=None) -> Answer:
        data = None if body is None else json.dumps(body).encode()
        all_headers = {"Content-Type": "application/json"}
        if self.key:
            all_headers["Authorization"] = f"Bearer {self.key}"
        all_headers.update(headers or {})
        req = urllib.request.Request(
            self.base + path,
            data=data,
            method=method,
            headers={k: v for k, v in all_headers.items() if v},
        )
        try:
            with urllib.request.urlopen(req, timeout=60, context=self.context) as r:
                return Answer(r.status, dict(r.headers), r.read().decode())
        except urllib.error.HTTPError as e:
            return Answer(e.code, dict(e.headers), e.read().decode())

    def get(self, path: str, headers=None) -> Answer:
        return self.request("GET", path, headers=headers)

    def post(self, path: str, json=None, headers=None) -> Answer:
        return self.request("POST", path, json if json is not None else {}, headers)

    def options(self, path: str, headers=None) -> Answer:
        return self.request("OPTIONS", path, headers=headers)


@pytest.fixture(scope="module")
def http(server, tls):
    return Http(server.api_url, tls[0])


@pytest.fixture(scope="module")
def client(server, tls):
    http_client = openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=tls[0]))
    c = openai.OpenAI(
        base_url=server.api_url + "/v1",
        api_key=KEY,
        max_retries=0,
        timeout=60,
        http_client=http_client,
    )
    yield c
    c.close()


def test_served_model_names(client):
    assert [m.id for m in client.models.list().data] == ["a", "b"]
    out = client.completions.create(model="b", prompt=PROMPT, max_tokens=2)
    assert out.model == "a"  # the first name is the one reported
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="c", prompt=PROMPT, max_tokens=2)


def test_generation_config_defaults_apply_to_unset_fields(client):
    greedy = client.completions.create(
        model="a", prompt=PROMPT, temperature=0.0, max_tokens=6, extra_body={"ignore_eos": True}
    )
    # temperature 0.7 and top_k 1 from the generation config: greedy; max_tokens 16 capped at 6.
    default = client.completions.create(model="a", prompt=PROMPT, extra_body={"ignore_eos": True})
    assert default.choices[0].text == greedy.choices[0].text
    assert default.usage.completion_tokens == 6 and default.choices[0].finish_reason == "length"
    sampled = client.completions.create(
        model="a",
        prompt=PROMPT,
        temperature=1.0,
        seed=1,
        max_tokens=6,
        extra_body={"top_k": -1, "ignore_eos": True},
    )
    assert sampled.choices[0].text != greedy.choices[0].text  # the request's own top_k wins
    chat = client.chat.completions.create(
        model="a", messages=MESSAGES, extra_body={"ignore_eos": True}
    )
    assert chat.usage.completion_tokens == 6 and chat.choices[0].finish_reason == "length"
    chunks = list(
        client.chat.completions.create(
            model="b",
            messages=MESSAGES,
            stream=True,
            max_completion_tokens=4,
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[-1].choices[0].finish_reason == "length"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="a", prompt=PROMPT, stream=True, extra_body={"ignore_eos": True}
        )
    )
    assert streamed == greedy.choices[0].text


def test_request_id_header(http):
    r = http.post(
        "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 2},
        headers={"X-Request-Id": "trace-42"},
    )
    assert r.status == 200 and r.headers["X-Request-Id"] == "trace-42"
    assert r.json()["id"] == "cmpl-trace-42"
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2})
    assert r.json()["id"] == "chatcmpl-" + r.headers["X-Request-Id"]
    assert http.get("/v1/models").headers["X-Request-Id"]


def test_cors_from_a_browser_origin(http):
    preflight = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    r = http.options("/v1/chat/completions", headers={**preflight, "Authorization": ""})
    assert r.status == 200
    assert r.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "POST" in r.headers["Access-Control-Allow-Methods"]
    assert r.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    r = http.options(
        "/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"}
    )
    assert r.status == 400 and "origin" in r.text
    r = http.post(
        "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}, headers={"Origin": ORIGIN}
    )
    assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == ORIGIN
    r = http.get("/v1/models", headers={"Origin": "https://evil.example"})
    assert "Access-Control-Allow-Origin" not in r.headers


def test_sagemaker_and_operational_routes(http):
    assert http.get("/ping").status == 200 and http.post("/ping").status == 200
    chat = http.post("/invocations", json={"messages": MESSAGES, "max_tokens": 2}).json()
    assert chat["object"] == "chat.completion"
    completion = http.post("/invocations", json={"prompt": PROMPT, "max_tokens": 2}).json()
    assert completion["object"] == "text_completion"
    assert http.post("/invocations", json={"input": "x"}).status == 400
    assert http.get("/load").json() == {"server_load": 0}
    assert http.post("/reset_prefix_cache").status == 200
    info = http.get("/server_info").json()
    assert info["served_model_names"] == ["a", "b"]
    assert info["engine_config"]["cache"]["kv_cache_memory"] == 16 * 2**20
    assert info["engine_config"]["model"]["enforce_eager"] is True
    docs = http.get("/docs")
    assert docs.status == 200 and "openapi.json" in docs.text
    assert "http://" not in docs.text and "https://" not in docs.text  # no CDN
    spec = http.get("/openapi.json").json()
    assert spec["servers"] == [{"url": "/llm"}] and "/invocations" in spec["paths"]
    assert "vllm:" in http.get("/metrics").text


def test_load_counts_requests_in_flight(http, client):
    generation = threading.Thread(
        target=client.completions.create,
        kwargs=dict(model="a", prompt=PROMPT, max_tokens=6, extra_body={"ignore_eos": True}),
    )
    generation.start()
    seen = []
    while generation.is_alive():
        seen.append(http.get("/load").json()["server_load"])
    generation.join()
    assert max(seen) == 1
    assert http.get("/load").json() == {"server_load": 0}


def test_api_key_guards_v1_as_vllm_does(server, tls):
    anonymous = Http(server.api_url, tls[0], key=None)
    assert anonymous.get("/v1/models").status == 401
    assert anonymous.post("/invocations", json={"prompt": "x"}).status == 401
    assert anonymous.post("/reset_prefix_cache").status == 401
    assert anonymous.get("/server_info").status == 401
    # Open, as in vLLM: /tokenize, /detokenize, /ping, /load, /health, /version.
    assert anonymous.post("/tokenize", json={"prompt": PROMPT}).status == 200
    assert anonymous.post("/detokenize", json={"tokens": [1, 2]}).status == 200
    for path in ("/ping", "/load", "/health", "/version"):
        assert anonymous.get(path).status == 200, path
    assert Http(server.api_url, tls[0], key="other-key").get("/v1/models").status == 200
    assert Http(server.api_url, tls[0], key="wrong").get("/v1/models").status == 401


def test_root_path_with_and_without_the_prefix(server, tls):
    bare = server.api_url.removesuffix("/llm")
    assert bare != server.api_url
    r = Http(bare, tls[0]).get("/v1/models")
    assert r.status == 200 and r.json()["data"][0]["id"] == "a"
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # TLS only
        urllib.request.urlopen(bare.replace("https://", "http://") + "/health", timeout=10)


def test_unix_socket_server(tiny_model, tmp_path):
    import aiohttp

    path = str(tmp_path / "engine.sock")
    srv = Server(
        [
            str(tiny_model),
            "--uds",
            path,
            "--device",
            "cpu",
            "--kv-cache-memory-bytes",
            "16MiB",
            "--max-model-len",
            "256",
        ]
    )
    try:
        assert srv.ready and srv.api_url == f"unix:{path}", srv.stderr

        async def talk() -> tuple[int, dict, int, int]:
            async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=path)) as s:
                async with s.get("http://localhost/health") as r:
                    health = r.status
                async with s.post(
                    "http://localhost/v1/completions", json={"prompt": PROMPT, "max_tokens": 3}
                ) as r:
                    out = await r.json()
                long = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
                async with s.post("http://localhost/v1/completions", json=long) as stream:
                    await stream.content.readline()  # the first event: the request holds blocks
                    async with s.post("http://localhost/reset_prefix_cache") as r:
                        busy = r.status
                    await stream.read()
                async with s.post("http://localhost/reset_prefix_cache") as r:
                    return health, out, busy, r.status

        health, out, busy, idle = asyncio.run(talk())
        assert health == 200 and out["usage"]["completion_tokens"] == 3
        assert (busy, idle) == (409, 200)  # not while a request holds KV blocks
    finally:
        assert srv.stop() == 0, srv.stderr
