"""frontend/harmony_output.py on completions rendered by openai-harmony itself: reasoning,
content and calls as harmony's own parse_messages_from_completion_tokens reads them, and the
streamed pieces (one token at a time, or in uneven chunks) put back together the same."""

from __future__ import annotations

import pytest

from frontend.harmony_output import HarmonyAnswer, HarmonyOutput, HarmonyPiece, gather
from tests.api.harmony_vocab import encoding

RETURN, CALL, END = 200002, 200012, 200007


def _message(channel: str, text: str, recipient: str | None = None):
    from openai_harmony import Message, Role

    m = Message.from_role_and_content(Role.ASSISTANT, text).with_channel(channel)
    if recipient is not None:
        m = m.with_recipient(recipient).with_content_type("<|constrain|>json")
    return m


def completion(*messages) -> list[int]:
    """The tokens a model writes after the prompt's '<|start|>assistant': each message as
    harmony renders it, the turn ending with <|return|> after a final message."""
    enc = encoding()
    tokens = [t for m in messages for t in enc.render(m)][2:]  # the prompt wrote <|start|>assistant
    if tokens[-1] == END and messages[-1].channel == "final":
        tokens[-1] = RETURN
    return tokens


def answer(tokens: list[int], chunk: int | None = None) -> HarmonyAnswer:
    """The answer of the whole completion (chunk None) or of it fed chunk tokens at a time."""
    out = HarmonyOutput(encoding())
    if chunk is None:
        return gather(out.feed(tokens) + out.finish())
    pieces: list[HarmonyPiece] = []
    for i in range(0, len(tokens), chunk):
        pieces += out.feed(tokens[i : i + chunk])
    return gather(pieces + out.finish())


def harmony_reference(tokens: list[int]) -> HarmonyAnswer:
    """What openai-harmony's own parser reads from a complete completion."""
    from openai_harmony import Role

    messages = encoding().parse_messages_from_completion_tokens(tokens, Role.ASSISTANT)
    reasoning = [m.content[0].text for m in messages if m.channel == "analysis"]
    content = [
        m.content[0].text
        for m in messages
        if m.channel == "final" or (m.channel == "commentary" and not m.recipient)
    ]
    calls = [
        (m.recipient.removeprefix("functions."), m.content[0].text) for m in messages if m.recipient
    ]
    return HarmonyAnswer("\n".join(reasoning) or None, "\n".join(content) or None, calls)


REASONING = "The user greets me; answer briefly, in French: é 日本 🙂."
FINAL = "Bonjour ! Ça va ?"
ARGS = '{"city": "Paris", "unit": "celsius"}'

CASES = {
    "analysis+final": (_message("analysis", REASONING), _message("final", FINAL)),
    "final only": (_message("final", FINAL),),
    "analysis+call": (
        _message("analysis", REASONING),
        _message("commentary", ARGS, "functions.get_weather"),
    ),
    "preamble+two calls": (
        _message("commentary", "Let me look that up."),
        _message("commentary", ARGS, "functions.get_weather"),
        _message("commentary", "{}", "functions.get_time"),
    ),
    "two analyses+final": (
        _message("analysis", "First thought."),
        _message("analysis", "Second thought."),
        _message("final", FINAL),
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_whole_completion_reads_as_harmony_reads_it(case):
    tokens = completion(*CASES[case])
    assert answer(tokens) == harmony_reference(tokens)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_streamed_pieces_reassemble_to_the_whole(case, chunk):
    tokens = completion(*CASES[case])
    assert answer(tokens, chunk) == answer(tokens)


def test_the_expected_fields():
    whole = answer(completion(*CASES["analysis+final"]))
    assert (whole.reasoning, whole.content, whole.calls) == (REASONING, FINAL, [])
    call = answer(completion(*CASES["analysis+call"]))
    assert (call.reasoning, call.content, call.calls) == (REASONING, None, [("get_weather", ARGS)])
    assert answer(completion(*CASES["two analyses+final"])).reasoning == (
        "First thought.\nSecond thought."
    )


def test_a_call_is_announced_before_its_arguments():
    pieces = HarmonyOutput(encoding()).feed(completion(*CASES["preamble+two calls"]))
    calls = [p for p in pieces if p.kind == "call"]
    assert [(p.call, p.name) for p in calls if p.name is not None] == [
        (0, "get_weather"),
        (1, "get_time"),
    ]
    assert calls[0].name == "get_weather" and calls[0].text == ""
    assert "".join(p.text for p in calls if p.call == 0) == ARGS


@pytest.mark.parametrize("cut", [3, 8, 15])
def test_truncated_mid_analysis_keeps_the_partial_reasoning(cut):
    """finish_reason length inside the analysis message: what came of it is the reasoning."""
    tokens = completion(*CASES["analysis+final"])
    start = tokens.index(200008) + 1  # <|message|>
    partial = answer(tokens[: start + cut])
    assert partial.content is None and partial.calls == []
    assert partial.reasoning and REASONING.startswith(partial.reasoning.rstrip("\ufffd"))
    assert answer(tokens[: start + cut], 1) == partial


def test_output_outside_the_format_is_content():
    enc = encoding()
    tokens = enc.encode("Just plain text, no channels.", allowed_special="all")
    assert answer(tokens) == HarmonyAnswer(None, "Just plain text, no channels.", [])
    assert answer(tokens, 1) == answer(tokens)
    # The format breaking after a reasoning message: the rest is content.
    broken = completion(_message("analysis", "Hmm.")) + enc.encode("oops 日本")
    assert answer(broken) == HarmonyAnswer("Hmm.", "oops 日本", [])
    assert answer(broken, 1) == answer(broken)
