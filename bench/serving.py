"""Serving against its ceilings, in one process tree: the model's own rates, the engine's steps, the offline
`LLM.generate`, and the HTTP server on the same workload.

    python -m bench.serving --model k3-mini --backend cuda --out bench/results

Sections (each a row set in the result; a section that fails records its error and the others still run):
* ceiling: the model's graph-replayed decode step at BS=1 and BS=N (N = --concurrency) at --input-len context and
  its prefill of one 8K prompt in the engine's chunks (bench.model_bench's measurements);
* engine steps: decode steps of the engine with 1 and N running requests, wall time per step and the GPU-busy share
  (torch.profiler's kernel time over wall time);
* lone 8K prompt: TTFT with the prefix cache on (the default) and off, against the ceiling's prefill time;
* offline: `LLM.generate` on --num-prompts prompts of --input-len tokens, --output-len tokens each, against the
  time the ceiling rates allow (every prompt's prefill plus output-len decode steps of N rows per wave);
* offline_steps, offline_threads, idle_penalty, engine_loop, engine_process_loop: where the time goes
  (bench.serving_steps: the step mix, torch's intra-op threads, idle pauses, the server's engine loop in this
  process and in its own);
* http: `python -m k3core.serve` as a subprocess on the same model and options: TTFT of the first request after
  /health turns 200 against the same request again (cache flushed between, so only warm-up differs; the median
  of REPEATS re-sends), then bench.serve_bench's client with N streams and with one stream on the same workload.
Ratios are printed last; the JSON and markdown go to --out as serving-<device>.json/.md with device, versions,
commit and date. --smoke runs every section tiny on the CPU (k3-tiny, torch backend, no graphs) for the tests.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

from bench import serve_bench, serving_steps
from bench.model_bench import _prefill_ms, decode_work, fill_random, graph_runner_of, make_pool


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, fn, iters: int) -> float:
    """Milliseconds per call of fn (host clock around synchronised runs)."""
    fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / iters * 1e3


def ceiling(llm, args, device) -> dict:
    from k3core.model.graph_decode import GraphDecode
    config, network = llm.config, llm.network
    generator = torch.Generator(device="cpu").manual_seed(0)
    device_generator = torch.Generator(device=device).manual_seed(0)
    out = {}
    for rows in sorted({1, args.concurrency}):
        pool, sequences = make_pool(config, llm.dtype, device, rows, args.input_len)
        fill_random(pool, sequences, device_generator)
        work = decode_work(pool, sequences, args.input_len)
        graph = GraphDecode(network, pool, max_context=args.input_len + 1, buckets=[rows])
        if device.type == "cuda":
            graph.capture(graph_runner_of(args.backend))
            graph.run(work)
            ms = _timed(device, graph.runner.graphs[rows].graph.replay, 20)
        else:
            inputs = [t.to(device) for t in graph.pack(work, rows)]
            ms = _timed(device, lambda: graph.step(*inputs), 2)
        graph.close()
        out[f"decode_step_ms_bs{rows}"] = ms
        del pool
    ctx = SimpleNamespace(dtype=llm.dtype, device=device, generator=generator, smoke=args.smoke)
    out["prefill_ms"] = _prefill_ms(ctx, network, config, args.long_prompt, args.chunk, 1 if args.smoke else 2)
    out["prefill_tokens"] = args.long_prompt
    out["prefill_tok_s"] = args.long_prompt / out["prefill_ms"] * 1e3
    return out


def _random_prompt(vocab: int, length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, min(vocab, 256), (length,), generator=generator).tolist()


def engine_steps(llm, args, device) -> dict:
    """Decode steps with 1 and N running requests: ms per step and GPU-busy share under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    from k3core.sampling_params import SamplingParams
    engine = llm.engine
    out = {}
    max_tokens = min(2000, llm.config.max_position_embeddings - args.input_len - 1)
    for rows in sorted({1, args.concurrency}):
        ids = [engine.add_request(_random_prompt(llm.config.vocab_size, args.input_len, 100 + i),
                                  SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
               for i in range(rows)]
        while any(r.is_prefilling or r.status.value == "waiting" for r in (engine.requests[i] for i in ids)):
            engine.step()
        for _ in range(5):
            engine.step()
        steps = 8 if args.smoke else 40
        _sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        _sync(device)
        wall_ms = (time.perf_counter() - start) / steps * 1e3
        row = {"ms_per_step": wall_ms, "tok_s": rows / wall_ms * 1e3}
        if device.type == "cuda":
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                _sync(device)
                start = time.perf_counter()
                for _ in range(steps):
                    engine.step()
                _sync(device)
                profiled_ms = (time.perf_counter() - start) * 1e3
            kernel_us = sum(e.device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA"
                            and e.device_time_total > 0 and not e.key.startswith("cudaStream"))
            events = [e for e in prof.events() if e.device_type.name == "CUDA"]
            busy_us = _union_us([(e.time_range.start, e.time_range.end) for e in events])
            row.update(profiled_ms_per_step=profiled_ms / steps, gpu_busy=busy_us / 1e3 / profiled_ms,
                       kernel_ms_per_step=kernel_us / 1e3 / steps)
        out[f"bs{rows}"] = row
        for request_id in ids:
            engine.abort(request_id)
        engine.drain()
        for request_id in ids:
            engine.requests.pop(request_id, None)
    engine.flush_cache()
    return out


def _union_us(ranges: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals (kernels on several streams may overlap)."""
    total, end_so_far = 0.0, float("-inf")
    for start, end in sorted(ranges):
        if end <= end_so_far:
            continue
        total += end - max(start, end_so_far)
        end_so_far = end
    return total


def lone_prompt(llm_on, common, args, device) -> dict:
    """TTFT of a lone long prompt on `llm_on` and on a second model with the prefix cache off, built beside it and
    freed after. Both hold the weights: on a GPU that cannot (k3-mini twice is 84 GB, over an H100's 80) the
    section records the out of memory and the bench goes on."""
    import gc

    from k3core import LLM
    from k3core.sampling_params import SamplingParams
    options = dict(common, prefix_cache=False, **({"memory_fraction": 0.15} if device.type == "cuda" else {}))
    prompt = _random_prompt(llm_on.config.vocab_size, args.long_prompt, 7)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    out, llm_off = {}, None
    try:
        llm_off = LLM(args.model, **options)
        for name, llm in (("cache_on", llm_on), ("cache_off", llm_off)):
            llm.generate([_random_prompt(llm.config.vocab_size, args.long_prompt, 8)], params)   # warm
            llm.flush_cache()
            times = []
            for _ in range(1 if args.smoke else 2):
                llm.flush_cache()
                _sync(device)
                start = time.perf_counter()
                llm.generate([prompt], params)
                _sync(device)
                times.append((time.perf_counter() - start) * 1e3)
            out[f"ttft_ms_{name}"] = min(times)
    finally:
        del llm_off
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out["steps_note"] = f"chunked_prefill_tokens {args.chunk}"
    return out


def offline(llm, args, prompts: list[str]) -> dict:
    from k3core.sampling_params import SamplingParams
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    llm.flush_cache()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    duration = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    return {"duration_s": duration, "output_tokens": tokens, "output_tok_s": tokens / duration}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http(args, prompts: list[str], out_dir: Path) -> dict:
    import httpx
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "k3core.serve", "--model", args.model, "--backend", args.backend,
               "--port", str(port), "--log-level", "warning", "--memory-fraction", str(args.memory_fraction),
               "--max-running-requests", str(args.concurrency), "--chunked-prefill-tokens", str(args.chunk)]
    if args.cuda_graphs:
        command += ["--cuda-graphs"]
    command += args.server_args.split()
    if args.smoke:
        command += ["--device", "cpu", "--memory-bytes", str(256 << 20)]
    log = open(out_dir / "serving-server.log", "w")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    out = {}
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if server.poll() is not None:
                log.flush()
                tail = (out_dir / "serving-server.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"the server exited with {server.returncode}; the end of serving-server.log:\n"
                                   f"{tail}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        else:
            raise RuntimeError("the server did not become healthy in 600 s")
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        # this client's own first use of its async HTTP stack (lazy imports, the connection pool) is not the
        # server's first request: pay it on a route that never reaches the engine
        asyncio.run(_warm_client(url))
        # the first request after /health, then the same again (cache flushed) REPEATS times: one sample of a 1K
        # prompt's TTFT varies by +-20 ms on this path (eager prefill, host-bound), so the repeat is their median
        first, parts = [], []
        for attempt in range(1 + REPEATS):
            if attempt:
                httpx.post(url + "/flush_cache", timeout=60)
            before = serve_bench.parse_metrics(httpx.get(url + "/metrics").text)
            result = asyncio.run(_one(url, model, prompts[0], 1))
            if not result.ok:
                raise RuntimeError(f"first request failed: {result.error}")
            first.append(result.ttft * 1e3)
            after = serve_bench.parse_metrics(httpx.get(url + "/metrics").text)
            parts.append(_server_parts(before, after, result.ttft))
        repeats = sorted(range(1, len(first)), key=first.__getitem__)            # the re-sends by TTFT
        median = repeats[len(repeats) // 2]
        out["first_request_parts"], out["repeat_parts"] = parts[0], parts[median]
        out["first_request_ttft_ms"], out["repeat_ttft_ms"] = first[0], first[median]
        out["repeat_ttft_ms_all"] = first[1:]
        # where a cold first request's time goes: a second prompt never seen (new text, same length class) right
        # away, then the same after the server sat idle for 5 s (an idle GPU may drop its clocks)
        for name, pause in (("unseen_prompt_ttft_ms", 0.0), ("after_idle_5s_ttft_ms", 0.2 if args.smoke else 5.0)):
            httpx.post(url + "/flush_cache", timeout=60)
            time.sleep(pause)
            result = asyncio.run(_one(url, model, prompts[1 + int(pause > 0)], 1))
            out[name] = result.ttft * 1e3 if result.ok else None
        # N streams twice: the first pass after /health (whatever this process has not met yet runs there), then
        # the same workload again on the warm server
        for name, concurrency, count in (("streams_n", args.concurrency, len(prompts)),
                                         ("streams_n_again", args.concurrency, len(prompts)),
                                         ("stream_1", 1, max(2, min(4, len(prompts))))):
            httpx.post(url + "/flush_cache", timeout=60)
            ns = argparse.Namespace(max_concurrency=concurrency, seed=0, url=url, timeout=600.0,
                                    output_len=args.output_len, request_rate=float("inf"), dataset="random")
            before = serve_bench.parse_metrics(httpx.get(url + "/metrics").text)
            cpu_before = _cpu_seconds(server.pid)
            results, duration = asyncio.run(serve_bench.run_all(ns, prompts[:count], model, {}))
            cpu_after = _cpu_seconds(server.pid)
            after = serve_bench.parse_metrics(httpx.get(url + "/metrics").text)
            summary = serve_bench.summarize(results, duration, before, after)
            summary["cpu_share"] = {k: (cpu_after[k] - cpu_before.get(k, 0.0)) / duration for k in cpu_after}
            if summary["num_failed"]:
                raise RuntimeError(f"{summary['num_failed']} requests failed: {summary['errors']}")
            out[name] = {k: summary[k] for k in ("duration_s", "output_tokens_per_s", "ttft", "itl", "tpot",
                                                 "server_steps", "cpu_share")}
    finally:
        _signal_group(server.pid, 15)             # the server and its engine process
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            _signal_group(server.pid, 9)
        log.close()
    return out


REPEATS = 3                 # re-sends of the first request; their median is "the same request sent again"


def _server_parts(before: dict, after: dict, client_ttft_s: float) -> dict:
    """Where one request's TTFT went, from the server's metrics around it (ms): arrival at the route to the
    first token in the engine (queue = arrival to its first scheduled step), and the rest the client saw (sending
    the request, the event's way back, SSE)."""
    def grew(name: str) -> float:
        return serve_bench.metric_sum(after, name) - serve_bench.metric_sum(before, name)
    engine_ttft = grew("k3core_time_to_first_token_seconds_sum") * 1e3
    return {"server_ttft_ms": engine_ttft, "queue_ms": grew("vllm:request_queue_time_seconds_sum") * 1e3,
            "outside_server_ms": client_ttft_s * 1e3 - engine_ttft}


def _cpu_seconds(server_pid: int) -> dict[str, float]:
    """CPU seconds so far of this process (the client), the server and the server's children (the engine process);
    {} where /proc is not there. Over a run's wall time: the cores each kept busy."""
    of = serving_steps.cpu_seconds
    out = {"client": of(os.getpid()), "server": of(server_pid)}
    try:
        children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    except OSError:
        children = []
    for child in children:
        out[f"server child {child}"] = of(int(child))
    return {k: v for k, v in out.items() if v is not None}


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:                   # the whole group has exited already
        pass


async def _warm_client(url: str) -> None:
    import httpx
    async with httpx.AsyncClient(timeout=60) as client:
        async with client.stream("GET", url + "/v1/models") as response:
            await response.aread()


async def _one(url: str, model: str, prompt: str, output_len: int):
    import httpx
    async with httpx.AsyncClient(timeout=600) as client:
        return await serve_bench.run_one(client, url, model, prompt, output_len, {})


def ratios(result: dict, args) -> dict:
    """The targets' ratios from whatever sections ran."""
    r: dict[str, float] = {}
    ceil, steps, lone = result.get("ceiling", {}), result.get("engine_steps", {}), result.get("lone_prompt", {})
    off, web = result.get("offline", {}), result.get("http", {})
    n = args.concurrency
    if steps:
        for key, row in steps.items():
            if "gpu_busy" in row:
                r[f"engine decode {key}: GPU busy share"] = row["gpu_busy"]
                # the profiler slows the host side: kernel time against the step's unprofiled wall time too
                r[f"engine decode {key}: kernel time / unprofiled step"] = row["kernel_ms_per_step"] / row["ms_per_step"]
    for key, row in result.get("replay_busy", {}).items():
        if isinstance(row, dict):
            r[f"graph replay {key} alone: kernel busy share (the bound on the engine's)"] = row["busy_share"]
    mixed = result.get("mixed_steps", {})
    if "mixed_split_ms" in mixed:
        r["mixed step: one forward / (chunk + decode replay)"] = mixed["mixed_one_forward_ms"] / (
            mixed["prefill_chunk_ms"] + mixed["decode_graph_ms"])
        r["mixed step: split / (chunk + decode replay)"] = mixed["mixed_split_ms"] / (
            mixed["prefill_chunk_ms"] + mixed["decode_graph_ms"])
    if ceil and steps:
        r["engine decode bs1 tok/s / graph replay"] = ceil["decode_step_ms_bs1"] / steps["bs1"]["ms_per_step"]
        if f"bs{n}" in steps and f"decode_step_ms_bs{n}" in ceil:
            r[f"engine decode bs{n} tok/s / graph replay"] = (ceil[f"decode_step_ms_bs{n}"]
                                                             / steps[f"bs{n}"]["ms_per_step"])
    if lone:
        r["lone 8K TTFT cache on / cache off"] = lone["ttft_ms_cache_on"] / lone["ttft_ms_cache_off"]
        if ceil:
            r["lone 8K TTFT cache on / model prefill"] = lone["ttft_ms_cache_on"] / ceil["prefill_ms"]
    if off and ceil and f"decode_step_ms_bs{n}" in ceil:
        waves = -(-args.num_prompts // n)
        ideal_s = (args.num_prompts * args.input_len / ceil["prefill_tok_s"]
                   + waves * args.output_len * ceil[f"decode_step_ms_bs{n}"] / 1e3)
        result["offline"]["ceiling_s"] = ideal_s
        r["offline output tok/s / ceiling"] = ideal_s / off["duration_s"]
    if web and off and "streams_n" in web:
        r["http N streams tok/s / offline"] = web["streams_n"]["output_tokens_per_s"] / off["output_tok_s"]
    if web and off and "streams_n_again" in web:
        r["http N streams again (warm server) tok/s / offline"] = (web["streams_n_again"]["output_tokens_per_s"]
                                                                   / off["output_tok_s"])
    if web and ceil and "stream_1" in web:
        tpot = web["stream_1"]["tpot"]["median_ms"]
        r["http 1 stream decode tok/s / graph replay"] = ceil["decode_step_ms_bs1"] / tpot
    r.update(serving_steps.probe_ratios(result))
    if web and "first_request_ttft_ms" in web:
        r["first request TTFT / repeat"] = web["first_request_ttft_ms"] / web["repeat_ttft_ms"]
    return r


TARGETS = {"GPU busy share": (">=", 0.90), "unprofiled step": (">=", 0.90), "tok/s / graph replay": (">=", 0.90),
           "cache on / cache off": ("<=", 1.15),
           "cache on / model prefill": ("<=", 1.25), "offline output tok/s / ceiling": (">=", 0.85),
           "tok/s / offline": (">=", 0.90), "first request TTFT / repeat": ("<=", 1.2)}


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"# Serving against its ceilings: {result['model']} on {result['device']}", "",
             f"commit {m['commit']}, {m['date']}, torch {m['torch']}, triton {result.get('triton')}, "
             f"backend {result['backend']}, cuda graphs {result['cuda_graphs']}", "",
             "| ratio | measured | target |", "|---|---|---|"]
    for name, value in result["ratios"].items():
        target = next((f"{op} {bound}" for key, (op, bound) in TARGETS.items() if key in name), "")
        if "bs1: GPU busy" in name or "bs1: kernel time" in name:
            target = ">= 0.95"
        lines.append(f"| {name} | {value:.3f} | {target} |")
    lines += ["", "Raw numbers (ms unless named otherwise):", "", "```", json.dumps(
        {k: result.get(k) for k in ("ceiling", "replay_busy", "mixed_steps", "engine_steps", "lone_prompt", "offline",
                                    "offline_steps", "offline_threads", "idle_penalty", "engine_loop",
                                    "engine_process_loop", "http", "errors")},
        indent=1, default=str), "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.serving", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="k3-mini")
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=160)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--long-prompt", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=None, help="chunked_prefill_tokens (default: the engine's)")
    parser.add_argument("--memory-fraction", type=float, default=0.3)
    parser.add_argument("--sections", default="ceiling,replay_busy,mixed_steps,engine_steps,lone_prompt,offline,"
                        "offline_steps,offline_threads,idle_penalty,engine_loop,engine_process_loop,http")
    parser.add_argument("--server-args", default="", help="more flags for the http section's server, e.g. "
                        "\"--engine-in-process\" (space-separated)")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--name", default=None, help="result file stem (default serving-<device>)")
    parser.add_argument("--smoke", action="store_true", help="tiny, on the CPU (tests)")
    args = parser.parse_args(argv)
    from k3core import LLM
    from k3core.engine import default_prefill_budget
    if args.smoke:
        args.model, args.backend = "k3-tiny", "torch"
        args.num_prompts, args.input_len, args.output_len, args.concurrency, args.long_prompt = 4, 24, 4, 2, 64
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    args.chunk = args.chunk or default_prefill_budget(device)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    args.cuda_graphs = device.type == "cuda"
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    sections = set(args.sections.split(","))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    import triton
    result = {"model": args.model, "backend": args.backend, "cuda_graphs": args.cuda_graphs,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "triton": triton.__version__, "config": {k: v for k, v in vars(args).items()}, "errors": {}}
    prompts = serve_bench.make_prompts(argparse.Namespace(seed=0, dataset="random", input_len=args.input_len,
                                                          num_prompts=args.num_prompts))
    common = dict(backend=args.backend, device=str(device), dtype=dtype, max_running_requests=args.concurrency,
                  chunked_prefill_tokens=args.chunk)
    if device.type == "cpu":
        common["memory_bytes"] = 256 << 20
    else:
        common["memory_fraction"] = args.memory_fraction

    def section(name, fn, *fn_args):
        if name not in sections:
            return
        print(f"== {name}", flush=True)
        try:
            result[name] = fn(*fn_args)
        except Exception as exc:  # noqa: BLE001 (recorded; the other sections still run)
            result["errors"][name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()

    if sections & {"ceiling", "replay_busy", "mixed_steps", "engine_steps", "lone_prompt", "offline", "offline_steps",
                   "offline_threads", "idle_penalty", "engine_loop"}:
        llm = LLM(args.model, cuda_graphs=args.cuda_graphs, **common)
        section("ceiling", ceiling, llm, args, device)
        section("replay_busy", serving_steps.replay_busy, llm, args, device)
        section("mixed_steps", serving_steps.mixed_steps, llm, args, device)
        section("engine_steps", engine_steps, llm, args, device)
        section("lone_prompt", lone_prompt, llm, common, args, device)
        section("offline", offline, llm, args, prompts)
        section("offline_steps", serving_steps.offline_steps, llm, args, prompts)
        section("offline_threads", serving_steps.offline_threads, llm, args, prompts)
        section("idle_penalty", serving_steps.idle_penalty, llm, args, device, prompts)
        section("engine_loop", serving_steps.engine_loop, llm, args, prompts)     # closes llm's engine: last
        llm.engine.close()
        del llm
        import gc
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    section("engine_process_loop", serving_steps.engine_process_loop, args, common, prompts)
    section("http", http, args, prompts, out_dir)
    result["machine"] = serve_bench.machine()
    if os.environ.get("K3CORE_COMMIT"):                 # a copy of the tree without its .git
        result["machine"]["commit"] = os.environ["K3CORE_COMMIT"]
    result["ratios"] = ratios(result, args)
    name = args.name or "serving-" + ("smoke" if args.smoke else result["device"].lower()
                                      .replace("nvidia ", "nvidia-").replace(" ", "-"))
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (out_dir / f"{name}.md").write_text(markdown(result))
    print(markdown(result))
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
