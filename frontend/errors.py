"""Errors of the HTTP API servers, in OpenAI's shape:
{"error": {"message", "type", "param", "code"}} with the HTTP status as code."""

from __future__ import annotations

import re

import msgspec
from aiohttp import web

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestEntityTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class ApiError(Exception):
    """A request the API server refuses; param names the offending field when there is one,
    headers go with the response (e.g. a 503's Retry-After)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """The JSON object of an error response."""
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "Error"),
            "param": param,
            "code": status,
        }
    }


def error_response(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        status=status,
        body=msgspec.json.encode(error_body(status, message, param)),
        content_type="application/json",
        headers=headers,
    )


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


_PATH = re.compile(r" - at `\$((?:\.[A-Za-z_]\w*|\[\d+\])*)`$")
_UNKNOWN = re.compile(r"Object contains unknown field `([^`]+)`")
_MISSING = re.compile(r"Object missing required field `([^`]+)`")


def from_decode_error(e: msgspec.MsgspecError) -> ApiError:
    """A 400 for a body msgspec could not decode, naming the field (e.g. `messages[0].role`)."""
    text = str(e)
    param = None
    m = _PATH.search(text)
    if m and m.group(1):
        param = m.group(1).lstrip(".")
    u = _UNKNOWN.search(text)
    if u:
        field = u.group(1)
        param = f"{param}.{field}" if param else field
        return ApiError(
            400, f"unsupported field `{param}`: this server does not implement it", param
        )
    missing = _MISSING.search(text)
    if missing:
        param = f"{param}.{missing.group(1)}" if param else missing.group(1)
    if isinstance(e, msgspec.DecodeError) and not isinstance(e, msgspec.ValidationError):
        return ApiError(400, f"the request body is not valid JSON: {text}")
    return ApiError(400, f"invalid request: {text}", param)
