"""Running one engine across the ranks of a plan: the leader decides, every rank steps.

Every rank holds an identical Engine (scheduler, radix cache, pool bookkeeping) and makes identical decisions
from identical inputs. The leader (global rank 0, which also serves HTTP) records the control operations it
receives (add, abort, flush) and broadcasts them before each step; followers apply the same operations in the
same order and step with it. Sampled tokens come from the last stage (ModelRunner.sample) so the request
states stay identical everywhere.

Failures: a request whose sampling raises on the sampler rank fails alone, on every rank at the same step (the
sampler rank broadcasts the failure with the tokens: `k3core.step_sample.sample_rows_apart`). Any other failure
inside a step leaves the ranks out of step (a peer waits in a collective that never comes): the leader raises
`RanksOutOfStep`, which ends its engine loop, and a follower exits (k3core.serve.ranks reports why); the server
then answers 503 and exits non-zero rather than serving from a broken world.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from k3core.engine import Engine, StepOutput
from k3core.sampling_params import SamplingParams


class RanksOutOfStep(BaseException):
    """The leader's step failed under a plan: the ranks cannot be trusted to be in step any more. Deliberately not
    an Exception, so that the engine loop's keep-serving handler (one process: fail the batch, go on) lets it
    through and the server stops."""


class LeaderLost(RuntimeError):
    """A follower's wait for the leader's next step failed: the leader went away without a shutdown message."""


@dataclass
class _Control:
    adds: list[tuple[list[int], dict, str]] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    flush: bool = False
    shutdown: bool = False


KEEPALIVE_S = 30.0       # an idle leader steps the followers this often (far below gloo's 30 / NCCL's 10 min)


class DistributedEngine:
    """The leader's view: the Engine API, with every state change mirrored to the followers."""

    def __init__(self, engine: Engine, comm, keepalive_s: float = KEEPALIVE_S):
        self.engine = engine
        self.comm = comm
        self.keepalive_s = keepalive_s
        self._pending = _Control()
        self._last_step = time.monotonic()

    def __getattr__(self, name: str) -> Any:          # read-only attributes (requests, scheduler, cache, ...)
        return getattr(self.engine, name)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        request_id = self.engine.add_request(prompt_token_ids, params, request_id)
        self._pending.adds.append((list(prompt_token_ids), vars(params).copy(), request_id))
        return request_id

    def abort(self, request_id: str) -> bool:
        done = self.engine.abort(request_id)
        if done:
            self._pending.aborts.append(request_id)
        return done

    def flush_cache(self) -> bool:
        self._pending.flush = True
        return self.engine.flush_cache()

    def keep_alive(self) -> None:
        """Call while idle: a follower waits for the next step inside a collective, which the backend times out
        (the process group's timeout: 30 min on gloo, 10 on NCCL by default), so step them, idle, now and then."""
        if time.monotonic() - self._last_step >= self.keepalive_s:
            self.step()

    def step(self) -> list[StepOutput]:
        self._last_step = time.monotonic()
        try:
            self._broadcast()
            return self.engine.step()
        except Exception as exc:
            raise RanksOutOfStep(f"rank 0's step failed under the parallel plan ({type(exc).__name__}: {exc}); "
                                 "the ranks are out of step, restart the server") from exc

    def run_until_done(self, request_ids: list[str], use_tqdm: bool = False) -> dict:
        """Engine.run_until_done, stepping through this wrapper so the followers step too."""
        return Engine.run_until_done(self, request_ids, use_tqdm)  # type: ignore[arg-type]

    def shutdown(self) -> None:
        self._pending.shutdown = True
        self._broadcast()

    def _broadcast(self) -> None:
        control, self._pending = self._pending, _Control()
        self.comm.broadcast_object(control, src=0)


def follow(engine: Engine, comm) -> None:
    """A follower's loop: apply the leader's operations, then step, until the leader shuts down."""
    while True:
        try:
            control: _Control = comm.broadcast_object(None, src=0)
        except RuntimeError as exc:                  # gloo / NCCL: the peer closed the connection
            raise LeaderLost(str(exc)) from exc
        for prompt, params, request_id in control.adds:
            engine.add_request(prompt, SamplingParams(**params), request_id)
        for request_id in control.aborts:
            engine.abort(request_id)
        if control.flush:
            engine.flush_cache()
        if control.shutdown:
            return
        for output in engine.step():
            if output.finished:                       # the leader forgets finished requests; so do we
                engine.requests.pop(output.request_id, None)
        for request_id in control.aborts:
            engine.requests.pop(request_id, None)
