"""Put the pieces together: the engine (a process of its own, or a thread with --engine-in-process), the FastAPI
app and a uvicorn server, ready to run.

`python -m k3core.serve` runs `Server.run()` in the main thread; tests run it in a background thread on a socket
they bound themselves (`sockets=[...]`), then call `shutdown()`.
"""
from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass

import uvicorn

from k3core.serve.app import create_app
from k3core.serve.args import ServerArgs
from k3core.serve.engine_process import EngineProcess
from k3core.serve.engine_thread import EngineThread
from k3core.serve.http_protocol import h11_with_header_timeout
from k3core.serve.http_warmup import HttpWarmup, connect_url
from k3core.serve.liveness import RankWatcher
from k3core.serve.metrics import ServerMetrics

log = logging.getLogger("k3core.serve")

EXIT_START_FAILED = 1          # the engine could not start (bad model path, option, ...)
EXIT_ENGINE_DIED = 3           # the engine process or a rank died or wedged while serving: restart the server
EXIT_GRACE_S = 5.0             # after such a failure, /health answers 503 this long before the server exits


def _build_llm(args: ServerArgs):
    from k3core.llm import LLM
    # Oversubscribed intra-op threads spin against the engine's own thread, the HTTP side and anything else on the
    # box: on 2 busy cores, 2 threads decoded k3-tiny >10x slower than 1; beside a GPU see k3core.host_threads
    return LLM(args.model, backend=args.backend, device=args.resolved_device(), dtype=args.resolved_dtype(),
               seed=args.seed, expert_format=args.expert_format, cpu_threads=args.resolved_cpu_threads(),
               **args.engine_options())


def _load_tokenizer(model: str):
    """The tokenizer the engine process loads too, for the HTTP side's own encoding and chat rendering."""
    from k3core.config import load_config, resolve_model
    from k3core.tokenizer import load_tokenizer
    return load_tokenizer(resolve_model(model), load_config(model))


def _end_node(reason: str) -> None:
    log.error("this node lost a rank (%s): exiting with code %d", reason, EXIT_ENGINE_DIED)
    os._exit(EXIT_ENGINE_DIED)             # the main thread may be stuck in a collective with the lost rank


@dataclass
class Server:
    args: ServerArgs
    engine: EngineThread | EngineProcess
    metrics: ServerMetrics
    uvicorn_server: uvicorn.Server
    ranks: RankWatcher | None = None       # the follower ranks this process started, under a plan
    failure: str | None = None             # why the engine stopped serving after it had started
    warmup: HttpWarmup | None = None       # requests through the HTTP path before /health turns 200

    @property
    def exit_code(self) -> int:
        if self.failure is not None:
            return EXIT_ENGINE_DIED
        return EXIT_START_FAILED if self.engine.error is not None else 0

    def run(self, sockets: list[socket.socket] | None = None) -> None:
        """Serve until shut down (blocks). Stops the HTTP side too if the engine fails to start, or (after
        EXIT_GRACE_S of 503s) if it dies while serving."""
        self.engine.start()
        if self.ranks is not None:
            self.ranks.start()
        watcher = threading.Thread(target=self._watch_engine, name="k3core-engine-watch", daemon=True)
        watcher.start()
        try:
            self.uvicorn_server.run(sockets=sockets)
        finally:
            if self.ranks is not None:
                self.ranks.stop()          # from here on ranks leave on purpose
            self.engine.stop()

    def _watch_engine(self) -> None:
        self.engine.ready.wait()
        if self.engine.error is not None and self.engine.info is None:
            log.error("shutting down: the engine could not start (%s)", self.engine.error)
            self.uvicorn_server.should_exit = True
            return
        info = self.engine.info
        note = " with RANDOM weights (a preset: the text is noise)" if info.is_random else ""
        log.info("engine ready: model %s%s, context %d tokens, prefix cache %s, pool %.1f MiB",
                 self.args.model, note, info.context_length, "on" if info.prefix_cache else "off",
                 info.capacity_bytes / 2**20)
        if self.warmup is not None:
            self._warm_http()
        self.engine.dead.wait()
        self.failure = self.engine.error
        log.error("the engine stopped serving (%s): /health answers 503; exiting with code %d in %g s",
                  self.failure, EXIT_ENGINE_DIED, EXIT_GRACE_S)
        time.sleep(EXIT_GRACE_S)
        self.uvicorn_server.should_exit = True

    def _warm_http(self) -> None:
        """k3core.serve.http_warmup: once uvicorn listens, requests to this server through its own socket; then
        the cache emptied and the engine counters rebased, and /health may turn 200. Whatever goes wrong here is
        logged and the server becomes ready anyway."""
        started = time.monotonic()
        try:
            while not self.uvicorn_server.started:
                if self.uvicorn_server.should_exit or self.engine.dead.is_set():
                    return
                time.sleep(0.02)
            host, port = self.uvicorn_server.servers[0].sockets[0].getsockname()[:2]
            for problem in self.warmup.run(connect_url(host, port), self.args.model_name, self.args.api_key):
                log.warning("an HTTP warm-up request failed (the server becomes ready anyway): %s", problem)
            self.engine.flush_cache(rebase=True).result(timeout=120)
        except Exception as exc:  # noqa: BLE001 (a warm-up that cannot run must not keep the server unready)
            log.warning("the HTTP warm-up did not complete (%s: %s); the server becomes ready anyway",
                        type(exc).__name__, exc)
        finally:
            self.warmup.done.set()
        log.info("HTTP path warmed up in %.0f ms; /health answers 200", (time.monotonic() - started) * 1e3)

    def shutdown(self) -> None:
        self.uvicorn_server.should_exit = True


