"""Tool calling: parsers that read tool calls from a model's output (chosen with
--tool-call-parser for tool_choice "auto"), and what a request's tools and tool_choice ask
for (tool_choice.py)."""

from __future__ import annotations

from frontend.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from frontend.tool_parsers.granite import GraniteToolParser
from frontend.tool_parsers.hermes import HermesToolParser
from frontend.tool_parsers.llama3_json import Llama3JsonToolParser
from frontend.tool_parsers.mistral import MistralToolParser
from frontend.tool_parsers.phi4_mini import Phi4MiniJsonToolParser
from frontend.tool_parsers.pythonic import Llama4PythonicToolParser, PythonicToolParser
from frontend.tool_parsers.qwen3_coder import Qwen3CoderToolParser
from frontend.tool_parsers.streamer import ToolCallParser

# --tool-call-parser NAME -> the parser, with vLLM's names.
TOOL_PARSERS: dict[str, type[ToolCallParser]] = {
    "deepseek_v3": DeepSeekV3ToolParser,
    "granite": GraniteToolParser,
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "llama4_pythonic": Llama4PythonicToolParser,
    "mistral": MistralToolParser,
    "phi4_mini_json": Phi4MiniJsonToolParser,
    "pythonic": PythonicToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
}
