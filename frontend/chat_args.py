"""The chat flags of `engine serve`, with vLLM's names: --chat-template, --response-role,
--enable-auto-tool-choice and --tool-call-parser, and --enable-prompt-tokens-details (what the
answers' usage shows). The CLI checks them (and reads the template)
before anything starts; the launcher passes them on to the API servers, and the template to the
tokenizer processes."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from frontend.reasoning.registry import HARMONY_REASONING_PARSER, REASONING_PARSER_NAMES
from frontend.tool_parsers import TOOL_PARSERS

# vLLM's --tool-call-parser for gpt-oss: its calls are harmony messages, which openai-harmony
# reads (frontend/serving_harmony.py); valid only for a gpt-oss model.
HARMONY_TOOL_PARSER = "openai"
HARMONY_MODEL_TYPES = frozenset({"gpt_oss"})  # config.json model_types whose chat is harmony
PARSER_NAMES = sorted([*TOOL_PARSERS, HARMONY_TOOL_PARSER])


def add_chat_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Add the chat flags to parser."""
    parser.add_argument(
        "--chat-template",
        metavar="FILE_OR_TEMPLATE",
        help="chat template for requests that give none: a file, or an inline "
        "Jinja template (default: the model's)",
    )
    parser.add_argument(
        "--response-role",
        default="assistant",
        help="role of chat answers when add_generation_prompt is set (default assistant)",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='serve tool_choice "auto" (the default when tools are given): the '
        "model writes calls as it likes and --tool-call-parser reads them",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=PARSER_NAMES,
        help="how the model writes tool calls (with --enable-auto-tool-choice)",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSER_NAMES,
        help="how the model writes its reasoning: chat answers carry it as reasoning "
        "(and reasoning_content), apart from the content (docs/reasoning.md)",
    )
    parser.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="answer usage.prompt_tokens_details.cached_tokens: the prompt "
        "tokens the prefix cache served",
    )


@dataclass(frozen=True)
class ChatOptions:
    """The chat flags, checked: the template's text and the parser that serves "auto"."""

    chat_template: str | None = None
    response_role: str = "assistant"
    auto_tool_parser: str | None = None  # set only with --enable-auto-tool-choice
    enable_prompt_tokens_details: bool = False
    reasoning_parser: str | None = None  # --reasoning-parser

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ChatOptions:
        """The options of parsed flags; ValueError when they do not go together or the
        template cannot be read."""
        from tokenizer_proc.tokenizer import load_chat_template

        if args.enable_auto_tool_choice and args.tool_call_parser is None:
            raise ValueError(
                "--enable-auto-tool-choice needs --tool-call-parser (one of "
                f"{', '.join(PARSER_NAMES)})"
            )
        return cls(
            load_chat_template(args.chat_template),
            args.response_role,
            args.tool_call_parser if args.enable_auto_tool_choice else None,
            args.enable_prompt_tokens_details,
            getattr(args, "reasoning_parser", None),
        )

    def check_model_type(self, model_type: str) -> None:
        """ValueError when --tool-call-parser cannot read this model's calls: 'openai'
        (harmony) for a model that is not gpt-oss, another parser for gpt-oss."""
        harmony = model_type in HARMONY_MODEL_TYPES
        parser = self.auto_tool_parser
        if parser == HARMONY_TOOL_PARSER and not harmony:
            raise ValueError(
                f"--tool-call-parser {parser} reads gpt-oss's harmony tool calls; this "
                f"model's model_type is {model_type!r}"
            )
        if parser not in (None, HARMONY_TOOL_PARSER) and harmony:
            raise ValueError(
                "gpt-oss writes its tool calls as harmony messages, which --tool-call-parser "
                f"{parser} cannot read: pass {HARMONY_TOOL_PARSER} (vLLM's name) or leave it out"
            )
        check_reasoning_parser(self.reasoning_parser, model_type)

    def argv(self, chat_template_file: str | None) -> list[str]:
        """The flags for a child's command line, the template given as a file."""
        out = ["--response-role", self.response_role]
        if chat_template_file is not None:
            out += ["--chat-template", chat_template_file]
        if self.auto_tool_parser is not None:
            out += ["--enable-auto-tool-choice", "--tool-call-parser", self.auto_tool_parser]
        if self.enable_prompt_tokens_details:
            out.append("--enable-prompt-tokens-details")
        if self.reasoning_parser is not None:
            out += ["--reasoning-parser", self.reasoning_parser]
        return out


def check_reasoning_parser(name: str | None, model_type: str) -> None:
    """ValueError when --reasoning-parser cannot read this model: openai_gptoss (its harmony
    channels) for a model that is not gpt-oss, a text parser for gpt-oss."""
    harmony = model_type in HARMONY_MODEL_TYPES
    if name == HARMONY_REASONING_PARSER and not harmony:
        raise ValueError(
            f"--reasoning-parser {name} reads gpt-oss's harmony channels; this model's "
            f"model_type is {model_type!r}"
        )
    if name not in (None, HARMONY_REASONING_PARSER) and harmony:
        raise ValueError(
            f"gpt-oss's reasoning is its harmony analysis channel, which --reasoning-parser "
            f"{name} cannot read: pass {HARMONY_REASONING_PARSER} (vLLM's name) or leave it out"
        )
