"""How much work the server holds at once: engine requests (choices) and their prompt tokens, running or waiting.

A request that would take the server past `--max-queued-requests` or `--max-queued-tokens` is answered 429 with
`Retry-After` before anything is tokenized for the engine or submitted, so a flood costs the server a counter
check per request, not memory. Lives on the event loop (no locks); each admitted request holds a `Ticket` that it
releases exactly once (when its generation ends, or when the response object is dropped unsent).
"""
from __future__ import annotations

from dataclasses import dataclass

from k3core.serve.protocol import APIError

RETRY_AFTER_S = 1


@dataclass
class Ticket:
    admission: "Admission"
    num_requests: int
    num_tokens: int
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.admission.num_requests -= self.num_requests
            self.admission.num_tokens -= self.num_tokens


class Admission:
    def __init__(self, max_requests: int, max_tokens: int):
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.num_requests = 0              # engine requests admitted and not released
        self.num_tokens = 0                # their prompt tokens

    def admit(self, num_requests: int, num_tokens: int) -> Ticket:
        """A ticket for this much work, or APIError 429 when the server holds too much already."""
        if num_tokens > self.max_tokens or num_requests > self.max_requests:
            raise APIError(f"the request has {num_requests} choices of {num_tokens} prompt tokens in all, more than "
                           f"the server takes at once ({self.max_requests} requests, {self.max_tokens} tokens: "
                           f"--max-queued-requests, --max-queued-tokens); send fewer", code="request_too_large")
        if self.num_requests + num_requests > self.max_requests:
            raise self._busy(f"the server holds {self.num_requests} requests and takes at most {self.max_requests} "
                             f"(--max-queued-requests)")
        if self.num_tokens + num_tokens > self.max_tokens:
            raise self._busy(f"the server holds {self.num_tokens} prompt tokens and takes at most {self.max_tokens} "
                             f"(--max-queued-tokens)")
        self.num_requests += num_requests
        self.num_tokens += num_tokens
        return Ticket(self, num_requests, num_tokens)

    @staticmethod
    def _busy(reason: str) -> APIError:
        return APIError(f"{reason}; retry after {RETRY_AFTER_S} s", status=429, type="rate_limit_error",
                        code="server_busy", headers={"Retry-After": str(RETRY_AFTER_S)})
