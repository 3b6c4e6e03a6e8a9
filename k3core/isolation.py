"""Step isolation: a failure while running one request's work fails that request only.

A step batches many requests, so an exception in its forward pass or its sampler (a kernel fault on one row, a
bug one request's parameters reach) says nothing about which request caused it. The engine then:

1. rolls the step back for every request in it (and in the step still in flight): tokens not yet read are
   dropped, memory is released and the request is requeued at the front to recompute its sequence (a retraction;
   seeded and greedy draws depend on the sequence and position only, so the tokens come out the same), and the
   sampler's penalty counts are rebuilt from the tokens the request really has;
2. marks those requests suspects (`Quarantine`). Until a suspect has sampled a token again it runs in a step of
   its own (steps are not overlapped meanwhile), so a failure then has one culprit, which is failed with the
   error; suspects that sample cleanly are cleared and batch with the others again.

A failure while emitting one request's token on the host (detokenising, stop strings) names its request
directly: that request alone is failed (`Engine._process`).
"""
from __future__ import annotations

from collections.abc import Iterable

from k3core.sched.request import Request, Status
from k3core.sched.scheduler import ScheduledChunk
from k3core.step_output import drop_unresolved


class Quarantine:
    """Request ids suspected of failing a step; each runs alone until it has sampled once."""

    def __init__(self) -> None:
        self.suspects: set[str] = set()
        self.num_failures = 0           # steps that failed and were rolled back
        self.num_solo_steps = 0         # steps that ran one suspect alone

    @property
    def active(self) -> bool:
        return bool(self.suspects)

    def select(self, chunks: list[ScheduledChunk], scheduler) -> list[ScheduledChunk]:
        """The chunks to run this step: all of them without suspects among them, else the first suspect's alone
        (the others are handed back to the scheduler, to be scheduled again next step)."""
        suspect = next((c for c in chunks if c.request.request_id in self.suspects), None)
        if suspect is None:
            return chunks
        for chunk in chunks:
            if chunk is not suspect:
                scheduler.unschedule(chunk)
        self.num_solo_steps += 1
        return [suspect]

    def cleared(self, request_id: str) -> None:
        """The request sampled a token: it was not the culprit."""
        self.suspects.discard(request_id)


def roll_back(engine, requests: Iterable[Request]) -> list[Request]:
    """Undo a failed step for these requests (see the module docstring); returns those rolled back."""
    rolled = []
    unique = {id(r): r for r in requests if not r.is_finished}
    for request in sorted(unique.values(), key=lambda r: r.arrival, reverse=True):   # earliest ends up in front
        drop_unresolved(request)
        if request.status == Status.RUNNING:
            engine.scheduler.retract(request)
        engine.sampler.recount(request.request_id, request.prompt_token_ids, request.output_token_ids)
        rolled.append(request)
    return rolled
