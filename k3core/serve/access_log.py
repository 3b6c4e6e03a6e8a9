"""One access-log line per HTTP request on the logger `k3core.serve.access`, and one more with the reason for every
response of status 400 or above (WARNING for 4xx, ERROR for 5xx; INFO for /health, which a readiness probe polls
through the warm-up).

    127.0.0.1:50312 "POST /v1/completions" 200 prompt_tokens=5 completion_tokens=16 latency_ms=41.7
    127.0.0.1:50312 "POST /v1/completions" 400: 'echo' is not supported; ...

The line is written when the response has been sent in full: for a stream, when its last event has left (or the
client went away), so the token counts and the latency cover the whole stream. Routes leave what the line needs in
the request's state with `note_usage` and `note_error`; a request that ends in an uncaught exception is logged as
a 500 with the exception, then re-raised to the server's error handler. `--disable-log-requests` turns off the
per-request lines; the error lines stay (lower them with `--log-level error`).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

log = logging.getLogger("k3core.serve.access")

_USAGE = "k3core_usage"          # keys in the ASGI scope's "state" dict (what `request.state` reads and writes)
_ERROR = "k3core_error"


def _state(request_or_scope: Any) -> dict:
    scope = getattr(request_or_scope, "scope", request_or_scope)
    return scope.setdefault("state", {})


def note_usage(request: Any, usage: Callable[[], Any]) -> None:
    """`usage()` returns an object with prompt_tokens and completion_tokens; it is called when the response ends."""
    _state(request)[_USAGE] = usage


def note_error(request: Any, message: str) -> None:
    """The reason the response has an error status, as the client reads it."""
    _state(request)[_ERROR] = message


class AccessLogMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware), so that streamed bodies pass through untouched and unbuffered."""

    def __init__(self, app, log_requests: bool = True):
        self.app = app
        self.log_requests = log_requests

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        status: list[int] = []
        logged = False

        def write(code: int, note: str | None) -> None:
            nonlocal logged
            if not logged:
                logged = True
                self._write(scope, code, started, note)

        async def send_and_watch(message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                write(status[0], None)

        try:
            await self.app(scope, receive, send_and_watch)
        except Exception as exc:
            if status:                                      # a stream broke after its headers left
                write(status[0], f"failed mid-response: {type(exc).__name__}: {exc}")
            else:                                           # the server's handler answers 500
                note_error(scope, f"internal server error ({type(exc).__name__}: {exc})")
                write(500, None)
            raise
        finally:
            write(status[0] if status else 499, "client disconnected")   # left before the last byte

    def _write(self, scope, status: int, started: float, note: str | None) -> None:
        client = scope.get("client")
        where = f"{client[0]}:{client[1]}" if client else "-"
        request = f'"{scope.get("method", "-")} {scope.get("path", "-")}"'
        state = scope.get("state") or {}
        if self.log_requests:
            fields = [where, request, str(status)]
            usage = state.get(_USAGE)
            if usage is not None:
                counts = usage()
                fields += [f"prompt_tokens={counts.prompt_tokens}", f"completion_tokens={counts.completion_tokens}"]
            fields.append(f"latency_ms={(time.monotonic() - started) * 1000:.1f}")
            if note is not None:
                fields.append(f"({note})")
            log.info("%s", " ".join(fields))
        if status >= 400:
            reason = state.get(_ERROR) or ("the client disconnected before the response" if status == 499
                                           else "no reason recorded")
            level = logging.ERROR if status >= 500 else logging.WARNING
            if scope.get("path") == "/health":
                level = logging.INFO            # a readiness probe polling through the warm-up is no error
            log.log(level, "%s %s %d: %s", where, request, status, reason)
