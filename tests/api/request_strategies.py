"""Hypothesis strategies for request bodies, derived from the msgspec request schemas
(frontend.openai_protocol): each field gets a value of its declared type (edge values
included), now and then a value of any JSON type instead, and now and then an unknown field."""

from __future__ import annotations

from typing import Any

import msgspec.inspect as mi
from hypothesis import strategies as st

# Integers at and beyond every range the server checks.
EDGE_INTS = [
    -(2**70),
    -(2**64),
    -(2**63) - 1,
    -(2**63),
    -1,
    0,
    1,
    2,
    2**31,
    2**63 - 1,
    2**63,
    2**64,
    2**70,
]
# Fields that make a valid request costly when large: only small or out-of-range values.
SIZE_FIELDS = {
    "max_tokens",
    "max_completion_tokens",
    "n",
    "min_tokens",
    "best_of",
    "top_logprobs",
    "logprobs",
    "prompt_logprobs",
    "truncate_prompt_tokens",
}
SIZE_VALUES = [-(2**70), -1, 0, 1, 2, 2**31, 2**63, 2**70]

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from(EDGE_INTS)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)

_NAMED = {  # fields whose useful values are few
    "model": st.just("tiny"),
    "role": st.sampled_from(["system", "user", "assistant", "tool", "developer"]),
    "type": st.sampled_from(["text", "function", "image_url"]),
}


def _typed(info: mi.Type, name: str | None, depth: int, junk: bool) -> st.SearchStrategy[Any]:
    """Values of the declared type."""
    if name in SIZE_FIELDS and isinstance(info, (mi.IntType, mi.UnionType)):
        return st.sampled_from(SIZE_VALUES) | st.none()
    if name in _NAMED and isinstance(info, mi.StrType):
        return _NAMED[name]
    if isinstance(info, mi.IntType):
        return st.integers(-3, 300) | st.sampled_from(EDGE_INTS)
    if isinstance(info, mi.FloatType):
        return st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from(
            [0.0, -0.0, 1e308, -1e308, 1e-320, 0.5, 2.0, -1.0]
        )
    if isinstance(info, mi.StrType):
        return st.text(max_size=30)
    if isinstance(info, mi.BoolType):
        return st.booleans()
    if isinstance(info, mi.NoneType):
        return st.none()
    if isinstance(info, mi.ListType):
        return st.lists(field_values(info.item_type, None, depth + 1, junk), max_size=4)
    if isinstance(info, mi.DictType):
        return st.dictionaries(
            st.text(max_size=8),  # JSON's keys are strings
            field_values(info.value_type, None, depth + 1, junk),
            max_size=3,
        )
    if isinstance(info, mi.UnionType):
        return st.one_of([_typed(t, name, depth, junk) for t in info.types])
    if isinstance(info, mi.StructType):
        return struct_bodies(info, depth + 1, junk)
    return json_values


def field_values(info: mi.Type, name: str | None, depth: int, junk: bool) -> st.SearchStrategy[Any]:
    """A field's value of its declared type; with junk, any JSON value one time in five."""
    if depth > 4:
        return json_values
    typed = _typed(info, name, depth, junk)
    return st.one_of(typed, typed, typed, typed, json_values) if junk else typed


def struct_bodies(info: mi.StructType, depth: int, junk: bool) -> st.SearchStrategy[dict]:
    """A JSON object for a msgspec Struct: its required fields, a few of its optional ones
    and its tag; with junk, a required field now and then left out and an unknown one added."""
    values = {f.encode_name: field_values(f.type, f.name, depth, junk) for f in info.fields}
    required = [f.encode_name for f in info.fields if f.required]
    optional = [f.encode_name for f in info.fields if not f.required]
    config = info.cls.__struct_config__

    @st.composite
    def bodies(draw) -> dict:
        body = {
            name: draw(values[name])
            for name in required
            if not junk or draw(st.integers(0, 19)) != 0
        }
        if optional:  # a few fields at a time: cheap to draw, and most bodies stay valid-ish
            for name in draw(st.lists(st.sampled_from(optional), max_size=5, unique=True)):
                body[name] = draw(values[name])
        if config.tag_field is not None:
            body[config.tag_field] = config.tag
        if junk and draw(st.integers(0, 19)) == 0:
            body[draw(st.sampled_from(["frobnicate", "extra", "x"]))] = draw(json_values)
        return body

    return bodies()


def request_bodies(struct: type) -> st.SearchStrategy[Any]:
    """Bodies for a request Struct: schema-derived objects (four in ten of the declared types,
    five in ten with junk among them), any JSON value otherwise."""
    info = mi.type_info(struct)
    clean, mutated = struct_bodies(info, 0, False), struct_bodies(info, 0, True)
    return st.one_of(*[clean] * 4, *[mutated] * 5, json_values)
