"""What a chat request's tools, tool_choice and parallel_tool_calls ask of the server, by vLLM's
rules: the tools the chat template sees, the constraint that enforces tool_choice "required"
or a named function, and the parser that reads each choice's calls."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import msgspec

from frontend.errors import bad_request
from frontend.openai_protocol import ChatTool, FunctionDefinition, NamedToolChoice
from frontend.tool_parsers import TOOL_PARSERS
from frontend.tool_parsers.forced import NamedFunctionParser, RequiredParser
from frontend.tool_parsers.streamer import ToolCallParser
from protocol.sampling_params import StructuredOutputsParams

_NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolChoice:
    """A request's tool use; the default uses none."""

    tools: list[dict[str, Any]] | None = None  # for the chat template, as OpenAI sends them
    # What "required" or a named function asks (frontend.response_format checks it).
    constraint: StructuredOutputsParams | None = None
    parser: Callable[..., ToolCallParser] | None = None  # parser(eager=...) reads one choice
    parallel: bool = True  # false: only a choice's first call counts
    keep_special_tokens: bool = False  # the parser reads special tokens

    def new_parser(self, eager: bool = True) -> ToolCallParser | None:
        """A parser for one choice's output; None when the request reads no calls."""
        return self.parser(eager=eager) if self.parser is not None else None


def resolve_tool_choice(
    tools: list[ChatTool] | None,
    choice: str | NamedToolChoice | None,
    parallel: bool,
    auto_parser: str | None,
) -> ToolChoice:
    """The tool use a request asks for; 400 naming the field when it cannot be served.

    auto_parser is --tool-call-parser when --enable-auto-tool-choice is set, else None.
    """
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
        return ToolChoice()
    functions = _functions(tools)
    template_tools = [msgspec.to_builtins(t) for t in tools]
    choice = "auto" if choice is None else choice  # vLLM's default when tools are given
    if choice == "none":
        return ToolChoice(template_tools)
    if choice == "auto":
        if auto_parser is None:
            raise bad_request(
                '"auto" tool choice requires --enable-auto-tool-choice and '
                "--tool-call-parser to be set",
                "tool_choice",
            )
        parser = TOOL_PARSERS[auto_parser]
        make: Callable[..., ToolCallParser] = parser
        if parser.uses_tool_schemas:  # e.g. qwen3_coder converts values by their types
            schemas = {name: fn.parameters or _NO_PARAMETERS for name, fn in functions.items()}
            make = functools.partial(cast(Callable[..., ToolCallParser], parser), tools=schemas)
        return ToolChoice(
            template_tools,
            parser=make,
            parallel=parallel,
            keep_special_tokens=parser.needs_special_tokens,
        )
    if choice == "required":
        constraint = StructuredOutputsParams(json=_required_schema(functions, parallel))
        return ToolChoice(template_tools, constraint, RequiredParser, parallel)
    if isinstance(choice, NamedToolChoice) and choice.type == "function":
        name = choice.function.name
        if name not in functions:
            raise bad_request(f"Tool '{name}' has not been passed in `tools`.", "tool_choice")
        constraint = StructuredOutputsParams(json=functions[name].parameters or _NO_PARAMETERS)
        return ToolChoice(template_tools, constraint, functools.partial(NamedFunctionParser, name))
    raise bad_request(
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
        f"'function': {{'name': NAME}}}}; got {msgspec.to_builtins(choice)!r}",
        "tool_choice",
    )


def _functions(tools: list[ChatTool]) -> dict[str, FunctionDefinition]:
    functions: dict[str, FunctionDefinition] = {}
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise bad_request(
                f"tool type {tool.type!r} is not supported; only 'function'", f"tools[{i}].type"
            )
        if tool.function.name in functions:
            raise bad_request(
                f"tool {tool.function.name!r} is given twice", f"tools[{i}].function.name"
            )
        functions[tool.function.name] = tool.function
    return functions


def _required_schema(functions: dict[str, FunctionDefinition], parallel: bool) -> dict[str, Any]:
    """vLLM's schema for tool_choice "required": an array of {"name", "parameters"} objects,
    one of the tools each; the tools' $defs move to the top, where their references point."""
    defs: dict[str, Any] = {}
    calls = []
    for fn in functions.values():
        parameters = dict(fn.parameters or _NO_PARAMETERS)
        for name, definition in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, definition) != definition:
                raise bad_request(
                    f"the tools define $defs {name!r} differently; tool_choice "
                    "'required' needs one definition",
                    "tools",
                )
        calls.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [fn.name]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": calls},
    }
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema
