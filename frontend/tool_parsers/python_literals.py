"""Python literals as models write them in tool calls (pythonic calls, Qwen3-Coder's values):
where one ends in text that is still arriving, and its value as JSON data, read with Python's
ast (never evaluated): strings, numbers, True/False/None, lists, tuples and dicts of them."""

from __future__ import annotations

import ast
import math
from typing import Any

_OPEN, _CLOSE = "([{", ")]}"


def expression_end(text: str, start: int = 0) -> int | None:
    """The index of the ',' or closing bracket that ends the expression starting at start, at
    its own nesting level (outside strings); None when text ends first."""
    depth, i, n = 0, start, len(text)
    while i < n:
        c = text[i]
        if c in "'\"":
            end = _string_end(text, i)
            if end is None:
                return None
            i = end
            continue
        if c in _OPEN:
            depth += 1
        elif c in _CLOSE:
            if depth == 0:
                return i
            depth -= 1
        elif c == "," and depth == 0:
            return i
        i += 1
    return None


def _string_end(text: str, i: int) -> int | None:
    """The index after the string literal whose quote is at text[i]; None when not yet closed
    (or when the text ends before telling a triple quote from an empty string)."""
    c, n = text[i], len(text)
    if text.startswith(c * 3, i):
        quote = c * 3
    elif i + 2 >= n and text.startswith(c * (n - i), i):
        return None  # '' or ' at the end: may begin a triple quote
    else:
        quote = c
    j = i + len(quote)
    while j < n:
        if text[j] == "\\":
            j += 2
        elif text.startswith(quote, j):
            return j + len(quote)
        else:
            j += 1
    return None


class NotALiteral(ValueError):
    """The text is not a literal that has a JSON value."""


def literal_value(source: str) -> Any:
    """The JSON value of one Python literal expression; NotALiteral otherwise."""
    try:
        tree = ast.parse(source.strip(), mode="eval")
    except (SyntaxError, ValueError) as e:
        raise NotALiteral(f"not a Python expression: {source!r}") from e
    return node_value(tree.body)


def node_value(node: ast.expr) -> Any:
    """The JSON value of a literal's syntax tree; NotALiteral for anything else (names, calls,
    operators, sets, bytes, complex or non-finite numbers, non-string dict keys)."""
    if isinstance(node, ast.Constant):
        value = node.value
        if value is None or isinstance(value, (str, bool, int)):
            return value
        if isinstance(value, float) and math.isfinite(value):
            return value
        raise NotALiteral(f"{value!r} has no JSON value")
    if (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, (ast.USub, ast.UAdd))
        and isinstance(node.operand, ast.Constant)
        and type(node.operand.value) in (int, float)
    ):
        value = node_value(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [node_value(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for key, item in zip(node.keys, node.values):
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                raise NotALiteral("dict keys must be strings")
            out[key.value] = node_value(item)
        return out
    raise NotALiteral(f"{ast.dump(node)[:60]} is not a literal")
