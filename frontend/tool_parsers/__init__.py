"""Tool calling: parsers that read tool calls from a model's output (chosen with
--tool-call-parser for tool_choice "auto"), and what a request's tools and tool_choice ask
for (tool_choice.py)."""

from __future__ import annotations

from frontend.tool_parsers.hermes import HermesToolParser
from frontend.tool_parsers.llama3_json import Llama3JsonToolParser
from frontend.tool_parsers.streamer import ToolCallParser

# --tool-call-parser NAME -> the parser, with vLLM's names.
TOOL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}
