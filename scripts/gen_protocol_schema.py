"""Write docs/protocol.schema.json, the JSON Schema of the engine core wire protocol.

Usage: python scripts/gen_protocol_schema.py   (tests/test_protocol_schema.py checks it is current)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from protocol.engine_core import OUTPUT_PAYLOADS, PROTOCOL_VERSION, REQUEST_PAYLOADS, RequestType
from protocol.frames import ARRAY_EXT_CODE, WIRE_DTYPES, WireArray

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "docs" / "protocol.schema.json"


def build_schema() -> dict[str, Any]:
    """The schema: each message type's byte and payload, and the Structs as $defs."""
    kinds = [*REQUEST_PAYLOADS.items(), *OUTPUT_PAYLOADS.items()]
    payloads, defs = msgspec.json.schema_components(
        [p for _, p in kinds], schema_hook=_array_schema, ref_template="#/$defs/{name}"
    )
    messages: dict[str, dict[str, Any]] = {"client_to_engine": {}, "engine_to_client": {}}
    for (kind, _), payload in zip(kinds, payloads):
        side = "client_to_engine" if isinstance(kind, RequestType) else "engine_to_client"
        messages[side][kind.name] = {"type_byte": int(kind), "payload": payload}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "Engine core wire protocol",
        "description": "Frames are [type byte, msgpack payload, buffer frames...]; array_like "
        "Structs travel as msgpack arrays in field order, trailing defaults "
        "omitted. See docs/protocol.md.",
        "protocol_version": PROTOCOL_VERSION,
        "messages": messages,
        "$defs": defs,
    }


def _array_schema(type_: Any) -> dict[str, Any]:
    """A WireArray field: its list form, or the array Ext that JSON Schema cannot express."""
    if not (isinstance(type_, type) and issubclass(type_, WireArray)):
        raise NotImplementedError(f"no schema for {type_}")
    dtypes = [name for name, dtype in WIRE_DTYPES.items() if np.issubdtype(dtype, type_.kind)]
    return {
        **msgspec.json.schema(type_.list_type),
        "description": f"or msgpack Ext {ARRAY_EXT_CODE} [dtype, shape, buffer index] naming "
        f"an extra frame: {type_.ndim}-dimensional, dtype "
        f"{' or '.join(dtypes)}",
    }


def render() -> str:
    """The schema file's text."""
    return json.dumps(build_schema(), indent=2) + "\n"


if __name__ == "__main__":
    SCHEMA_PATH.write_text(render())
    print(f"wrote {SCHEMA_PATH}")
