"""The checked-in JSON Schema of the wire protocol matches the msgspec Structs."""

from __future__ import annotations

from scripts.gen_protocol_schema import SCHEMA_PATH, render


def test_protocol_schema_is_current():
    assert SCHEMA_PATH.read_text() == render(), (
        "docs/protocol.schema.json is stale: the wire protocol's Structs changed. "
        "Run `python scripts/gen_protocol_schema.py`, check docs/protocol.md, and bump "
        "PROTOCOL_VERSION if an older peer would misread the new messages."
    )
