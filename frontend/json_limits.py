"""Limits on a request body's JSON that its schema alone does not give: how deep it nests and
how large its integers are. Both are checked so that a hostile body gets a 400 naming the
field, not a RecursionError or an IPC encoder's overflow (a 500)."""

from __future__ import annotations

import re
from typing import Any

import msgspec
import numpy as np

from frontend.errors import bad_request

# Deeper than any real request: a body's own structure is ~5 levels, a JSON schema rarely 20.
MAX_JSON_DEPTH = 64
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

_ESCAPE = re.compile(rb"\\.", re.DOTALL)
_STRING = re.compile(rb'"[^"]*"')
_KEEP_BRACKETS = bytes(set(range(256)) - set(b"[]{}"))
_LONG_NUMBER = re.compile(rb"\d{19}")  # any integer outside int64 has at least 19 digits


def _depth(raw: bytes) -> int:
    """How deep raw JSON nests (strings, and escapes within them, are skipped)."""
    brackets = _STRING.sub(b"", _ESCAPE.sub(b"", raw)).translate(None, _KEEP_BRACKETS)
    codes = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1)
    return int(np.cumsum(steps).max(initial=0))


def check_depth(body: bytes) -> None:
    """400 when body nests deeper than MAX_JSON_DEPTH, naming the top-level field that does."""
    if body.count(b"[") + body.count(b"{") <= MAX_JSON_DEPTH or _depth(body) <= MAX_JSON_DEPTH:
        return  # the common case needs no scan: too few brackets to nest that deep
    param = None
    try:
        fields = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
        param = next((k for k, v in fields.items() if _depth(bytes(v)) >= MAX_JSON_DEPTH), None)
    except (msgspec.MsgspecError, RecursionError, UnicodeDecodeError):
        pass
    where = f" (in `{param}`)" if param else ""
    raise bad_request(
        f"the request body's JSON nests deeper than {MAX_JSON_DEPTH} levels{where}", param
    )


def check_int64(body: bytes, request: Any) -> None:
    """400 naming the field when a decoded request holds an integer beyond 64 bits (the limit of
    the engine's IPC encoder and of its token ids, seeds and priorities)."""
    if not _LONG_NUMBER.search(body):
        return  # every integer in body has at most 18 digits
    path = _oversized(request, "")
    if path is not None:
        name = path.lstrip(".") or "body"
        raise bad_request(
            f"`{name}` is out of the 64-bit integer range [{INT64_MIN}, {INT64_MAX}]", name
        )


def _oversized(value: Any, path: str) -> str | None:
    """The path of the first integer in value outside int64, else None."""
    if type(value) is int:
        return path if not INT64_MIN <= value <= INT64_MAX else None
    if isinstance(value, msgspec.Struct):
        items = ((f"{path}.{f}", getattr(value, f)) for f in value.__struct_fields__)
    elif isinstance(value, dict):
        items = ((f"{path}.{k}", v) for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for sub_path, sub in items:
        found = _oversized(sub, sub_path)
        if found is not None:
            return found
    return None
