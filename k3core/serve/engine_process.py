"""The engine in a process of its own, behind the same doors as `EngineThread`.

The HTTP process (FastAPI, JSON, SSE, chat rendering) and the engine loop (scheduling, batch building, sampling,
detokenisation and stop strings) would otherwise share one GIL: every JSON encode would delay a step. Here the
engine loop runs in a spawned child process (`_engine_main`, which drives an ordinary `EngineThread` there), and the
two sides exchange msgspec-encoded messages over two ZMQ PUSH/PULL sockets on private ipc paths:

    server -> engine   Submit, Abort, Flush, Stop
    engine -> server   Ready (model facts or the start-up error), Event (a request's step output), Observe (a
                       latency/token metric sample), Publish (pool and queue state), Flushed, Beat (alive),
                       Failed (the engine loop stopped: why, just before the process exits), Batch (what one
                       iteration of the engine loop produced: its Events, Observes and Publish in one message)

One Batch per loop iteration, not a message per request: at 64 running requests a step emits 64 events and 64
metric samples, and one encode and one send each would cost the engine loop about a millisecond of every step and
wake the server's receiver 129 times.

`EngineProcess` keeps each request's sink on the server side and calls it from its receiver thread. The receiver
also watches the child: if it exits, or stops sending its heartbeat for `heartbeat_timeout_s` while alive (wedged:
then it is killed), `error` says how, `dead` is set, `/health` answers 503, and every request still in flight ends
at once with a clear error instead of waiting forever. Under a parallel plan the child is rank 0 (the leader); the
follower ranks are watched by `k3core.serve.liveness.RankWatcher`, which calls `fail` when one dies or wedges.
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

import msgspec
import zmq

from k3core.prompt_logprobs import PromptLogprobs
from k3core.sampling_params import SamplingParams
from k3core.serve.engine_thread import EngineEvent, EngineThread, ModelInfo
from k3core.serve.metrics import EngineSnapshot, ServerMetrics

log = logging.getLogger("k3core.serve")

POLL_MS = 100                 # how often the receiver checks that the engine process is alive
PARENT_POLL_S = 0.2           # how often the engine process checks that the server process is alive
ORPHAN_GRACE_S = 10.0         # how long an orphaned engine may take to stop cleanly before it exits anyway
HEARTBEAT_S = 0.5             # how often the engine process says it is alive


# ---- messages ---------------------------------------------------------------------------------------------------
class Submit(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float
    observe: bool = True


class Abort(msgspec.Struct, tag=True):
    request_id: str


class Flush(msgspec.Struct, tag=True):
    token: int
    rebase: bool = False


class Stop(msgspec.Struct, tag=True):
    pass


class Ready(msgspec.Struct, tag=True):
    info: dict[str, int | bool] | None      # ModelInfo's fields but the tokenizer (the server loads its own copy)
    error: str | None


class Event(msgspec.Struct, tag=True):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]]
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    error: str | None
    new_text: str
    prompt_logprobs: PromptLogprobs | None = None


class Observe(msgspec.Struct, tag=True):
    name: str                   # a ServerMetrics.observe_* method
    args: list[Any]


class Publish(msgspec.Struct, tag=True):
    snapshot: EngineSnapshot


class Flushed(msgspec.Struct, tag=True):
    token: int
    result: bool


class Beat(msgspec.Struct, tag=True):
    pass


class Failed(msgspec.Struct, tag=True):
    reason: str


class Batch(msgspec.Struct, tag=True):
    messages: list[Event | Observe | Publish | Flushed]


ToEngine = Submit | Abort | Flush | Stop
FromEngine = Ready | Event | Observe | Publish | Flushed | Beat | Failed | Batch
OBSERVERS = ("observe_first_token", "observe_tokens", "observe_finish")


# ---- the engine side (child process) ----------------------------------------------------------------------------
class _ForwardingMetrics:
    """Stands in for ServerMetrics inside the engine process: every sample goes to the server's metrics."""

    def __init__(self, send: Callable[[FromEngine], None]):
        self._send = send
        self.ready = False

    def __getattr__(self, name: str):
        if name in OBSERVERS:
            return lambda *args: self._send(Observe(name, list(args)))
        raise AttributeError(name)

    def publish(self, snapshot: EngineSnapshot) -> None:
        self._send(Publish(snapshot))


