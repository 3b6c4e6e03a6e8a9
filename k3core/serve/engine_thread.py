"""The engine loop on its own thread, and the thread-safe doors the HTTP side uses to reach it.

The engine is not thread-safe, so every engine call (construction, warm-up, add_request, step, abort, flush,
memory_usage) happens on this one thread. The HTTP side never waits on a step: it drops commands into a
`queue.Queue` and returns; the thread drains the queue between steps and hands each request's tokens to that
request's `sink` (a callable that must be safe to call from this thread: the server passes one that does
`loop.call_soon_threadsafe(queue.put_nowait, event)`).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from k3core.prompt_logprobs import PromptLogprobs
from k3core.sampling_params import SamplingParams
from k3core.serve.metrics import EngineSnapshot, ServerMetrics

log = logging.getLogger("k3core.serve")

IDLE_POLL_S = 0.05           # how long an idle loop blocks on the command queue before checking for stop
WARMUP_PROMPT = [1, 2, 3]


@dataclass(frozen=True)
class EngineEvent:
    """What one engine request produced in one step (or why it ended)."""
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]]
    finished: bool
    finish_reason: str | None = None        # "stop" | "length" | "abort"; "rejected" (bad request), "error"
    num_cached_tokens: int = 0
    error: str | None = None
    new_text: str = ""                      # the engine's text delta (k3core.stop: stop strings already cut)
    prompt_logprobs: PromptLogprobs | None = None    # with the request's first output, when asked for


@dataclass(frozen=True)
class ModelInfo:
    """Facts about the loaded model that never change after start-up, safe to read from any thread."""
    tokenizer: Any
    context_length: int
    vocab_size: int
    is_random: bool
    page_size: int
    slot_bytes: int
    page_bytes: int
    capacity_bytes: int
    prefix_cache: bool

    def max_request_tokens(self) -> int:
        """The most prompt + completion tokens one request may hold: the context, or what the pool can hold."""
        pages = max((self.capacity_bytes - self.slot_bytes) // max(self.page_bytes, 1), 0)
        return min(self.context_length, pages * self.page_size)


@dataclass
class _Submit:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sink: Callable[[EngineEvent], None]
    arrival: float
    observe: bool = True                    # False: left out of the request metrics (the server's HTTP warm-up)


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Flush:
    done: Future = field(default_factory=Future)
    rebase: bool = False                    # also restart the metrics' engine counters (after the HTTP warm-up)


@dataclass
class _Tracked:
    """Timing of one engine request, for the latency histograms."""
    sink: Callable[[EngineEvent], None]
    arrival: float
    num_prompt_tokens: int
    last_token_time: float | None = None
    num_text_chars: int = 0                 # characters of text already sent to the sink
    scheduled_time: float | None = None     # start of the first step that scheduled it (ends its queue time)
    num_generated: int = 0
    observe: bool = True                    # recorded in the request metrics

    def finish_metrics(self, now: float, finish_reason: str) -> tuple[float, str, float, int, int]:
        """observe_finish's arguments (e2e, reason, queue time, prompt and generated tokens); a request never
        scheduled waited all its life."""
        queued = (self.scheduled_time if self.scheduled_time is not None else now) - self.arrival
        return now - self.arrival, finish_reason, queued, self.num_prompt_tokens, self.num_generated


class EngineThread:
    def __init__(self, build_llm: Callable[[], Any], metrics: ServerMetrics, context_length: int | None = None):
        self._build_llm = build_llm
        self._context_cap = context_length
        self.metrics = metrics
        self.ready = threading.Event()             # set after warm-up (or on failure, with `error` set)
        self.error: str | None = None
        self.info: ModelInfo | None = None
        self.dead = threading.Event()              # set once the engine can no longer serve (`error` says why)
        # who reports a loop that stopped, if not `fail` here (the engine process: the server, which holds the sinks)
        self.on_loop_failure: Callable[[str], None] | None = None
        self._commands: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="k3core-engine", daemon=True)
        self._tracked: dict[str, _Tracked] = {}
        self._stats_base = (0, 0)
        self._steps_base = None                    # the engine's StepCounts after warm-up (the metrics count from it)
        self.idle_seconds = 0.0                    # the loop waited for commands with nothing to run
        self.step_seconds = 0.0                    # the loop ran engine steps
        # called once per loop iteration, after the step's events and the snapshot (the engine process sends
        # what they produced as one message there)
        self.after_iteration: Callable[[], None] | None = None

    # ---- the HTTP side's doors (any thread) ------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               sink: Callable[[EngineEvent], None], arrival: float, observe: bool = True) -> None:
        self._commands.put(_Submit(request_id, prompt_token_ids, params, sink, arrival, observe))

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def flush_cache(self, rebase: bool = False) -> Future:
        """A future that resolves (on the engine thread) to True once the prefix cache has been emptied. rebase:
        the engine counters the metrics export (prefix-cache lookups, steps, loop seconds) restart from here."""
        command = _Flush(rebase=rebase)
        self._commands.put(command)
        return command.done

    def fail(self, reason: str) -> None:
        """The engine cannot serve any more (a rank died, or its loop stopped): /health turns 503 and every
        request in flight ends with `reason`. Any thread; the first reason wins."""
        if self.dead.is_set():
            return
        self.error = reason
        self.metrics.ready = False
        self.dead.set()
        self.ready.set()
        for request_id, tracked in list(self._tracked.items()):
            self._tracked.pop(request_id, None)
            tracked.sink(EngineEvent([], [], True, "error", error=reason))

    # ---- the engine thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.llm = self._build_llm()
            self.engine = self.llm.engine
            self._warm_up()
        except Exception as exc:   # a bad checkpoint path or option must reach the user, not die silently
            self.error = f"{type(exc).__name__}: {exc}"
            log.error("engine failed to start: %s\n%s", self.error, traceback.format_exc())
            self.ready.set()
            return
        self.metrics.ready = True
        self.ready.set()
        try:
            while not self._stop.is_set():
                idle = not self.engine.has_work
                started = time.monotonic()
                self._drain_commands(block=idle)
                if idle:
                    self.idle_seconds += time.monotonic() - started
                if self.engine.has_work:
                    started = time.monotonic()
                    self._step()
                    self.step_seconds += time.monotonic() - started
                elif hasattr(self.engine, "keep_alive"):   # a DistributedEngine: idle followers must hear from it
                    self.engine.keep_alive()
                self._publish()
                if self.after_iteration is not None:
                    self.after_iteration()
        except BaseException as exc:   # e.g. RanksOutOfStep: the loop cannot go on; say so instead of dying mute
            reason = f"the engine loop stopped ({type(exc).__name__}: {exc})"
            if self.on_loop_failure is not None:
                self.on_loop_failure(reason)
            else:
                self.fail(reason)
            raise
        for request_id in list(self._tracked):
            self._abort(request_id)
        if hasattr(self.engine, "shutdown"):       # a DistributedEngine: release the follower ranks
            self.engine.shutdown()
        elif hasattr(self.engine, "close"):        # the decode graphs' scratch slot and page go back to the pool
            self.engine.close()

    def _warm_up(self) -> None:
        engine, config = self.engine, self.llm.config
        from k3core.sampling_params import SamplingParams
        # Every kernel specialisation a request can meet before /health says ready: Triton specialises integer
        # arguments by divisibility (1, multiples of 16, others), so warm up a full-budget prefill chunk and the
        # ragged chunk after it, short and one-token prompts, a batch of concurrent prefills and decodes, and a
        # sampled (not greedy) row with logprobs; the decode graphs were captured at start.
        budget = engine.chunked_prefill_tokens
        room = config.max_position_embeddings - 3
        # kernels also pick tiles by size class (MoE rows, KDA state programs, MLA blocks): powers of 4 up to it
        sizes = {1, len(WARMUP_PROMPT), 17, budget + 5, 2 * budget + 5}
        sizes.update(4 ** k for k in range(3, 12) if 4 ** k < budget)
        lengths = sorted({min(n, room) for n in sizes})
        params = [SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                  SamplingParams(max_tokens=2, temperature=0.8, top_p=0.9, top_k=8, seed=0, logprobs=2,
                                 ignore_eos=True)]
        ids = []
        for index, length in enumerate(lengths + [17, 17]):
            prompt = [(t * 7 + index) % config.vocab_size for t in range(1, length + 1)]
            ids.append(engine.add_request(prompt, params[index % 2], f"warmup-{index}"))
        engine.run_until_done(ids)
        self._rehearse(params[0], room)
        engine.flush_cache()                           # start with an empty pool and cache
        self._rebase_counters()
        layout = engine.pool.layout
        context = config.max_position_embeddings
        if self._context_cap is not None:
            context = min(context, self._context_cap)
        self.info = ModelInfo(self.llm.tokenizer, context, config.vocab_size, self.llm.is_random,
                              engine.options.page_size, layout.slot_bytes, layout.page_bytes,
                              # what requests may use: the decode graphs' scratch is the engine's own
                              engine.memory_usage().capacity_bytes - getattr(engine, "reserved_bytes", 0),
                              engine.cache is not None)
        self._publish()

    def _rehearse(self, params, room: int) -> None:
        """A short serving mix after the size classes: prompts admitted while others decode, several to a chunk
        (some starting, some continuing, lengths off every multiple of 16), split mixed steps with the decode
        graphs, and a prompt again whose prefix the cache holds. On the H200 the first pass of a 64-stream workload
        still compiled 7 KDA-state and conv kernels (about 7 s of JIT) after the size classes alone: which
        specialisation a step needs depends on how its chunks are packed (sequences per chunk, initial states,
        checkpoints, tensor alignment), and this is the packing serving produces."""
        engine, config = self.engine, self.llm.config
        budget = engine.chunked_prefill_tokens

        def prompt(length: int, salt: int) -> list[int]:
            return [(t * 11 + salt) % config.vocab_size for t in range(1, min(length, room) + 1)]
        decoding = SamplingParams(**{**vars(params), "max_tokens": 8})
        ids = [engine.add_request(prompt(17 + i, 100 + i), decoding, f"warmup-decode-{i}") for i in range(4)]
        engine.step()
        engine.step()                                  # the short ones decode from here on
        lengths = [budget // 2 - 4, budget // 2 + 3, budget // 3 + 1, budget + 7, 33, 5]
        ids += [engine.add_request(prompt(n, 200 + i), params, f"warmup-mixed-{i}") for i, n in enumerate(lengths)]
        engine.run_until_done(ids)
        again = [engine.add_request(prompt(budget + 7, 203) + [7, 8, 9], params, "warmup-cached"),
                 engine.add_request(prompt(21, 300), decoding, "warmup-beside-cached")]
        engine.run_until_done(again)

    def _rebase_counters(self) -> None:
        """The exported engine counters count from here (after a warm-up)."""
        engine = self.engine
        if engine.cache is not None:
            stats = engine.cache.stats
            self._stats_base = (stats.queried_tokens, stats.hit_tokens)
        self._steps_base = engine.step_counts.copy()
        self.idle_seconds = self.step_seconds = 0.0

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=IDLE_POLL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, command) -> None:
        if isinstance(command, _Submit):
            try:
                self.engine.add_request(command.prompt_token_ids, command.params, command.request_id)
            except ValueError as exc:
                command.sink(EngineEvent([], [], True, "rejected", error=str(exc)))
                return
            self._tracked[command.request_id] = _Tracked(command.sink, command.arrival,
                                                         len(command.prompt_token_ids), observe=command.observe)
        elif isinstance(command, _Abort):
            self._abort(command.request_id)
        elif isinstance(command, _Flush):
            flushed = self.engine.flush_cache()
            if command.rebase:
                self._rebase_counters()
            self._publish()                      # a /metrics read right after /flush_cache sees the empty pool
            command.done.set_result(flushed)

    def _abort(self, request_id: str) -> None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return                                          # already finished: nothing to free
        self.engine.abort(request_id)
        request = self.engine.requests.pop(request_id, None)
        rest = request.text[tracked.num_text_chars:] if request is not None else ""   # text held back until now
        if tracked.observe:
            self.metrics.observe_finish(*tracked.finish_metrics(time.monotonic(), "abort"))
        tracked.sink(EngineEvent([], [], True, "abort", new_text=rest))

    def _step(self) -> None:
        steps_before = self.engine.num_steps
        started = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as exc:    # keep serving: fail the requests of this batch, free their memory
            message = f"the engine failed while running a step ({type(exc).__name__}: {exc})"
            log.error("%s\n%s", message, traceback.format_exc())
            for request_id in list(self._tracked):
                tracked = self._tracked.pop(request_id)
                self.engine.abort(request_id)
                self.engine.requests.pop(request_id, None)
                tracked.sink(EngineEvent([], [], True, "error", error=message))
            return
        now = time.monotonic()
        for request in self.engine.scheduler.running:
            tracked = self._tracked.get(request.request_id)
            if tracked is not None and tracked.scheduled_time is None:
                tracked.scheduled_time = started
        for output in outputs:
            tracked = self._tracked.get(output.request_id)
            if tracked is None:
                continue
            request = self.engine.requests[output.request_id]
            if tracked.observe:
                if tracked.last_token_time is None:
                    self.metrics.observe_first_token(now - tracked.arrival, tracked.num_prompt_tokens)
                    self.metrics.observe_tokens(len(output.new_token_ids), None)
                else:
                    self.metrics.observe_tokens(len(output.new_token_ids), now - tracked.last_token_time)
            tracked.last_token_time = now
            tracked.num_text_chars += len(output.new_text)
            tracked.num_generated += len(output.new_token_ids)
            if tracked.scheduled_time is None:             # scheduled and finished within this step
                tracked.scheduled_time = started
            if output.finished:
                self._tracked.pop(output.request_id)
                self.engine.requests.pop(output.request_id, None)
                if tracked.observe:
                    self.metrics.observe_finish(*tracked.finish_metrics(now, output.finish_reason or "stop"))
            tracked.sink(EngineEvent(list(output.new_token_ids), list(output.new_logprobs), output.finished,
                                     output.finish_reason, request.num_cached_tokens, error=output.error,
                                     new_text=output.new_text, prompt_logprobs=output.prompt_logprobs))
        if self.engine.num_steps == steps_before:
            time.sleep(0.001)      # nothing could be scheduled (waiting on memory): do not spin a core

    def _publish(self) -> None:
        engine = self.engine
        steps = engine.step_counts
        if self._steps_base is not None:
            steps = steps.since(self._steps_base)
        usage = engine.memory_usage()
        queried = hit = cache_bytes = 0
        if engine.cache is not None:
            stats = engine.cache.stats
            queried, hit = stats.queried_tokens - self._stats_base[0], stats.hit_tokens - self._stats_base[1]
            layout = engine.pool.layout
            cache_bytes = (engine.cache.num_cached_slots * layout.slot_bytes
                           + engine.cache.num_cached_pages * layout.page_bytes)
        self.metrics.publish(EngineSnapshot(
            num_running=len(engine.scheduler.running), num_waiting=len(engine.scheduler.waiting),
            kda_bytes=usage.kda_bytes, mla_bytes=usage.mla_bytes, free_bytes=usage.free_bytes,
            capacity_bytes=usage.capacity_bytes, num_slots=usage.num_slots, num_pages=usage.num_pages,
            prefix_cache=engine.cache is not None, cache_queried_tokens=queried, cache_hit_tokens=hit,
            num_retractions=engine.scheduler.num_retractions, num_steps=engine.num_steps, cache_bytes=cache_bytes,
            num_prefill_steps=steps.prefill, num_mixed_steps=steps.mixed, num_decode_steps=steps.decode,
            num_decode_rows=steps.decode_rows, num_prefill_tokens=steps.prefill_tokens,
            num_graph_steps=steps.graph_steps, num_split_steps=steps.split_steps,
            idle_seconds=self.idle_seconds, step_seconds=self.step_seconds))
