"""Liveness of the follower ranks a server process started: each one heartbeats, the server watches.

Every follower rank gets the write end of a pipe (`Heartbeat`): a thread sends a beat every `HEARTBEAT_S`, and a
rank that fails reports why before it exits. The server process holds the read ends and each rank's process
sentinel (`RankWatcher`): a rank that exits with a non-zero code or a signal (exit code 0 means it left on the
leader's word: a shutdown, or a leader that is gone, which the engine process's own watch covers) or, once its
first beat has arrived, sends nothing for `timeout_s` while alive ("wedged": stopped, or stuck holding the interpreter) is a
failure of the whole engine, since its peers' next collective would hang or raise. The watcher then kills every
rank it started and calls `on_failure(reason)` once; it never waits on a collective, so a hung leader cannot
delay it.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Callable

log = logging.getLogger("k3core.serve")

HEARTBEAT_S = 0.5              # how often a rank says it is alive
POLL_S = 0.1                   # how often the watcher re-checks the heartbeat ages


class Heartbeat:
    """A rank's side: beats on a daemon thread; `fail` sends the reason this rank is about to exit with."""

    def __init__(self, conn: Connection, interval_s: float = HEARTBEAT_S):
        self._conn = conn
        self._lock = threading.Lock()
        self._interval_s = interval_s
        threading.Thread(target=self._beat, name="k3core-heartbeat", daemon=True).start()

    def _send(self, message: tuple) -> bool:
        with self._lock:                     # the beat thread and `fail` share the pipe
            try:
                self._conn.send(message)
                return True
            except (OSError, ValueError):    # the server is gone: nobody to tell
                return False

    def _beat(self) -> None:
        while self._send(("beat",)):
            time.sleep(self._interval_s)

    def fail(self, reason: str) -> None:
        self._send(("failed", reason))


@dataclass
class WatchedRank:
    rank: int
    process: object                          # a started multiprocessing.Process
    conn: Connection                         # read end of the rank's heartbeat pipe


def describe_exit(code: int | None) -> str:
    """A process's exit as words: "signal 9 (SIGKILL)", "exit code 3"."""
    if code is None:
        return "no exit code yet"
    if code < 0:
        try:
            return f"signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


class RankWatcher:
    """The server's side: one daemon thread over every local follower rank's sentinel and heartbeat pipe."""

    def __init__(self, ranks: list[WatchedRank], timeout_s: float, on_failure: Callable[[str], None] | None = None):
        self.ranks = list(ranks)
        self.timeout_s = timeout_s
        self.on_failure = on_failure
        self.failure: str | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._last_beat: dict[int, float] = {}
        self._reported: dict[int, str] = {}
        self._thread = threading.Thread(target=self._run, name="k3core-rank-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """A clean shutdown: ranks exiting from now on are expected."""
        self._stopping.set()
        self._thread.join(timeout=2 * POLL_S + 1)

    def check_now(self, wait_s: float = 0.5) -> str | None:
        """A rank found dead within `wait_s`, as a reason, else None: for an engine that just lost a collective
        (its peer's sockets close a moment before its sentinel says so; a healthy world costs the wait)."""
        by_sentinel = {w.process.sentinel: w for w in self.ranks}
        for ready in wait(list(by_sentinel), timeout=wait_s):
            watched = by_sentinel[ready]
            watched.process.join(timeout=0.5)
            if watched.process.exitcode != 0:        # exit code 0: it followed a leader that went away
                self._drain(watched)
                return self._exit_reason(watched)
        return None

    # ---- the watcher thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        by_sentinel = {w.process.sentinel: w for w in self.ranks}
        by_conn = {w.conn: w for w in self.ranks}
        while not self._stopping.is_set():
            for ready in wait(list(by_sentinel) + list(by_conn), timeout=POLL_S):
                if ready in by_conn:
                    self._read(by_conn, ready)
                elif not self._stopping.is_set():
                    watched = by_sentinel[ready]
                    self._drain(watched)             # a reason it sent just before it went
                    watched.process.join(timeout=0.5)
                    if watched.process.exitcode == 0:   # it left on the leader's word (shutdown, or leader gone)
                        del by_sentinel[ready]
                        by_conn.pop(watched.conn, None)
                        self._last_beat.pop(watched.rank, None)
                        continue
                    return self._fail(self._exit_reason(watched))
            now = time.monotonic()
            for watched in by_sentinel.values():
                last = self._last_beat.get(watched.rank)
                if last is not None and now - last > self.timeout_s and not self._stopping.is_set():
                    return self._fail(f"rank {watched.rank} (pid {watched.process.pid}) sent no heartbeat for "
                                      f"{now - last:.1f} s (wedged: stopped or stuck; --rank-heartbeat-timeout "
                                      f"{self.timeout_s:g})")

    def _read(self, by_conn: dict, conn: Connection) -> None:
        watched = by_conn[conn]
        try:
            message = conn.recv()
        except (EOFError, OSError):                  # the rank closed its end: its sentinel follows
            del by_conn[conn]
            return
        self._last_beat[watched.rank] = time.monotonic()
        if message[0] == "failed":
            self._reported[watched.rank] = message[1]

    def _drain(self, watched: WatchedRank) -> None:
        try:
            while watched.conn.poll(0):
                message = watched.conn.recv()
                if message[0] == "failed":
                    self._reported[watched.rank] = message[1]
        except (EOFError, OSError):
            pass

    def _exit_reason(self, watched: WatchedRank) -> str:
        watched.process.join(timeout=0.5)            # reap it, so that the exit code is known
        code = describe_exit(watched.process.exitcode)
        reason = f"rank {watched.rank} (pid {watched.process.pid}) exited with {code}"
        reported = self._reported.get(watched.rank)
        return f"{reason}: {reported}" if reported else reason

    def _fail(self, reason: str) -> None:
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
        log.error("%s; the engine cannot continue without it: stopping every rank", reason)
        for watched in self.ranks:                   # SIGKILL: a stopped (SIGSTOP) process ignores SIGTERM
            if watched.process.is_alive():
                try:
                    os.kill(watched.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self.on_failure is not None:
            self.on_failure(reason)
