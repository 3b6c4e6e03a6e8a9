"""The waiting queue: first in, first out, with retracted requests put back at the front, and removal of any
request (abort, finish) in O(1) whatever the queue's length.

A removed request stays in the deque as a stale entry and is skipped when it reaches the front (lazy deletion);
an entry is live only if the request's current ticket (`_tickets`) is the one stored with it, so a request that is
removed and queued again is never seen twice. Stale entries are dropped as the front passes them, and all of them
at once when they outnumber the live ones, so memory stays within twice the live length.
"""
from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator

from k3core.sched.request import Request


class WaitingQueue:
    def __init__(self) -> None:
        self._entries: deque[tuple[int, Request]] = deque()
        self._tickets: dict[int, int] = {}          # id(request) -> its live entry's ticket
        self._next = itertools.count()
        self.num_entry_visits = 0                   # entries looked at by the front (tests count the work)

    def append(self, request: Request) -> None:
        self._entries.append(self._ticket(request))

    def appendleft(self, request: Request) -> None:
        self._entries.appendleft(self._ticket(request))

    def _ticket(self, request: Request) -> tuple[int, Request]:
        if id(request) in self._tickets:
            raise ValueError(f"request {request.request_id} is already waiting")
        ticket = next(self._next)
        self._tickets[id(request)] = ticket
        return ticket, request

    def remove(self, request: Request) -> None:
        """O(1): forget the request; its entry is skipped later. Raises ValueError if it is not waiting."""
        if self._tickets.pop(id(request), None) is None:
            raise ValueError(f"request {request.request_id} is not waiting")
        if len(self._entries) > 2 * len(self._tickets) + 64:
            self._entries = deque(e for e in self._entries if self._live(e))

    def _live(self, entry: tuple[int, Request]) -> bool:
        return self._tickets.get(id(entry[1])) == entry[0]

    def _skip_stale(self) -> None:
        while self._entries:
            self.num_entry_visits += 1
            if self._live(self._entries[0]):
                return
            self._entries.popleft()

    def __getitem__(self, index: int) -> Request:
        if index != 0:
            raise IndexError("the waiting queue reads its front only")
        self._skip_stale()
        if not self._entries:
            raise IndexError("the waiting queue is empty")
        return self._entries[0][1]

    def popleft(self) -> Request:
        request = self[0]
        self._entries.popleft()
        del self._tickets[id(request)]
        return request

    def __contains__(self, request: object) -> bool:
        return id(request) in self._tickets

    def __len__(self) -> int:
        return len(self._tickets)

    def __bool__(self) -> bool:
        return bool(self._tickets)

    def __iter__(self) -> Iterator[Request]:
        return (request for entry in list(self._entries) if self._live(entry) for request in (entry[1],))