def _engine_main(build_llm: Callable[[], Any], context_length: int | None, socket_dir: str, to_engine: str,
                 from_engine: str) -> None:
    """The child process: an EngineThread's loop on this process's main thread, fed from the command socket.
    `socket_dir` holds both sockets' files; the server removes it on a clean stop, this process if the server died."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # Ctrl-C reaches the whole group: the server sends Stop instead
    context = zmq.Context()
    out = context.socket(zmq.PUSH)
    out.connect(from_engine)
    inbox = context.socket(zmq.PULL)
    inbox.connect(to_engine)
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(ToEngine)
    out_lock = threading.Lock()

    def send(message: FromEngine) -> None:
        data = encoder.encode(message)
        with out_lock:                      # the engine loop and the command reader both send
            out.send(data)

    pending: list[Event | Observe | Publish | Flushed] = []
    pending_lock = threading.Lock()

    def emit(message: Event | Observe | Publish | Flushed) -> None:
        """Held until the engine loop's iteration ends (`flush`), in the order emitted: a Flushed goes out after the
        Publish of the emptied pool, whichever thread resolved the flush."""
        with pending_lock:
            pending.append(message)

    def flush() -> None:
        with pending_lock:
            messages = pending[:]
            pending.clear()
        if messages:
            send(messages[0] if len(messages) == 1 else Batch(messages))

    def loop_failed(reason: str) -> None:
        flush()                             # what the loop emitted before it stopped, then why it stopped
        send(Failed(reason))                # the server fails the requests, with the cause

    engine = EngineThread(build_llm, _ForwardingMetrics(emit), context_length=context_length)
    engine.on_loop_failure = loop_failed
    engine.after_iteration = flush

    def sink_for(request_id: str) -> Callable[[EngineEvent], None]:
        def sink(event: EngineEvent) -> None:
            emit(Event(request_id, event.new_token_ids, event.new_logprobs, event.finished, event.finish_reason,
                       event.num_cached_tokens, event.error, event.new_text, event.prompt_logprobs))
        return sink

    def read_commands() -> None:
        engine.ready.wait()
        while True:
            try:
                data = inbox.recv()
            except zmq.ZMQError:             # the socket closed: this process is leaving
                return
            command = decoder.decode(data)
            if isinstance(command, Submit):
                engine.submit(command.request_id, command.prompt_token_ids, command.params,
                              sink_for(command.request_id), command.arrival, command.observe)
            elif isinstance(command, Abort):
                engine.abort(command.request_id)
            elif isinstance(command, Flush):
                done = engine.flush_cache(command.rebase)
                done.add_done_callback(lambda f, token=command.token: emit(Flushed(token, bool(f.result()))))
            elif isinstance(command, Stop):
                engine._stop.set()
                return

    def report_ready() -> None:
        engine.ready.wait()
        info = engine.info
        facts = None if info is None else {f.name: getattr(info, f.name) for f in dataclasses.fields(info)
                                           if f.name != "tokenizer"}
        send(Ready(facts, engine.error))

    def watch_parent(parent: int) -> None:
        """The server may die without sending Stop (uvicorn re-raises SIGTERM after its shutdown): then stop the
        loop as Stop would (under a plan that releases the follower ranks), and leave in any case."""
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        log.warning("the server process is gone: stopping the engine")
        shutil.rmtree(socket_dir, ignore_errors=True)     # its owner cannot remove it any more (SIGKILL, os._exit)
        engine._stop.set()
        time.sleep(ORPHAN_GRACE_S)
        os._exit(1)

    def beat() -> None:
        while True:
            try:
                send(Beat())
            except zmq.ZMQError:             # the socket closed: this process is leaving
                return
            time.sleep(HEARTBEAT_S)

    threading.Thread(target=beat, name="k3core-engine-beat", daemon=True).start()
    threading.Thread(target=report_ready, name="k3core-engine-ready", daemon=True).start()
    threading.Thread(target=read_commands, name="k3core-engine-commands", daemon=True).start()
    threading.Thread(target=watch_parent, args=(os.getppid(),), name="k3core-engine-parent", daemon=True).start()
    try:
        engine._run()                       # returns once Stop arrives (or start-up failed)
    except BaseException:                   # the loop stopped (e.g. RanksOutOfStep) and sent Failed: let it leave
        out.close(linger=1000)
        raise
    flush()                                 # the aborts of the requests still running when Stop came
    if engine.error is not None:
        time.sleep(0.2)                     # let Ready(error) leave before the sockets close
    out.close(linger=1000)
    inbox.close(linger=0)
    context.term()


# ---- the server side --------------------------------------------------------------------------------------------
class EngineProcess:
    """EngineThread's interface (start, stop, submit, abort, flush_cache, ready, error, info), engine elsewhere.

    `load_tokenizer` runs in the server process once the engine is ready: the HTTP side renders chats and encodes
    prompts itself, with the same tokenizer files the engine loaded.
    """

    def __init__(self, build_llm: Callable[[], Any], metrics: ServerMetrics, load_tokenizer: Callable[[], Any],
                 context_length: int | None = None, heartbeat_timeout_s: float = 5.0):
        self.metrics = metrics
        self.ready = threading.Event()
        self.error: str | None = None
        self.info: ModelInfo | None = None
        self.dead = threading.Event()           # set once the engine can no longer serve (`error` says why)
        # what else broke when the engine process dies on its own (a rank lost under a plan): a reason, or None
        self.root_cause: Callable[[], str | None] | None = None
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._last_beat: float | None = None
        self._fatal_lock = threading.Lock()
        self._load_tokenizer = load_tokenizer
        self._dir = tempfile.mkdtemp(prefix="k3core-engine-")      # mode 0700: only this user reaches the sockets
        self._to_engine = f"ipc://{os.path.join(self._dir, 'to-engine')}"
        self._from_engine = f"ipc://{os.path.join(self._dir, 'from-engine')}"
        self._context = zmq.Context()
        self._out = self._context.socket(zmq.PUSH)
        self._out.bind(self._to_engine)
        self._in = self._context.socket(zmq.PULL)
        self._in.bind(self._from_engine)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromEngine)
        self._send_lock = threading.Lock()
        self._sinks: dict[str, Callable[[EngineEvent], None]] = {}
        self._flushes: dict[int, Future] = {}
        self._next_flush = 0
        self._stopping = False
        spawn = mp.get_context("spawn")
        self._process = spawn.Process(target=_engine_main, name="k3core-engine",
                                      args=(build_llm, context_length, self._dir, self._to_engine,
                                            self._from_engine))
        self._receiver = threading.Thread(target=self._receive, name="k3core-engine-receiver", daemon=True)

    @property
    def pid(self) -> int | None:
        return self._process.pid

    # ---- doors (any thread) -----------------------------------------------------------------------------
    def start(self) -> None:
        self._process.start()
        self._receiver.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        if self._process.is_alive():
            self._send(Stop())
            self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout)
        self._receiver.join(timeout)
        self._out.close(linger=0)
        self._in.close(linger=0)
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               sink: Callable[[EngineEvent], None], arrival: float, observe: bool = True) -> None:
        if self.error is not None:
            sink(EngineEvent([], [], True, "error", error=self.error))
            return
        self._sinks[request_id] = sink
        self._send(Submit(request_id, list(prompt_token_ids), params, arrival, observe))

    def abort(self, request_id: str) -> None:
        if self.error is None:
            self._send(Abort(request_id))

    def flush_cache(self, rebase: bool = False) -> Future:
        done: Future = Future()
        if self.error is not None:
            done.set_exception(RuntimeError(self.error))
            return done
        with self._send_lock:
            token = self._next_flush
            self._next_flush += 1
            self._flushes[token] = done
        self._send(Flush(token, rebase))
        return done

    def _send(self, message: ToEngine) -> None:
        data = self._encoder.encode(message)
        with self._send_lock:               # zmq sockets are not thread-safe
            self._out.send(data)

    # ---- the receiver thread --------------------------------------------------------------------------------
    def _receive(self) -> None:
        while True:
            if self._in.poll(POLL_MS):
                self._last_beat = time.monotonic()              # any message says the process is alive
                self._dispatch(self._decoder.decode(self._in.recv()))
                continue
            silent = None if self._last_beat is None else time.monotonic() - self._last_beat
            if silent is not None and silent > self.heartbeat_timeout_s and not self._stopping and \
                    self._process.is_alive():
                self.fail(f"the engine process (pid {self._process.pid}) sent no heartbeat for {silent:.1f} s "
                          f"(wedged: stopped or stuck; --rank-heartbeat-timeout {self.heartbeat_timeout_s:g})")
            if not self._process.is_alive():
                while self._in.poll(0):                         # what it sent before it went
                    self._dispatch(self._decoder.decode(self._in.recv()))
                if not self._stopping:
                    self._died()
                return

    def _dispatch(self, message: FromEngine) -> None:
        if isinstance(message, Batch):
            for part in message.messages:
                self._dispatch(part)
        elif isinstance(message, Event):
            sink = self._sinks.get(message.request_id)
            if sink is None:
                return
            if message.finished:
                del self._sinks[message.request_id]
            sink(EngineEvent(message.new_token_ids, message.new_logprobs, message.finished, message.finish_reason,
                             message.num_cached_tokens, message.error, message.new_text, message.prompt_logprobs))
        elif isinstance(message, Observe):
            getattr(self.metrics, message.name)(*message.args)
        elif isinstance(message, Publish):
            self.metrics.publish(message.snapshot)
        elif isinstance(message, Flushed):
            future = self._flushes.pop(message.token, None)
            if future is not None:
                future.set_result(message.result)
        elif isinstance(message, Ready):
            self._ready(message)
        elif isinstance(message, Failed):      # a lost rank, if any, is the cause of the loop's failure
            cause = self.root_cause() if self.root_cause is not None else None
            self._fatal(cause or message.reason)

    def _ready(self, message: Ready) -> None:
        if message.error is None:
            try:
                tokenizer = self._load_tokenizer()
            except Exception as exc:  # noqa: BLE001 (reported as the start-up error)
                message = Ready(None, f"the server could not load the tokenizer ({type(exc).__name__}: {exc})")
            else:
                self.info = ModelInfo(tokenizer=tokenizer, **message.info)
        self.error = message.error
        self.metrics.ready = self.error is None
        self.ready.set()

    def fail(self, reason: str) -> None:
        """Something the engine needs died or wedged (a rank, or the engine process itself): serve no more. The
        engine process is killed (it may be stuck in a collective with the lost rank). Any thread."""
        self._fatal(reason)
        if self._process.is_alive():
            self._process.kill()

    def _died(self) -> None:
        from k3core.serve.liveness import describe_exit
        cause = self.root_cause() if self.root_cause is not None else None
        self._fatal(cause or f"the engine process exited unexpectedly (pid {self._process.pid}, "
                             f"{describe_exit(self._process.exitcode)})")

    def _fatal(self, reason: str) -> None:
        with self._fatal_lock:
            if self.dead.is_set():
                return                          # the first reason is the root cause
            self.error = (f"{reason}; the server cannot serve requests until it is restarted"
                          if self.ready.is_set() else reason)
            self.dead.set()
        log.error("%s", self.error)
        self.metrics.ready = False
        self.ready.set()
        for request_id, sink in list(self._sinks.items()):
            self._sinks.pop(request_id, None)
            sink(EngineEvent([], [], True, "error", error=self.error))
        for future in self._flushes.values():
            future.set_exception(RuntimeError(self.error))
        self._flushes.clear()
