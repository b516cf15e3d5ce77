"""One gpt-oss completion read as harmony messages, token by token, with openai-harmony's
StreamableParser: the analysis channel is reasoning, the final channel (and commentary addressed
to no one, a preamble) is content, a message addressed to functions.<name> is a call of <name>
whose text is its JSON arguments.

Streamed and whole answers both come from HarmonyOutput.feed, so a stream's pieces put back
together are the whole answer: a second message of the same kind is joined with a newline.
Output that stops following the format (a weak or untrained model) is not an error: from the
first token the parser refuses, the rest is decoded as plain content.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from openai_harmony import HarmonyEncoding

FUNCTIONS = "functions."
# A header ('<|channel|>commentary to=functions.name <|constrain|>json') is a dozen tokens: one
# that opens with ordinary text and runs past this is text outside the format.
MAX_PLAIN_HEADER = 32
Kind = Literal["reasoning", "content", "call"]


@dataclass(frozen=True)
class HarmonyPiece:
    """A piece of the answer: reasoning or content text, or a call's start (name set, text
    empty) or a piece of its arguments (text). call is the call's index in the answer."""

    kind: Kind
    text: str = ""
    call: int = -1
    name: str | None = None


@dataclass
class HarmonyAnswer:
    """A whole answer: reasoning, content (None when empty) and the calls (name, arguments)."""

    reasoning: str | None = None
    content: str | None = None
    calls: list[tuple[str, str]] = field(default_factory=list)


class HarmonyOutput:
    """One choice's completion tokens -> pieces of its answer, as they arrive. The parser
    takes the completion as the assistant's (the prompt's '<|start|>assistant'), and also
    one that opens its turn itself (add_generation_prompt false).

    Where each message's header and content begin is read from the token ids (<|start|>,
    <|message|>, <|end|>/<|call|>/<|return|>), not from the parser's state and messages:
    those serialise the whole parse to JSON, 120 us a token against 2 us (a 4,000-token answer).
    The parser still reads every token and refuses what is not the format."""

    def __init__(self, encoding: HarmonyEncoding) -> None:
        from openai_harmony import Role, StreamableParser

        self._encoding = encoding
        self._parser = StreamableParser(encoding, role=Role.ASSISTANT)
        ids = _control_tokens(encoding)
        self._start, self._message, self._ends = ids[0], ids[1], frozenset(ids[2:])
        self._in_content = False  # else in a header (the prompt opened the first one)
        self._kind: Kind = "content"  # the kind of the current message's text
        self._seen: set[Kind] = set()
        self.calls = 0
        self._header: list[int] = []  # the tokens of the header being read
        self._raw: list[int] | None = None  # tokens after the format broke
        self._raw_text = ""

    def feed(self, token_ids: list[int]) -> list[HarmonyPiece]:
        """The pieces these tokens (the next of the completion) add."""
        out: list[HarmonyPiece] = []
        for i, token in enumerate(token_ids):
            if self._raw is not None:
                out += self._raw_pieces(token_ids[i:], final=False)
                break
            try:
                self._parser.process(token)
            except Exception:  # HarmonyError: not the format; the rest is plain text
                out += self._break_format(token_ids[i:])
                break
            if self._in_content:
                if token in self._ends:
                    self._in_content = False
                    continue
                delta = self._parser.last_content_delta
                if delta:
                    out.append(self._piece(delta))
            elif token == self._message:
                self._in_content = True
                self._header.clear()
                out += self._open(self._parser.current_channel, self._parser.current_recipient)
            else:
                self._header.append(token)
                if len(self._header) > MAX_PLAIN_HEADER and self._plain_header():
                    out += self._break_format(token_ids[i + 1 :])
                    break
        return out

    def finish(self) -> list[HarmonyPiece]:
        """What is still held back when the completion ends: a header that opened with plain
        text (a header cut short is dropped), an incomplete UTF-8 character of plain text."""
        if self._raw is None and self._plain_header():
            return self._break_format([], final=True)
        return self._raw_pieces([], final=True) if self._raw is not None else []

    def _plain_header(self) -> bool:
        return bool(self._header) and not self._encoding.is_special_token(self._header[0])

    def _open(self, channel: str | None, recipient: str | None) -> list[HarmonyPiece]:
        """A message's content begins: its kind, and a newline between two of a kind."""
        if recipient is not None and recipient.startswith(FUNCTIONS):
            self._kind = "call"
            self.calls += 1
            return [HarmonyPiece("call", call=self.calls - 1, name=recipient[len(FUNCTIONS) :])]
        self._kind = "reasoning" if channel == "analysis" else "content"
        out = [self._piece("\n")] if self._kind in self._seen else []
        self._seen.add(self._kind)
        return out

    def _piece(self, text: str) -> HarmonyPiece:
        if self._kind == "call":
            return HarmonyPiece("call", text, self.calls - 1)
        return HarmonyPiece(self._kind, text)

    def _break_format(self, token_ids: list[int], final: bool = False) -> list[HarmonyPiece]:
        """Plain text from the header being read on: content, after a newline unless a content
        message was open."""
        in_content = self._in_content and self._kind == "content"
        self._raw, self._header = self._header, []
        self._kind = "content"
        out = [self._piece("\n")] if "content" in self._seen and not in_content else []
        self._seen.add("content")
        return out + self._raw_pieces(token_ids, final)

    def _raw_pieces(self, token_ids: list[int], final: bool) -> list[HarmonyPiece]:
        assert self._raw is not None
        self._raw += token_ids
        text = self._encoding.decode(self._raw)
        if not final and text.endswith("\ufffd"):  # wait for the rest of the character
            return []
        new, self._raw_text = text[len(self._raw_text) :], text
        return [self._piece(new)] if new else []


def _control_tokens(encoding: HarmonyEncoding) -> list[int]:
    """<|start|>, <|message|>, then the tokens that end a message: <|end|>, <|call|>,
    <|return|>."""
    names = ("<|start|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>")
    return [encoding.encode(name, allowed_special="all")[0] for name in names]


def gather(pieces: list[HarmonyPiece]) -> HarmonyAnswer:
    """The whole answer the pieces make."""
    reasoning = "".join(p.text for p in pieces if p.kind == "reasoning")
    content = "".join(p.text for p in pieces if p.kind == "content")
    calls: list[list[str]] = []
    for p in pieces:
        if p.kind != "call":
            continue
        if p.name is not None:
            calls.append([p.name, ""])
        else:
            calls[p.call][1] += p.text
    return HarmonyAnswer(reasoning or None, content or None, [(n, a) for n, a in calls])
