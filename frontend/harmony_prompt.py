"""A chat request's prompt for gpt-oss, rendered by openai-harmony instead of the checkpoint's
Jinja template, so that tools, reasoning effort and earlier turns are placed as harmony has them.

OpenAI messages map to harmony's as gpt-oss's own chat template maps them: the system message
(with the date and reasoning effort) is harmony's; a leading system or developer message becomes
the developer message's instructions, beside the request's tools as function descriptions; an
assistant turn is its reasoning on the analysis channel, its text on the final channel (or
commentary, before calls), each call a commentary message to functions.<name>; a tool result
comes from functions.<name> of the call its tool_call_id answers.
"""

from __future__ import annotations

import datetime
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from openai_harmony import HarmonyEncoding, Message

REASONING_EFFORTS = ("low", "medium", "high")


def _text(content: Any) -> str:
    """A message's content as text: a string, or its text parts joined."""
    if isinstance(content, list):
        return "".join(part.get("text") or "" for part in content)
    return content or ""


def today() -> str:
    """The conversation's start date as harmony writes it (UTC)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")


def harmony_messages(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    reasoning_effort: str | None = None,
    start_date: str | None = None,
) -> list[Message]:
    """The harmony conversation of OpenAI chat messages (the dicts serving_chat.chat_messages
    makes) and tools; ValueError naming a message harmony cannot express."""
    from openai_harmony import (
        DeveloperContent,
        Message,
        ReasoningEffort,
        Role,
        SystemContent,
        ToolDescription,
    )

    system = SystemContent.new().with_conversation_start_date(start_date or today())
    if reasoning_effort is not None:
        system = system.with_reasoning_effort(ReasoningEffort(reasoning_effort.capitalize()))
    out = [Message.from_role_and_content(Role.SYSTEM, system)]
    rest = messages
    instructions = None
    if messages and messages[0]["role"] in ("system", "developer"):
        instructions, rest = _text(messages[0]["content"]), messages[1:]
    if instructions or tools:
        developer = DeveloperContent.new()
        if instructions:
            developer = developer.with_instructions(instructions)
        if tools:
            developer = developer.with_function_tools(
                [
                    ToolDescription.new(
                        t["function"]["name"],
                        t["function"].get("description") or "",
                        t["function"].get("parameters"),
                    )
                    for t in tools
                ]
            )
        out.append(Message.from_role_and_content(Role.DEVELOPER, developer))
    call_names = {
        call["id"]: call["function"]["name"] for m in messages for call in m.get("tool_calls") or ()
    }
    for i, m in enumerate(rest, start=len(messages) - len(rest)):
        out += _message(m, call_names, f"messages[{i}]")
    return out


def _message(m: dict[str, Any], call_names: dict[str, str], where: str) -> list[Message]:
    from openai_harmony import Author, DeveloperContent, Message, Role

    role, text = m["role"], _text(m["content"])
    if role in ("system", "developer"):  # a later one: instructions from here on
        return [
            Message.from_role_and_content(
                Role.DEVELOPER, DeveloperContent.new().with_instructions(text)
            )
        ]
    if role == "user":
        return [Message.from_role_and_content(Role.USER, text)]
    if role == "tool":
        name = call_names.get(m.get("tool_call_id") or "") or m.get("name")
        if not name:
            raise ValueError(
                f"{where}: a tool result needs the tool_call_id of an earlier call (or a name) "
                "to say which function answered"
            )
        author = Author.new(Role.TOOL, f"functions.{name}")
        return [
            Message.from_author_and_content(author, text)
            .with_channel("commentary")
            .with_recipient("assistant")
        ]
    out = []
    reasoning = m.get("reasoning") or m.get("reasoning_content")
    if reasoning:
        out.append(
            Message.from_role_and_content(Role.ASSISTANT, reasoning).with_channel("analysis")
        )
    calls = m.get("tool_calls") or []
    if text:
        channel = "commentary" if calls else "final"
        out.append(Message.from_role_and_content(Role.ASSISTANT, text).with_channel(channel))
    for call in calls:
        arguments = call["function"]["arguments"]
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments)
        out.append(
            Message.from_role_and_content(Role.ASSISTANT, arguments)
            .with_channel("commentary")
            .with_recipient(f"functions.{call['function']['name']}")
            .with_content_type("<|constrain|>json")
        )
    return out


def render_prompt(
    encoding: HarmonyEncoding,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    reasoning_effort: str | None = None,
    add_generation_prompt: bool = True,
    start_date: str | None = None,
) -> list[int]:
    """The prompt's token ids: the conversation, then (add_generation_prompt) the assistant's
    turn opened for the completion; ValueError as harmony_messages."""
    from openai_harmony import Conversation, Role

    conversation = Conversation.from_messages(
        harmony_messages(messages, tools, reasoning_effort, start_date)
    )
    if add_generation_prompt:
        return list(encoding.render_conversation_for_completion(conversation, Role.ASSISTANT))
    return list(encoding.render_conversation(conversation))
