"""Warm the HTTP path itself before /health turns 200: a few real requests through the server's own socket.

Why: the engine's warm-up (k3core.serve.engine_thread) compiles every kernel a request can meet, but it calls the
engine directly. The first request a client sends still paid a one-time ~100 ms on the H200 (3x its repeat's
TTFT) that no kernel explains: the first trip through uvicorn, FastAPI's routing and body parsing, the request
models, the chat template, the tokenizer on the HTTP side, the Submit to the engine process and the events back,
SSE framing. Rather than guess which, the server sends requests that take that whole path (a completion whole and
streamed, a chat completion streamed) to itself once the engine is ready and uvicorn listens, and only then says
ready.

The warm-up requests carry a per-process secret in `WARMUP_HEADER`, so that the routes leave them out of the
request metrics (a client cannot forge it); afterwards the engine's prefix cache is emptied and its counters are
rebased, so that /metrics and the cache start as the engine's own warm-up left them. A warm-up request that fails
with a server error is logged as a warning with its cause and the server still becomes ready (the error would
reach the first client too, and hiding the server would help nobody); a 4xx (e.g. a chat request to a model
without a chat template) is expected and counts as exercised.
"""
from __future__ import annotations

import hmac
import logging
import secrets
import threading
from dataclasses import dataclass, field

import httpx

log = logging.getLogger("k3core.serve")

WARMUP_HEADER = "x-k3core-warmup"
WARMUP_TIMEOUT_S = 300.0     # per request: a slow CPU model may take long over its first request
WARMUP_TEXT = "Warm up the serving path."


@dataclass
class HttpWarmup:
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    done: threading.Event = field(default_factory=threading.Event)

    def is_warmup(self, headers) -> bool:
        """Whether a request's headers carry this server's warm-up secret."""
        given = headers.get(WARMUP_HEADER)
        return given is not None and hmac.compare_digest(given.encode(), self.token.encode())

    def requests(self, model_name: str) -> list[tuple[str, dict]]:
        """(path, body) of each warm-up request."""
        completion = {"model": model_name, "prompt": WARMUP_TEXT, "max_tokens": 2, "temperature": 0}
        chat = {"model": model_name, "messages": [{"role": "user", "content": WARMUP_TEXT}], "max_tokens": 2,
                "temperature": 0}
        return [("/v1/completions", completion),
                ("/v1/completions", {**completion, "stream": True, "stream_options": {"include_usage": True}}),
                ("/v1/chat/completions", {**chat, "stream": True})]

    def run(self, base_url: str, model_name: str, api_key: str | None) -> list[str]:
        """Send the warm-up requests to the server at base_url; the problems (server errors), if any."""
        headers = {WARMUP_HEADER: self.token}
        if api_key is not None:
            headers["Authorization"] = f"Bearer {api_key}"
        problems = []
        with httpx.Client(base_url=base_url, headers=headers, timeout=WARMUP_TIMEOUT_S, trust_env=False) as client:
            for path, body in self.requests(model_name):
                kind = f"POST {path}" + (" (streamed)" if body.get("stream") else "")
                try:
                    with client.stream("POST", path, json=body) as response:
                        text = "".join(response.iter_text())
                except httpx.HTTPError as exc:
                    problems.append(f"{kind}: {type(exc).__name__}: {exc}")
                    continue
                if response.status_code >= 500 or (body.get("stream") and "data: [DONE]" not in text
                                                    and response.status_code == 200):
                    problems.append(f"{kind}: status {response.status_code}: {text[:300]}")
        return problems


def connect_url(host: str, port: int) -> str:
    """The URL to reach a server listening on (host, port) from this machine."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
