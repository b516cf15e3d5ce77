"""A request's constraint on its output, as StructuredOutputsParams: OpenAI's response_format,
vLLM's structured_outputs, or the constraint of tool_choice "required" or a named function.

At most one of them sets the kind of constraint; structured_outputs without a kind gives only
options (disable_any_whitespace, ...) that refine the other's, as vLLM merges them. The result
is checked here, so that an invalid schema, regex or grammar is a 400 naming the field instead
of a failure in the engine.
"""

from __future__ import annotations

import asyncio
import importlib
from typing import Any, NamedTuple

import msgspec

from frontend.errors import bad_request
from frontend.openai_protocol import (
    JsonObjectFormat,
    JsonSchemaResponseFormat,
    StructuralTagFormat,
    _SamplingFields,
)
from protocol.sampling_params import STRUCTURED_OUTPUT_KINDS, StructuredOutputsParams


class _Source(NamedTuple):
    """Where a constraint's kind comes from: the field a 400 names, and how to call it."""

    kind: str
    spec: Any
    param: str
    what: str


# The grammar library's module: xgrammar, and torch with it, about 2 s to import.
_GRAMMAR = "engine_core.structured_output.grammar"
_grammar_import: tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]] | None = None


async def load_grammar_library(
    req: _SamplingFields, tool_constraint: StructuredOutputsParams | None = None
) -> None:
    """Before requested_constraint() of a request that may carry a constraint: import the
    grammar library in a thread, once per process. Imported on the event loop, the first
    constrained request froze every stream of this API server for about 2 s; now only that
    request (and any constrained one arriving meanwhile) waits."""
    global _grammar_import
    if tool_constraint is None and req.response_format is None and not req.structured_outputs:
        return
    loop = asyncio.get_running_loop()
    if _grammar_import is None or _grammar_import[0] is not loop:
        _grammar_import = (
            loop,
            asyncio.ensure_future(asyncio.to_thread(importlib.import_module, _GRAMMAR)),
        )
    await asyncio.shield(_grammar_import[1])


def checked(params: StructuredOutputsParams, param: str, what: str) -> StructuredOutputsParams:
    """params, or 400 naming param when its grammar does not parse (what: how to call it)."""
    # Here, not at the top: xgrammar (and torch with it) costs an API server seconds at start,
    # and only constrained requests need it (vLLM imports it lazily too).
    from engine_core.structured_output.grammar import check_grammar

    try:
        check_grammar(params)
    except ValueError as e:
        message = str(e).replace(f"structured_outputs.{params.kind}", what)
        raise bad_request(message, param) from None
    return params


def requested_constraint(
    req: _SamplingFields,
    tool_constraint: StructuredOutputsParams | None = None,
) -> StructuredOutputsParams | None:
    """The constraint the request asks for (tool_constraint: its tool_choice's), checked."""
    source = _response_format(req)
    if tool_constraint is not None:
        if source is not None:
            raise bad_request(
                "tool_choice 'required' or a named function constrains the output "
                "itself; it cannot be combined with response_format",
                "tool_choice",
            )
        source = _Source(
            tool_constraint.kind,
            getattr(tool_constraint, tool_constraint.kind),
            "tools",
            "the tools' parameters",
        )
    given = msgspec.structs.asdict(req.structured_outputs) if req.structured_outputs else {}
    if source is None:
        if not given:
            return None
        params = _params(given)
        return checked(params, "structured_outputs", f"structured_outputs.{params.kind}")
    if any(given[k] not in (None, False) for k in given if k in STRUCTURED_OUTPUT_KINDS):
        raise bad_request(
            "structured_outputs sets a constraint besides response_format or "
            "tool_choice; give it once (structured_outputs may add options such "
            "as disable_any_whitespace)",
            "structured_outputs",
        )
    return checked(_params({**given, source.kind: source.spec}), source.param, source.what)


def _params(fields: dict[str, Any]) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as e:
        raise bad_request(str(e), "structured_outputs") from None


def _response_format(req: _SamplingFields) -> _Source | None:
    fmt = req.response_format
    if isinstance(fmt, JsonObjectFormat):
        return _Source("json_object", True, "response_format", "response_format")
    if isinstance(fmt, JsonSchemaResponseFormat):
        if fmt.json_schema.schema is None:
            raise bad_request("response_format.json_schema.schema is required", "response_format")
        return _Source(
            "json", fmt.json_schema.schema, "response_format", "response_format.json_schema.schema"
        )
    if isinstance(fmt, StructuralTagFormat):
        if (fmt.format is None) == (fmt.structures is None):
            raise bad_request(
                "a structural_tag response_format gives either structures (with "
                "triggers) or format",
                "response_format",
            )
        if fmt.structures is not None and fmt.triggers is None:
            raise bad_request(
                "a structural_tag response_format with structures needs triggers", "response_format"
            )
        return _Source(
            "structural_tag",
            msgspec.to_builtins(fmt),
            "response_format",
            "response_format (structural_tag)",
        )
    return None  # text, or none given
