"""A request's constraint on its output, OpenAI's response_format or vLLM's structured_outputs,
as StructuredOutputsParams; checked here, so that an invalid schema, regex or grammar is a 400
naming the field instead of a failure in the engine."""

from __future__ import annotations

import msgspec

from engine_core.sampling_params import StructuredOutputsParams
from engine_core.structured_output.grammar import check_grammar
from frontend.errors import bad_request
from frontend.openai_protocol import (JsonObjectFormat, JsonSchemaResponseFormat,
                                      StructuralTagFormat, _SamplingFields)


def checked(params: StructuredOutputsParams, param: str, what: str) -> StructuredOutputsParams:
    """params, or 400 naming param when its grammar does not parse (what: how to call it)."""
    try:
        check_grammar(params)
    except ValueError as e:
        message = str(e).replace(f"structured_outputs.{params.kind}", what)
        raise bad_request(message, param) from None
    return params


def requested_constraint(req: _SamplingFields) -> StructuredOutputsParams | None:
    """The constraint response_format or structured_outputs asks for (at most one of them)."""
    fmt = req.response_format
    if fmt is not None and req.structured_outputs is not None:
        raise bad_request("give at most one of response_format and structured_outputs",
                          "structured_outputs")
    if req.structured_outputs is not None:
        given = req.structured_outputs
        params = StructuredOutputsParams(**msgspec.structs.asdict(given))
        return checked(params, "structured_outputs", f"structured_outputs.{params.kind}")
    if isinstance(fmt, JsonObjectFormat):
        return checked(StructuredOutputsParams(json_object=True), "response_format",
                       "response_format")
    if isinstance(fmt, JsonSchemaResponseFormat):
        if fmt.json_schema.schema is None:
            raise bad_request("response_format.json_schema.schema is required",
                              "response_format")
        return checked(StructuredOutputsParams(json=fmt.json_schema.schema), "response_format",
                       "response_format.json_schema.schema")
    if isinstance(fmt, StructuralTagFormat):
        if (fmt.format is None) == (fmt.structures is None):
            raise bad_request("a structural_tag response_format gives either structures (with "
                              "triggers) or format", "response_format")
        if fmt.structures is not None and fmt.triggers is None:
            raise bad_request("a structural_tag response_format with structures needs "
                              "triggers", "response_format")
        return checked(StructuredOutputsParams(structural_tag=msgspec.to_builtins(fmt)),
                       "response_format", "response_format (structural_tag)")
    return None  # text, or none given
