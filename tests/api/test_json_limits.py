"""frontend.json_limits: nesting depth counted on the raw body (brackets inside strings do not
count), and integers beyond 64 bits found wherever they are in a decoded request."""

from __future__ import annotations

import msgspec
import pytest

from frontend.errors import ApiError
from frontend.json_limits import MAX_JSON_DEPTH, check_depth, check_int64
from frontend.openai_protocol import ChatCompletionRequest


def test_depth_up_to_the_limit_passes_and_one_more_is_a_400_naming_the_field():
    check_depth(b'{"a": ' + b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1) + b"}")
    with pytest.raises(ApiError) as e:
        check_depth(b'{"x": 1, "a": ' + b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH + b"}")
    assert e.value.status == 400 and e.value.param == "a"


def test_brackets_in_strings_and_escapes_do_not_count():
    text = '"' + "[{" * 500 + '\\"' + "[" * 100 + '"'
    check_depth(b'{"prompt": ' + text.encode() + b"}")


def test_an_integer_beyond_64_bits_is_named_by_its_path():
    body = (
        b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": '
        b'{"k": [1, 18446744073709551616]}}'
    )
    req = msgspec.json.decode(body, type=ChatCompletionRequest)
    with pytest.raises(ApiError) as e:
        check_int64(body, req)
    assert e.value.param == "chat_template_kwargs.k[1]"
    fine = b'{"messages": [{"role": "user", "content": "9223372036854775807"}], "seed": -1}'
    check_int64(fine, msgspec.json.decode(fine, type=ChatCompletionRequest))
