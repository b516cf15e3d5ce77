"""/openapi.json, generated from the msgspec Structs, and /docs: a self-contained page (no
external scripts or styles) that lists the routes and their schemas and sends requests."""

from __future__ import annotations

from typing import Any

import msgspec

from frontend.admin_routes import LoadResponse, ServerInfoResponse
from frontend.openai_protocol import REQUEST_STRUCTS, RESPONSE_STRUCTS

# path -> method -> (summary, request Struct name or None, response Struct name or None, SSE)
ROUTES: dict[str, dict[str, tuple[str, str | None, str | None, bool]]] = {
    "/health": {"get": ("200 while the engine serves, 503 otherwise", None, None, False)},
    "/ping": {
        "get": ("SageMaker's health check: /health's answer", None, None, False),
        "post": ("SageMaker's health check: /health's answer", None, None, False),
    },
    "/version": {"get": ("the server's version", None, "VersionResponse", False)},
    "/v1/models": {"get": ("the served model names", None, "ModelList", False)},
    "/v1/completions": {
        "post": ("OpenAI's completions", "CompletionRequest", "CompletionResponse", True)
    },
    "/v1/chat/completions": {
        "post": (
            "OpenAI's chat completions",
            "ChatCompletionRequest",
            "ChatCompletionResponse",
            True,
        )
    },
    "/invocations": {
        "post": (
            "SageMaker: a chat completion when the body has messages, a "
            "completion when it has prompt",
            "ChatCompletionRequest|CompletionRequest",
            "ChatCompletionResponse|CompletionResponse",
            True,
        )
    },
    "/tokenize": {
        "post": ("a prompt or chat to token ids", "TokenizeRequest", "TokenizeResponse", False)
    },
    "/detokenize": {
        "post": ("token ids to text", "DetokenizeRequest", "DetokenizeResponse", False)
    },
    "/load": {"get": ("requests in flight on this API server", None, "LoadResponse", False)},
    "/reset_prefix_cache": {
        "post": ("drop the prefix cache; 409 while requests hold KV blocks", None, None, False)
    },
    "/server_info": {
        "get": (
            "version, served names and the resolved configuration",
            None,
            "ServerInfoResponse",
            False,
        )
    },
    "/metrics": {"get": ("Prometheus metrics", None, None, False)},
    "/openapi.json": {"get": ("this description", None, None, False)},
    "/docs": {"get": ("a page over this description", None, None, False)},
}


def openapi_schema(root_path: str = "", version: str = "") -> dict[str, Any]:
    """The OpenAPI 3.1 description of every route in ROUTES."""
    structs = [*REQUEST_STRUCTS, *RESPONSE_STRUCTS, LoadResponse, ServerInfoResponse]
    _, components = msgspec.json.schema_components(
        structs, ref_template="#/components/schemas/{name}"
    )

    def ref(names: str) -> dict:
        """A schema reference; 'A|B': either."""
        refs = [{"$ref": f"#/components/schemas/{name}"} for name in names.split("|")]
        return refs[0] if len(refs) == 1 else {"oneOf": refs}

    def answer(name: str | None, sse: bool) -> dict:
        ok: dict[str, Any] = {"description": "OK"}
        if name is not None:
            ok["content"] = {"application/json": {"schema": ref(name)}}
            if sse:
                ok["content"]["text/event-stream"] = {"schema": {"type": "string"}}
        err = {
            "description": "error",
            "content": {"application/json": {"schema": ref("ErrorResponse")}},
        }
        return {"200": ok, **{code: err for code in ("400", "401", "404", "409", "413", "503")}}

    paths: dict[str, dict[str, Any]] = {}
    for path, methods in ROUTES.items():
        for method, (summary, body, response, sse) in methods.items():
            operation: dict[str, Any] = {"summary": summary, "responses": answer(response, sse)}
            if body is not None:
                operation["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": ref(body)}},
                }
            paths.setdefault(path, {})[method] = operation
    return {
        "openapi": "3.1.0",
        "info": {"title": "engine OpenAI-compatible API", "version": version},
        "servers": [{"url": root_path or "/"}],
        "paths": paths,
        "components": {"schemas": components},
    }


# Relative URLs only, so the page works under --root-path and behind a proxy.
DOCS_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>engine API</title>
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:2em auto;max-width:60em;padding:0 1em}
details{border:1px solid #ccc;border-radius:4px;margin:.4em 0;padding:.3em .6em}
summary{cursor:pointer}code,pre,textarea{font:12px ui-monospace,monospace}
pre{background:#f6f6f6;overflow:auto;padding:.5em}.m{font-weight:bold;width:4em;
display:inline-block}textarea{width:100%;height:8em}
</style></head><body>
<h1>engine API</h1><p>From <a href="openapi.json">openapi.json</a>.
API key (for /v1 routes): <input id="key" size="30"></p><div id="routes">loading...</div>
<script>
const base = document.querySelector("a").href.replace(/openapi\\.json$/, "");
fetch("openapi.json").then(r => r.json()).then(spec => {
  const root = document.getElementById("routes"); root.textContent = "";
  for (const [path, methods] of Object.entries(spec.paths)) {
    for (const [method, op] of Object.entries(methods)) {
      const d = document.createElement("details");
      const s = document.createElement("summary");
      s.innerHTML = `<span class="m">${method.toUpperCase()}</span> <code></code> `;
      s.querySelector("code").textContent = path;
      s.append(op.summary || "");
      d.append(s);
      const body = op.requestBody && op.requestBody.content["application/json"].schema;
      const names = body ? (body.oneOf || [body]).map(b => b.$ref.split("/").pop()) : [];
      for (const name of names) {
        const pre = document.createElement("pre");
        pre.textContent = name + " " + JSON.stringify(spec.components.schemas[name], null, 1);
        d.append(pre);
      }
      const name = names.join(" or ");
      const input = document.createElement("textarea");
      input.placeholder = name ? "JSON body" : "(no body)";
      const send = document.createElement("button"); send.textContent = "send";
      const out = document.createElement("pre");
      send.onclick = async () => {
        const headers = {"Content-Type": "application/json"};
        const key = document.getElementById("key").value;
        if (key) headers.Authorization = "Bearer " + key;
        const r = await fetch(base + path.slice(1), {method: method.toUpperCase(), headers,
          body: method === "get" ? undefined : input.value || undefined});
        out.textContent = r.status + " " + await r.text();
      };
      if (method !== "get") d.append(input);
      d.append(send, out);
      root.append(d);
    }
  }
});
</script></body></html>
"""
