"""Liveness and isolation under a parallel plan: `python -m k3core.serve` with two gloo ranks on the CPU (k3-tiny).

* kill -9 of the follower rank while a stream runs: /health turns 503 within seconds, the stream ends with an error
  event (no hang), and the server exits with EXIT_ENGINE_DIED so that a supervisor restarts it;
* a request whose sampling raises on rank 1 (the sampler rank under --pp 2) fails alone: a stream beside it gets
  the tokens it gets alone, and the server keeps serving; then a wedged rank 1 (SIGSTOP) turns /health 503 within
  the heartbeat bound and the server exits the same way;
* an idle leader keeps its followers past the process group's collective timeout (keep-alive steps);
* a follower that fails reports why, and the watcher names the rank, its pid, its exit code and that reason.

The fault is injected by this test only: a `sitecustomize.py` on the server's PYTHONPATH (imported by every
process of it, the spawned ranks included) wraps `Sampler.sample` so that rank 1 raises for prompts that start with
POISON once they have a few output tokens. No production code knows about it.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from k3core.parallel.launch import free_port
from k3core.serve.launch import EXIT_ENGINE_DIED

# gloo ranks and a 3 s heartbeat bound: run alone, after the xdist workers (scripts/test.sh)
pytestmark = pytest.mark.serial

MODEL = "k3-tiny"
HEARTBEAT_TIMEOUT_S = 3.0
HEALTH_BOUND_S = 10.0             # kill / SIGSTOP -> 503 within this (heartbeat timeout + slack for 2 busy cores)
POISON = [3, 1, 4, 1, 5]          # the warm-up prompts (steps of 7 mod 320) never start with this
INNOCENT = [5, 17, 2, 99, 42, 7]

FAULT_HOOK = f'''
import k3core.sampler as _sampler

_original = _sampler.Sampler.sample


def _sample(self, logits, rows):
    import torch.distributed as dist
    if dist.is_initialized() and dist.get_rank() == 1 and any(
            list(row.prompt_token_ids[:{len(POISON)}]) == {POISON!r} and len(row.output_token_ids) >= 2
            for row in rows):
        raise RuntimeError("injected fault: rank 1 cannot sample the poison request")
    return _original(self, logits, rows)


_sampler.Sampler.sample = _sample
'''


class Served:
    def __init__(self, tmp_path: Path, plan: list[str], hook: bool = False):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / "server.log"
        self.tmp = tmp_path / "tmp"           # the server's TMPDIR: where its engine's socket directory lives
        self.tmp.mkdir()
        env = dict(os.environ, TMPDIR=str(self.tmp))
        if hook:
            (tmp_path / "sitecustomize.py").write_text(FAULT_HOOK)
            env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
        # a small step budget keeps the warm-up (prefills up to twice the budget) short
        command = [sys.executable, "-m", "k3core.serve", "--model", MODEL, *plan, "--memory-bytes", str(64 << 20),
                   "--cpu-threads", "1", "--port", str(self.port), "--disable-prefix-cache",
                   "--chunked-prefill-tokens", "64", "--rank-heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S)]
        self.log = open(self.log_path, "w")
        # a session of its own: the test can end every process of the server, and only those
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)

    def wait_healthy(self, timeout_s: float = 150.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log_text()
            if self.health() == 200:
                assert list(self.tmp.glob("k3core-engine-*")), "no socket directory under the server's TMPDIR"
                return
            time.sleep(0.3)
        raise AssertionError(f"the server did not become healthy:\n{self.log_text()}")

    def health(self) -> int | None:
        try:
            return httpx.get(self.base + "/health", timeout=2).status_code
        except httpx.HTTPError:
            return None

    def rank_pid(self, rank: int) -> int:
        match = re.search(rf"started rank {rank} \(pid (\d+)\)", self.log_text())
        assert match, self.log_text()
        return int(match.group(1))

    def log_text(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def complete(self, prompt: list[int], max_tokens: int) -> httpx.Response:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        return httpx.post(self.base + "/v1/completions", json=body, timeout=120)

    def wait_for_503_then_exit(self, since: float) -> tuple[float, dict]:
        """Seconds from `since` to the first 503 and its body; then the server must exit with EXIT_ENGINE_DIED."""
        while True:
            elapsed = time.monotonic() - since
            assert elapsed < HEALTH_BOUND_S, f"/health still not 503 after {elapsed:.1f} s:\n{self.log_text()}"
            try:
                reply = httpx.get(self.base + "/health", timeout=1)
            except httpx.HTTPError:
                reply = None                     # a timeout while the world breaks: ask again
            if reply is not None and reply.status_code == 503:
                break
            time.sleep(0.1)
        code = self.process.wait(timeout=30)
        assert code == EXIT_ENGINE_DIED, f"exit code {code}:\n{self.log_text()}"
        self.wait_socket_dir_removed()
        return elapsed, reply.json()

    def wait_socket_dir_removed(self, timeout_s: float = 5.0) -> None:
        """The server left by os._exit (its main thread may be stuck in a collective): its engine process, orphaned,
        removes the socket directory the server made, so that restarts do not pile them up in /tmp."""
        deadline = time.monotonic() + timeout_s
        while list(self.tmp.glob("k3core-engine-*")) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = list(self.tmp.glob("k3core-engine-*"))
        assert not left, f"the engine's socket directory outlived the server: {left}"

    def close(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)    # the session this test started
        except ProcessLookupError:
            pass
        self.process.wait(timeout=30)
        self.log.close()


def _stream_lines(served: Served, prompt: list[int], max_tokens: int):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    return httpx.stream("POST", served.base + "/v1/completions", json=body, timeout=30)


def test_killed_follower_turns_health_503_ends_the_stream_and_exits_non_zero(tmp_path):
    served = Served(tmp_path, ["--tp", "2"])
    try:
        served.wait_healthy()
        follower = served.rank_pid(1)
        events = []
        with _stream_lines(served, INNOCENT, 4000) as stream:
            lines = stream.iter_lines()
            for line in lines:                       # the stream is running: its first token arrived
                if line.startswith("data: "):
                    events.append(line)
                    break
            killed = time.monotonic()
            os.kill(follower, signal.SIGKILL)
            events.extend(line for line in lines if line.startswith("data: "))   # must end, not hang (timeout)
        ended = time.monotonic() - killed
        errors = [json.loads(e[6:])["error"] for e in events if e != "data: [DONE]" and "error" in json.loads(e[6:])]
        assert errors, f"the stream ended without an error event: {events[-3:]}"
        assert f"rank 1 (pid {follower}) exited with signal 9" in errors[0]["message"], errors[0]
        assert ended < HEALTH_BOUND_S, f"the stream took {ended:.1f} s to end after the kill"
        elapsed, body = served.wait_for_503_then_exit(killed)
        assert f"rank 1 (pid {follower}) exited with signal 9" in body["error"]["message"], body
    finally:
        served.close()


def test_poison_request_on_rank_1_fails_alone_then_a_wedged_rank_turns_health_503(tmp_path):
    served = Served(tmp_path, ["--pp", "2"], hook=True)
    try:
        served.wait_healthy()
        alone = served.complete(INNOCENT, 24)
        assert alone.status_code == 200, alone.text
        expected = alone.json()["choices"][0]["text"]

        results: dict[str, httpx.Response] = {}

        def run(name: str, prompt: list[int], max_tokens: int) -> None:
            results[name] = served.complete(prompt, max_tokens)

        threads = [threading.Thread(target=run, args=("poison", POISON + [9, 9], 24)),
                   threading.Thread(target=run, args=("innocent", INNOCENT, 24))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        poison, innocent = results["poison"], results["innocent"]
        assert poison.status_code == 500, poison.text
        assert "injected fault: rank 1 cannot sample the poison request" in poison.json()["error"]["message"]
        assert innocent.status_code == 200, innocent.text
        assert innocent.json()["choices"][0]["text"] == expected, "the poison request changed its neighbour's text"
        assert served.health() == 200, "one failed request must not take the server down"
        again = served.complete(INNOCENT, 24)
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == expected

        follower = served.rank_pid(1)
        stopped = time.monotonic()
        os.kill(follower, signal.SIGSTOP)
        elapsed, body = served.wait_for_503_then_exit(stopped)
        assert elapsed >= HEARTBEAT_TIMEOUT_S - 0.5, f"503 after {elapsed:.1f} s: before the heartbeat timeout?"
        assert f"rank 1 (pid {follower}) sent no heartbeat" in body["error"]["message"], body
    finally:
        served.close()


PG_TIMEOUT_S = 2.0                # the process group's collective timeout in the keep-alive test, once built


def _idle_leader_main(rank: int, plan, device, keepalive_s: float):
    import datetime

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _set_pg_timeout

    from k3core import LLM, SamplingParams
    from k3core.parallel.distributed_engine import DistributedEngine, follow
    llm = LLM(MODEL, backend="torch", device=str(device), dtype="float32", seed=7, plan=plan, rank=rank,
              memory_bytes=8 << 20, page_size=2, checkpoint_interval=8, chunked_prefill_tokens=8)
    dist.barrier()                 # both ranks built: from here a wait longer than PG_TIMEOUT_S times out
    _set_pg_timeout(datetime.timedelta(seconds=PG_TIMEOUT_S))
    if rank != 0:
        follow(llm.engine, llm.comm)
        return None
    engine = DistributedEngine(llm.engine, llm.comm, keepalive_s=keepalive_s)
    idle_until = time.monotonic() + 2.5 * PG_TIMEOUT_S    # idle for longer than a follower's wait may last
    while time.monotonic() < idle_until:
        engine.keep_alive()                                # what the engine loop calls when it has no work
        time.sleep(0.05)
    request = engine.add_request([5, 17, 2, 99], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    tokens = engine.run_until_done([request])[request].token_ids
    engine.shutdown()
    return tokens


def test_an_idle_leader_keeps_its_followers_past_the_collective_timeout():
    """A follower waits for the next step inside a broadcast, which the process group times out (30 min on gloo by
    default): without the idle leader's keep-alive steps, an idle server lost its followers after that long."""
    from k3core import LLM, SamplingParams
    from k3core.parallel.launch import spawn
    from k3core.parallel.plan import ParallelPlan
    results = spawn(_idle_leader_main, ParallelPlan(tp=2), args=(PG_TIMEOUT_S / 8,), timeout_s=120)
    single = LLM(MODEL, backend="torch", dtype="float32", seed=7, memory_bytes=8 << 20, page_size=2,
                 checkpoint_interval=8, chunked_prefill_tokens=8)
    expected = single.generate([[5, 17, 2, 99]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert results[0] == expected.token_ids


def _reporting_rank(conn) -> None:
    from k3core.serve.liveness import Heartbeat
    heartbeat = Heartbeat(conn)
    time.sleep(0.3)                                       # a few beats first
    heartbeat.fail("rank 1 failed (RuntimeError: boom)")
    raise SystemExit(3)


def test_a_rank_that_fails_reports_why_and_the_watcher_names_it(monkeypatch):
    """The follower's side (run_follower: a failure is reported, then exit code 3) and the watcher's (the reason
    and the exit code reach on_failure once), without a model."""
    import multiprocessing as mp

    from k3core.serve import ranks
    from k3core.serve.args import ServerArgs
    from k3core.serve.liveness import RankWatcher, WatchedRank

    class Recorder:
        def __init__(self):
            self.reasons: list[str] = []

        def fail(self, reason: str) -> None:
            self.reasons.append(reason)

    def broken_build(args, rank, setup):
        raise RuntimeError("the shard does not fit")

    monkeypatch.setattr(ranks, "build_rank_llm", broken_build)
    recorder = Recorder()
    with pytest.raises(SystemExit) as exit_info:
        ranks.run_follower(ServerArgs(), 1, None, recorder)
    assert exit_info.value.code == ranks.RANK_FAILED_EXIT
    assert recorder.reasons == ["rank 1 failed (RuntimeError: the shard does not fit)"]

    context = mp.get_context("spawn")
    read, write = context.Pipe(duplex=False)
    process = context.Process(target=_reporting_rank, args=(write,), daemon=True)
    process.start()
    write.close()
    failures: list[str] = []
    done = threading.Event()
    watcher = RankWatcher([WatchedRank(1, process, read)], timeout_s=30,
                          on_failure=lambda reason: (failures.append(reason), done.set()))
    watcher.start()
    assert done.wait(60), "the watcher never reported the rank's exit"
    assert failures == [f"rank 1 (pid {process.pid}) exited with exit code 3: rank 1 failed (RuntimeError: boom)"]
