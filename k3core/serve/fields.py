"""The JSON field readers of the OpenAI request parsers (`k3core.serve.protocol`) and the error they raise: a
missing or null field takes its default, a wrong type or an out-of-range value becomes an `APIError` naming the
field.
"""
from __future__ import annotations

import math
from typing import Any


class APIError(Exception):
    """An error returned to the client in the OpenAI envelope `{"error": {message, type, param, code}}`."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.type = message, status, param, code, type
        self.headers = headers or {}           # e.g. Retry-After on a 429

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


MISSING = object()


def type_error(name: str, want: str, value: Any) -> APIError:
    return APIError(f"'{name}' must be {want}, got {type(value).__name__} {value!r:.60}", param=name,
                    code="invalid_type")


def int_field(body: dict, name: str, default: Any, low: int | None = None, high: int | None = None) -> Any:
    value = body.get(name, MISSING)
    if value is MISSING or value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise type_error(name, "an integer", value)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"between {low} and {high}"
        raise APIError(f"'{name}' must be {bounds}, got {value}", param=name, code="invalid_value")
    return value


def float_field(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(name, MISSING)
    if value is MISSING or value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise type_error(name, "a number", value)
    if not math.isfinite(value) or value > high or value < low or (low_open and value == low):
        raise APIError(f"'{name}' must be in {'(' if low_open else '['}{low}, {high}], got {value}", param=name,
                       code="invalid_value")
    return float(value)


def bool_field(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, MISSING)
    if value is MISSING or value is None:
        return default
    if not isinstance(value, bool):
        raise type_error(name, "a boolean", value)
    return value


def int_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in value):
        raise type_error(name, "a list of integers", value)
    return list(value)