def build_server(args: ServerArgs) -> Server:
    metrics = ServerMetrics(args.model_name, max_model_len=args.context_length)
    build = functools.partial(_build_llm, args)            # picklable: it may run in the engine process
    ranks = None
    if args.plan().world_size > 1:
        from k3core.parallel.launch import torchrun_rank
        from k3core.serve.ranks import (build_leader_llm, dist_setup, run_follower, run_follower_node,
                                        start_local_ranks, torchrun_setup)
        launched = torchrun_rank()
        if launched is not None:           # torchrun started every rank: join its world, spawn nothing
            rank, setup = torchrun_setup(args, launched)
            if rank != 0:
                run_follower(args, rank, setup)
                raise SystemExit(0)
        else:
            setup = dist_setup(args)
            ranks = start_local_ranks(args, setup)
            if args.node_rank != 0:        # no HTTP here: this process is one more follower rank
                if ranks:                  # a lost local rank ends this node, which breaks the world for node 0
                    RankWatcher(ranks, args.rank_heartbeat_timeout, on_failure=_end_node).start()
                run_follower_node(args, setup)
                raise SystemExit(0)
        build = functools.partial(build_leader_llm, args, setup)
    if args.engine_in_process:
        engine = EngineThread(build, metrics, context_length=args.context_length)
    else:
        engine = EngineProcess(build, metrics, functools.partial(_load_tokenizer, args.model),
                               context_length=args.context_length, heartbeat_timeout_s=args.rank_heartbeat_timeout)
    watcher = None
    if ranks:
        watcher = RankWatcher(ranks, args.rank_heartbeat_timeout, on_failure=engine.fail)
        if isinstance(engine, EngineProcess):
            engine.root_cause = watcher.check_now
    warmup = None if args.no_http_warmup else HttpWarmup()
    app = create_app(args, engine, metrics, warmup)
    # uvicorn's own access log stays off: k3core.serve.access writes one line per request, with tokens
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=2, access_log=False,
                            http=h11_with_header_timeout(args.header_read_timeout),
                            timeout_keep_alive=args.keep_alive_timeout)
    return Server(args, engine, metrics, uvicorn.Server(config), watcher, warmup=warmup)
