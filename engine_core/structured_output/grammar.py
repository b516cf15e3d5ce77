"""One request's constraint as an xgrammar Grammar: parsed (and so checked) without a tokenizer,
keyed so that equal constraints share one compile."""

from __future__ import annotations

import json
import re
from typing import Any

import xgrammar as xgr

from protocol.sampling_params import StructuredOutputsParams

# JSON constraints allow whitespace between tokens (as vLLM does by default), but at most this
# many characters in a row: pretty-printed JSON nested 7 deep at an indent of 4 still fits,
# while a model (a weak one especially) cannot spend its whole max_tokens on blank space.
MAX_WHITESPACE = 32

# xgrammar's messages start with a time and a C++ source location: "[12:00:00] /x/y.cc:83: ".
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def grammar_key(params: StructuredOutputsParams) -> str:
    """A canonical string for the constraint and the options that change its grammar."""
    kind = params.kind
    spec = getattr(params, kind)
    if isinstance(spec, str) and kind in ("json", "structural_tag"):
        try:  # the same schema, spelt differently, shares the compile
            spec = json.loads(spec)
        except json.JSONDecodeError:
            pass
    if not isinstance(spec, str):
        spec = json.dumps(spec, sort_keys=True, ensure_ascii=False)
    options = ""
    if kind in ("json", "json_object"):
        options = (
            f"ws={not params.disable_any_whitespace},"
            f"addl={not params.disable_additional_properties}"
        )
    return f"{kind}:{options}:{spec}"


def _schema(spec: str | dict[str, Any], what: str) -> dict[str, Any]:
    if isinstance(spec, dict):
        return spec
    try:
        schema = json.loads(spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"{what} must be a JSON object, got {type(schema).__name__}")
    return schema


def _no_additional_properties(schema: Any) -> Any:
    """vLLM's disable_additional_properties: every object schema gets additionalProperties
    false unless it says otherwise."""
    if isinstance(schema, dict):
        out = {k: _no_additional_properties(v) for k, v in schema.items()}
        if out.get("type") == "object" or "properties" in out:
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [_no_additional_properties(v) for v in schema]
    return schema


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar that matches exactly one of the strings."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _structural_tag(spec: str | dict[str, Any]) -> xgr.Grammar:
    tag = _schema(spec, "structural_tag")
    if "structures" in tag:  # vLLM's legacy form: begin / schema / end items and triggers
        items = [
            xgr.StructuralTagItem(
                begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"]
            )
            for s in tag["structures"]
        ]
        return xgr.Grammar.from_structural_tag(items, list(tag.get("triggers", [])))
    return xgr.Grammar.from_structural_tag(json.dumps(tag))


def build_grammar(params: StructuredOutputsParams) -> xgr.Grammar:
    """The constraint as a Grammar; ValueError naming the field and the problem when invalid."""
    kind = params.kind
    if params.whitespace_pattern is not None:
        raise ValueError(
            "structured_outputs.whitespace_pattern is not supported by this "
            "engine's grammar backend (xgrammar); use disable_any_whitespace"
        )
    any_ws = not params.disable_any_whitespace
    try:
        if kind == "json":
            schema = _schema(params.json, "structured_outputs.json")  # type: ignore[arg-type]
            if params.disable_additional_properties:
                schema = _no_additional_properties(schema)
            return xgr.Grammar.from_json_schema(
                json.dumps(schema), any_whitespace=any_ws, max_whitespace_cnt=MAX_WHITESPACE
            )
        if kind == "json_object":
            return xgr.Grammar.from_json_schema(
                '{"type": "object", "additionalProperties": true}',
                any_whitespace=any_ws,
                strict_mode=False,
                max_whitespace_cnt=MAX_WHITESPACE,
            )
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)  # type: ignore[arg-type]
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(params.choice))  # type: ignore[arg-type]
        if kind == "grammar":
            text = params.grammar
            assert text is not None
            if "::=" in text:
                return xgr.Grammar.from_ebnf(text)
            return xgr.Grammar.from_lark(text)
        return _structural_tag(params.structural_tag)  # type: ignore[arg-type]
    except ValueError:
        raise
    except (
        RuntimeError,
        TypeError,
        KeyError,
        xgr.InvalidJSONError,
        xgr.InvalidStructuralTagError,
    ) as e:
        lines = str(e).strip().splitlines()
        message = _LOCATION.sub("", lines[-1]) if lines else type(e).__name__
        raise ValueError(f"invalid structured_outputs.{kind}: {message}") from None


def check_grammar(params: StructuredOutputsParams) -> None:
    """Raise ValueError when the constraint cannot be compiled (frontends call this for a 400)."""
    build_grammar(params)
