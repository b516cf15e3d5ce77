"""Parsing constraints into grammars, their keys, and the errors a bad one gets."""

from __future__ import annotations

import msgspec
import pytest

from engine_core.structured_output.grammar import check_grammar, choice_ebnf, grammar_key
from protocol.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    "params",
    [
        StructuredOutputsParams(json=SCHEMA),
        StructuredOutputsParams(json='{"type": "array", "items": {"type": "string"}}'),
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(regex=r"\d{3}-[a-z]+"),
        StructuredOutputsParams(choice=["yes", "no", 'quote " and \\ and \n newline', "ünïcode"]),
        StructuredOutputsParams(grammar='root ::= "x" | "y" digit\ndigit ::= [0-9]'),
        StructuredOutputsParams(grammar='start: "a" | "b"\n'),  # Lark
        StructuredOutputsParams(
            structural_tag={
                "type": "structural_tag",
                "triggers": ["<f>"],
                "structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}],
            }
        ),
        StructuredOutputsParams(
            structural_tag={
                "type": "structural_tag",
                "format": {"type": "const_string", "value": "hi"},
            }
        ),
    ],
)
def test_valid_constraints_parse(params):
    check_grammar(params)


@pytest.mark.parametrize(
    "params, match",
    [
        (
            StructuredOutputsParams(json='{"type": "object", bad'),
            "structured_outputs.json is not valid JSON",
        ),
        (StructuredOutputsParams(json="[1, 2]"), "must be a JSON object"),
        (
            StructuredOutputsParams(json={"type": "nonsense"}),
            r"invalid structured_outputs.json: .*nonsense",
        ),
        (StructuredOutputsParams(regex="(ab"), r"invalid structured_outputs.regex: .*parenthesis"),
        (StructuredOutputsParams(grammar="root ::= ("), "invalid structured_outputs.grammar"),
        (
            StructuredOutputsParams(structural_tag='{"format": 3}'),
            "invalid structured_outputs.structural_tag",
        ),
        (
            StructuredOutputsParams(json=SCHEMA, whitespace_pattern=" "),
            "whitespace_pattern is not supported",
        ),
    ],
)
def test_invalid_constraints_name_the_problem(params, match):
    with pytest.raises(ValueError, match=match) as info:
        check_grammar(params)
    assert ".cc:" not in str(info.value)  # xgrammar's source locations are stripped


@pytest.mark.parametrize("kwargs", [{}, {"regex": "a", "choice": ["b"]}, {"json_object": False}])
def test_exactly_one_kind(kwargs):
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(**kwargs)
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        StructuredOutputsParams(choice=[])


def test_keys_equal_for_equal_constraints_only():
    same = [
        StructuredOutputsParams(json=SCHEMA),
        StructuredOutputsParams(
            json={"required": ["a"], "type": "object", "properties": {"a": {"type": "integer"}}}
        ),
    ]
    assert grammar_key(same[0]) == grammar_key(same[1])
    different = [
        StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
        StructuredOutputsParams(json=SCHEMA, disable_additional_properties=True),
        StructuredOutputsParams(regex="a"),
        StructuredOutputsParams(grammar="a"),
        StructuredOutputsParams(choice=["a"]),
    ]
    keys = {grammar_key(p) for p in [same[0], *different]}
    assert len(keys) == 1 + len(different)


def test_choice_grammar_escapes():
    assert choice_ebnf(['a"b', "c"]) == 'root ::= "a\\"b" | "c"'


def test_sampling_params_carry_the_constraint_over_msgpack():
    params = SamplingParams(
        structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    )
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert back.structured_outputs == params.structured_outputs
    with pytest.raises(msgspec.ValidationError, match="exactly one of"):
        msgspec.msgpack.decode(
            msgspec.msgpack.encode({"structured_outputs": {}}), type=SamplingParams
        )
