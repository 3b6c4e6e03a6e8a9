"""uvicorn's h11 protocol with a deadline on the request line and headers (uvicorn has none).

Without it a client that sends one header byte every few seconds (slowloris) holds its connection open for ever;
enough of them exhaust the server's file descriptors. The deadline starts when the connection opens and again
when a response completes (keep-alive: the next request's headers are due), and stops when the headers of a
request are in. The body has its own deadline (`--body-read-timeout`, in `k3core.serve.body`).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("k3core.serve")


def h11_with_header_timeout(header_timeout_s: float) -> type[H11Protocol]:
    """An H11Protocol class (uvicorn.Config(http=...)) that closes connections slow to send their headers."""

    class HeaderTimeoutH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:                 # a request's headers are in: it runs now
                self._disarm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self._arm_header_timer()

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_too_slow)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.cycle is not None and not self.cycle.response_complete:
                return                                  # a request is being served (pipelined headers came in)
            if not self.transport.is_closing():
                log.info("closing a connection that did not send its request headers within %g s "
                         "(--header-read-timeout)", header_timeout_s)
                self.transport.close()

    return HeaderTimeoutH11Protocol
