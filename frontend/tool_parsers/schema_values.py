"""Parameter values written as plain text (Qwen3-Coder's <parameter=p>value</parameter>)
turned into JSON values by the type the tool's JSON schema gives the parameter, by vLLM's
qwen3_coder rules: strings stay as written; integers, numbers and booleans are parsed (a value
that does not parse stays a string); objects and arrays are JSON or Python literals; null or
None is null where the type is not a string; a parameter the schema does not name is a
string."""

from __future__ import annotations

import json
import math
from typing import Any

from frontend.tool_parsers.python_literals import NotALiteral, literal_value

_STRING_TYPES = frozenset({"string", "str", "text", "varchar", "char", "enum"})
_INTEGER_PREFIXES = ("int", "uint", "long", "short", "unsigned")
_NULLS = ("null", "none")


def parameter_type(schema: Any) -> tuple[str, bool]:
    """A parameter schema's type name (the first that is not null) and whether null is allowed."""
    if not isinstance(schema, dict):
        return "string", False
    types: list[Any] = []
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    elif isinstance(schema.get("anyOf"), list):
        types = [o.get("type") for o in schema["anyOf"] if isinstance(o, dict) and "type" in o]
    names = [str(t).strip().lower() for t in types]
    kinds = [t for t in names if t != "null"]
    return (kinds[0] if kinds else "null" if names else "string"), "null" in names


def is_plain_string(schema: Any) -> bool:
    """Whether every text is its own value (a string type that is not nullable, or a parameter
    the tool does not name): such a value can be sent before it ends."""
    if schema is None:
        return True
    kind, nullable = parameter_type(schema)
    return kind in _STRING_TYPES and not nullable


def convert_value(text: str, schema: Any) -> Any:
    """The JSON value of a parameter written as text, by its schema (None: not in the tool)."""
    if schema is None:
        return text
    kind, nullable = parameter_type(schema)
    if nullable and text.lower() in _NULLS:
        return None
    if kind in _STRING_TYPES:
        return text
    if text.lower() in _NULLS:
        return None
    if kind.startswith(_INTEGER_PREFIXES):
        try:
            return int(text)
        except ValueError:
            return text
    if kind.startswith(("num", "float")):
        try:
            number = float(text)
        except ValueError:
            return text
        if not math.isfinite(number):
            return text
        return int(number) if number.is_integer() else number
    if kind in ("boolean", "bool", "binary"):
        return text.lower() == "true"
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:
            return json.loads(text)
        except ValueError:
            pass
    try:
        return literal_value(text)
    except NotALiteral:
        return text
