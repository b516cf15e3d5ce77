"""The chat endpoint for a gpt-oss model (model_type gpt_oss): its prompt rendered by
openai-harmony, its completion read back as harmony messages from the token ids, the reasoning
as `reasoning` (and vLLM's older `reasoning_content`), the answer as `content`, calls to
functions.<name> as OpenAI tool calls (finish_reason "tool_calls").

What harmony's format cannot carry is refused with 400: a grammar (response_format, tool_choice
"required" or a named function) would constrain the channels' headers along with the answer;
continue_final_message, a request's chat_template or its variables, and beam search.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from frontend.chat_args import HARMONY_MODEL_TYPES
from frontend.errors import bad_request
from frontend.harmony_output import HarmonyOutput, HarmonyPiece, gather
from frontend.harmony_prompt import render_prompt
from frontend.harmony_vocab import load_gpt_oss_encoding
from frontend.openai_protocol import (
    ChatCompletionRequest,
    ChatDelta,
    ChatResponseMessage,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from frontend.tool_parsers.openai_calls import call_id
from frontend.tool_parsers.tool_choice import resolve_tool_choice
from protocol.sampling_params import SamplingParams

if TYPE_CHECKING:
    from openai_harmony import HarmonyEncoding
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class HarmonyChat:
    """What a gpt-oss API server holds: harmony's encoding, and the tokens that end the
    assistant's turn (<|return|>, <|call|>)."""

    encoding: HarmonyEncoding
    stop_token_ids: tuple[int, ...]

    @classmethod
    def load(cls, tokenizer: PreTrainedTokenizerBase) -> HarmonyChat:
        """The encoding, its vocabulary taken from the model's tokenizer where harmony has no
        file of its own (frontend.harmony_vocab); RuntimeError when none is found."""
        encoding = load_gpt_oss_encoding(tokenizer.get_vocab())
        return cls(encoding, tuple(encoding.stop_tokens_for_assistant_actions()))


def harmony_chat_for(model_type: str, tokenizer: PreTrainedTokenizerBase) -> HarmonyChat | None:
    """The harmony chat of a model whose chat format is harmony, else None."""
    return HarmonyChat.load(tokenizer) if model_type in HARMONY_MODEL_TYPES else None


_REFUSED = "is not supported for gpt-oss (its prompt and answer are harmony messages)"


def check_request(req: ChatCompletionRequest) -> None:
    """400 naming the field harmony cannot serve."""
    if req.use_beam_search:
        raise bad_request(f"use_beam_search {_REFUSED}", "use_beam_search")
    if req.continue_final_message:
        raise bad_request(f"continue_final_message {_REFUSED}", "continue_final_message")
    if req.chat_template is not None:
        raise bad_request(f"chat_template {_REFUSED}", "chat_template")
    if req.chat_template_kwargs:
        raise bad_request(
            f"chat_template_kwargs {_REFUSED}; reasoning_effort is a field of its own",
            "chat_template_kwargs",
        )
    if req.tool_choice not in (None, "none", "auto"):
        raise bad_request(
            f"tool_choice {msgspec.to_builtins(req.tool_choice)!r} {_REFUSED}: its grammar "
            "would constrain the channels too; use 'auto'",
            "tool_choice",
        )


def tools_for_prompt(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools the developer message describes (none with tool_choice 'none'); 400 on a tool
    that is not a function or a name given twice."""
    resolve_tool_choice(req.tools, "none" if req.tools else req.tool_choice, True, None)
    if not req.tools or req.tool_choice == "none":
        return None
    return [msgspec.to_builtins(t) for t in req.tools]


def refuse_constraint(constraint: object) -> None:
    if constraint is not None:
        raise bad_request(
            f"response_format and structured_outputs {_REFUSED}: the grammar would "
            "constrain the channels' headers too",
            "response_format",
        )


async def prompt_token_ids(
    chat: HarmonyChat,
    req: ChatCompletionRequest,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
) -> list[int]:
    """The request's prompt as harmony renders it (in a thread: a long conversation must not
    stall the event loop); 400 on a message harmony cannot express."""
    try:
        return await asyncio.to_thread(
            render_prompt,
            chat.encoding,
            messages,
            tools,
            req.reasoning_effort,
            req.add_generation_prompt,
        )
    except ValueError as e:
        raise bad_request(str(e), "messages") from None


def with_stop_tokens(params: SamplingParams, chat: HarmonyChat) -> SamplingParams:
    """params ending also at <|return|> and <|call|>, as the assistant's turn ends."""
    params.stop_token_ids = sorted({*(params.stop_token_ids or ()), *chat.stop_token_ids})
    return params


def _reasoning_delta(text: str) -> ChatDelta:
    return ChatDelta(reasoning=text, reasoning_content=text)


class HarmonyChoice:
    """One streamed choice: its harmony reader, and whether it made a call."""

    def __init__(self, chat: HarmonyChat, parallel: bool, include_reasoning: bool) -> None:
        self.output = HarmonyOutput(chat.encoding)
        self.parallel = parallel
        self.include_reasoning = include_reasoning
        self.called = False

    def deltas(self, token_ids: list[int], finished: bool) -> list[ChatDelta]:
        """The chunks' deltas these tokens add, in order."""
        pieces = self.output.feed(token_ids)
        if finished:
            pieces += self.output.finish()
        out: list[ChatDelta] = []
        for piece in pieces:
            delta = self._delta(piece)
            if delta is not None:
                out.append(delta)
        return out

    def _delta(self, piece: HarmonyPiece) -> ChatDelta | None:
        if piece.kind == "reasoning":
            return _reasoning_delta(piece.text) if self.include_reasoning else None
        if piece.kind == "content":
            return ChatDelta(content=piece.text)
        if piece.call > 0 and not self.parallel:
            return None
        if piece.name is not None:
            self.called = True
            call = DeltaToolCall(
                index=piece.call,
                id=call_id(),
                type="function",
                function=DeltaFunctionCall(name=piece.name, arguments=""),
            )
        else:
            call = DeltaToolCall(index=piece.call, function=DeltaFunctionCall(arguments=piece.text))
        return ChatDelta(tool_calls=[call])


def harmony_message(
    chat: HarmonyChat, token_ids: list[int], role: str, parallel: bool, include_reasoning: bool
) -> ChatResponseMessage:
    """A whole choice's message from its completion tokens."""
    output = HarmonyOutput(chat.encoding)
    answer = gather(output.feed(token_ids) + output.finish())
    calls = answer.calls if parallel else answer.calls[:1]
    reasoning = answer.reasoning if include_reasoning else None
    return ChatResponseMessage(
        role=role,
        content=answer.content,
        tool_calls=[
            ToolCall(id=call_id(), function=FunctionCall(name=name, arguments=arguments))
            for name, arguments in calls
        ]
        or None,
        reasoning=reasoning,
        reasoning_content=reasoning,
    )
