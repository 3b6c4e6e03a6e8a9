"""Where a serving step's time goes: the cost of each kind of step and the GPU-busy share of the graph replay itself.

Sections of `bench.serving` (each returns a dict of milliseconds and shares):
* mixed_steps: one forward of a prefill chunk (`--chunk` tokens over two fresh sequences), of N-2 decode rows
  (eager and graph-replayed) and of both together, each synchronised on its own; the split step the engine runs
  (`k3core.mixed_step`) costs the chunk plus the replay;
* replay_busy: torch.profiler's kernel time over wall time of back-to-back graph replays at BS=1 and BS=N: the
  busy share no engine step can exceed, since the replayed graph's own gaps between kernels are inside it;
* offline_steps: the offline workload's steps counted by kind (pure prefill, pure decode, mixed), with
  split_mixed_steps on and off, and the duration of each run;
* offline_threads: the offline workload with this process's torch intra-op threads at 1 and at one per core,
  alternating: whether a pool of OpenMP threads slows the host side of the engine's steps;
* idle_penalty: a 1K prompt's TTFT through LLM.generate, a fixed GPU matmul burst and a fixed Python loop, each
  right after a pause of 0 to 5 s: what an idle machine costs the next request, and whether the GPU or the host
  pays it.
"""
from __future__ import annotations

import sys
import time

import torch

from bench.model_bench import decode_work, fill_random, graph_runner_of, make_pool, synchronize, time_host
from k3core.model.batch import SeqWork


def mixed_steps(llm, args, device) -> dict:
    from k3core.mixed_step import MixedSplit, run_split
    from k3core.model.graph_decode import GraphDecode
    rows = max(1, args.concurrency - 2)                    # decodes beside the chunk's two prompts
    generator = torch.Generator(device=device).manual_seed(0)
    pool, sequences = make_pool(llm.config, llm.dtype, device, rows + 2, args.input_len)
    fill_random(pool, sequences, generator)
    decodes = decode_work(pool, sequences[2:], args.input_len)                  # rows at --input-len context
    half = max(1, min(args.chunk // 2, args.input_len))
    vocab = llm.config.vocab_size
    chunk = [SeqWork(torch.randint(3, min(vocab, 256), (half,)).tolist(), 0, pool.slot_position(slot), pages)
             for slot, pages in sequences[:2]]                               # two fresh prompts of chunk/2 tokens
    runner = llm.runner
    iters = 2 if args.smoke else 10
    out = {"chunk_tokens": 2 * half, "decode_rows": len(decodes), "context": args.input_len}
    out["prefill_chunk_ms"] = time_host(device, lambda: runner.forward(chunk, pool), iters)
    out["decode_eager_ms"] = time_host(device, lambda: runner.forward(decodes, pool), iters)
    out["mixed_one_forward_ms"] = time_host(device, lambda: runner.forward(chunk + decodes, pool), iters)
    if device.type == "cuda":
        graph = GraphDecode(llm.network, pool, max_context=args.input_len + 1, buckets=[args.concurrency])
        graph.capture(graph_runner_of(args.backend))
        out["decode_graph_ms"] = time_host(device, lambda: graph.run(decodes), iters)
        split = MixedSplit(list(range(2, 2 + len(decodes))), [0, 1])
        out["mixed_split_ms"] = time_host(device, lambda: run_split(split, chunk + decodes, None, graph, runner, pool),
                                    iters)
        graph.close()
    del pool
    return out


def replay_busy(llm, args, device) -> dict:
    """Kernel-busy share of back-to-back graph replays (no engine, no host work between them)."""
    from torch.profiler import ProfilerActivity, profile

    from bench.serving import _union_us
    from k3core.model.graph_decode import GraphDecode
    if device.type != "cuda":
        return {"note": "graphs need a GPU"}
    out = {}
    generator = torch.Generator(device=device).manual_seed(0)
    for rows in sorted({1, args.concurrency}):
        pool, sequences = make_pool(llm.config, llm.dtype, device, rows, args.input_len)
        fill_random(pool, sequences, generator)
        graph = GraphDecode(llm.network, pool, max_context=args.input_len + 1, buckets=[rows])
        graph.capture(graph_runner_of(args.backend))
        work = decode_work(pool, sequences, args.input_len)
        graph.run(work)
        replay = graph.runner.graphs[rows].graph.replay
        wall_ms = time_host(device, replay, 20)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            synchronize(device)
            start = time.perf_counter()
            for _ in range(20):
                replay()
            synchronize(device)
            profiled_ms = (time.perf_counter() - start) * 1e3
        events = [e for e in prof.events() if e.device_type.name == "CUDA"]
        busy_ms = _union_us([(e.time_range.start, e.time_range.end) for e in events]) / 1e3
        out[f"bs{rows}"] = {"replay_ms": wall_ms, "profiled_replay_ms": profiled_ms / 20,
                            "kernel_busy_ms": busy_ms / 20, "busy_share": busy_ms / profiled_ms,
                            "busy_share_of_unprofiled": busy_ms / 20 / wall_ms, "num_kernels": len(events) // 20}
        graph.close()
        del pool
    return out


def offline_steps(llm, args, prompts: list[str]) -> dict:
    """The offline workload with split_mixed_steps on and off: duration and the steps' mix (k3core.step_counts)."""
    from k3core.sampling_params import SamplingParams
    engine = llm.engine
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    out = {}
    try:
        for split in (True, False):
            engine.options.split_mixed_steps = split
            llm.flush_cache()
            graph_steps, counts = engine.num_graph_steps, engine.step_counts.copy()
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            duration = time.perf_counter() - start
            out["split_on" if split else "split_off"] = {
                "duration_s": duration, "output_tok_s": sum(len(o.token_ids) for o in outs) / duration,
                "steps": engine.step_counts.since(counts).as_dict(),
                "graph_steps": engine.num_graph_steps - graph_steps}
    finally:
        engine.options.split_mixed_steps = True
    return out


def offline_threads(llm, args, prompts: list[str]) -> dict:
    """LLM.generate on the workload at 1 intra-op thread and at one per core (torch's default), twice each in turn
    (the fastest of each kept); the process's setting restored after."""
    import os

    from k3core.sampling_params import SamplingParams
    before, default = torch.get_num_threads(), max(2, os.cpu_count() or 2)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    runs: dict[int, list[float]] = {1: [], default: []}
    try:
        for threads in (1, default) * (1 if args.smoke else 2):
            torch.set_num_threads(threads)
            llm.flush_cache()
            start = time.perf_counter()
            llm.generate(prompts, params)
            runs[threads].append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return {"default_threads": default, "duration_s_1_thread": min(runs[1]),
            "duration_s_default_threads": min(runs[default]), "runs": {str(k): v for k, v in runs.items()}}


def idle_penalty(llm, args, device, prompts: list[str]) -> dict:
    """Each measurement right after its own pause (the cache flushed and the device idle before the pause): a 1K
    prompt's TTFT (LLM.generate, one token), 16 bf16 4096^3 matmuls timed by CUDA events (GPU only) and a fixed
    Python loop (host only). ms per pause; the first pause-0 row warms."""
    from k3core.sampling_params import SamplingParams
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    on_gpu = device.type == "cuda"
    a = torch.randn(4096 if on_gpu else 256, 4096 if on_gpu else 256, device=device,
                    dtype=torch.bfloat16 if on_gpu else torch.float32)

    def gpu_ms() -> float:
        if not on_gpu:
            return float("nan")
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(16):
            a @ a
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def host_ms() -> float:
        start = time.perf_counter()
        sum(i * i for i in range(200_000))
        return (time.perf_counter() - start) * 1e3

    def ttft_ms(prompt: str) -> float:
        start = time.perf_counter()
        llm.generate([prompt], params)
        synchronize(device)
        return (time.perf_counter() - start) * 1e3

    pauses = (0.0, 0.0, 0.05, 0.2) if args.smoke else (0.0, 0.0, 0.2, 1.0, 5.0)
    rows = []
    for i, pause in enumerate(pauses):
        row = {"pause_s": pause}
        for name, fn in (("ttft_ms", lambda: ttft_ms(prompts[i % len(prompts)])), ("gpu_ms", gpu_ms),
                         ("host_ms", host_ms)):
            llm.flush_cache()
            synchronize(device)
            time.sleep(pause)
            row[name] = fn()
        rows.append(row)
    return {"rows": rows[1:]}


def probe_ratios(result: dict) -> dict[str, float]:
    """The offline_threads and idle_penalty sections as ratios (explanations, not targets)."""
    r: dict[str, float] = {}
    threads = result.get("offline_threads", {})
    if threads:
        r[f"offline at 1 torch thread / at {threads['default_threads']} (time)"] = (
            threads["duration_s_1_thread"] / threads["duration_s_default_threads"])
    idle = result.get("idle_penalty", {}).get("rows", [])
    if len(idle) > 1:
        for name in ("ttft_ms", "gpu_ms", "host_ms"):
            if idle[0][name] == idle[0][name]:                       # not NaN (no GPU)
                r[f"idle: {name[:-3]} after {idle[-1]['pause_s']:g} s idle / right away"] = (idle[-1][name]
                                                                                            / idle[0][name])
    return r


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process so far, from /proc (None where it cannot be read)."""
    import os
    from pathlib import Path
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_of(loop) -> dict[str, float]:
    """CPU seconds of this process and, for an EngineProcess, of the engine process."""
    import os
    out = {"this process": cpu_seconds(os.getpid())}
    if getattr(loop, "pid", None) is not None:
        out["engine process"] = cpu_seconds(loop.pid)
    return {k: v for k, v in out.items() if v is not None}


def _closed_loop_runs(loop, tokenizer, args, prompts: list[str], steps_of) -> dict:
    """The workload through an engine loop (EngineThread or EngineProcess: submit, sinks, flush_cache), all prompts
    at once and then closed-loop (args.concurrency in flight, the next prompt submitted when one finishes, as
    bench.serve_bench's clients do): duration, tokens/s and `steps_of()` around each."""
    import threading

    from k3core.sampling_params import SamplingParams
    ids = [tokenizer.encode(p) for p in prompts]
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    out = {}
    for mode in ("all_at_once", "closed_loop"):
        done, lock = threading.Event(), threading.Lock()
        state = {"next": 0, "finished": 0, "tokens": 0}

        def submit_next() -> None:
            with lock:
                index = state["next"]
                if index >= len(ids):
                    return
                state["next"] += 1
            loop.submit(f"{mode}-{index}", ids[index], params, sink, time.monotonic())

        def sink(event) -> None:
            state["tokens"] += len(event.new_token_ids)
            if event.finished:
                state["finished"] += 1
                if state["finished"] == len(ids):
                    done.set()
                elif mode == "closed_loop":
                    submit_next()
        loop.flush_cache().result(60)
        time.sleep(0.2)                           # the loop publishes after the flush; read its counters after
        before, cpu_before = steps_of(), _cpu_of(loop)
        print(f"engine loop {mode} starts at {time.monotonic():.3f}", file=sys.stderr, flush=True)
        start = time.perf_counter()
        for _ in range(len(ids) if mode == "all_at_once" else min(args.concurrency, len(ids))):
            submit_next()
        if not done.wait(600):
            raise RuntimeError(f"{mode}: the engine loop finished {state['finished']} of {len(ids)} requests")
        duration = time.perf_counter() - start
        time.sleep(0.2)
        cpu_after = _cpu_of(loop)
        after = steps_of()
        out[mode] = {"duration_s": duration, "output_tok_s": state["tokens"] / duration,
                     "steps": {k: after[k] - before[k] for k in after},
                     "cpu_share": {k: (cpu_after[k] - cpu_before.get(k, 0.0)) / duration for k in cpu_after}}
    return out


def _snapshot_steps(metrics) -> dict:
    snap = metrics.snapshot
    return {"prefill": snap.num_prefill_steps, "mixed": snap.num_mixed_steps, "decode": snap.num_decode_steps,
            "decode_rows": snap.num_decode_rows, "split_steps": snap.num_split_steps,
            "idle_s": snap.idle_seconds, "step_s": snap.step_seconds}


def engine_loop(llm, args, prompts: list[str]) -> dict:
    """The offline workload through the server's engine loop (k3core.serve.engine_thread.EngineThread) in this
    process, no HTTP. The loop closes the engine when it stops: run this after every other section on `llm`."""
    from k3core.serve.engine_thread import EngineThread
    from k3core.serve.metrics import ServerMetrics
    metrics = ServerMetrics(args.model)
    loop = EngineThread(lambda: llm, metrics)
    loop.start()
    if not loop.ready.wait(600) or loop.error is not None:
        raise RuntimeError(f"the engine loop did not start: {loop.error}")
    try:
        return _closed_loop_runs(loop, llm.tokenizer, args, prompts, lambda: _snapshot_steps(metrics))
    finally:
        loop.stop()


def _build_in_child(model: str, options: dict):
    """The engine process's LLM (module level: picklable for spawn), after saying what the child runs on."""
    import os
    import sys

    import torch

    from k3core.llm import LLM
    if os.environ.get("K3CORE_PRINT_JIT"):          # every Triton compile in the child, to find warm-up misses
        from kernels.triton.jit_watch import print_compiles
        print_compiles()
    llm = LLM(model, **options)            # sets the engine's torch threads (k3core.host_threads)
    print(f"engine process {os.getpid()}: cpus {sorted(os.sched_getaffinity(0))}, torch threads "
          f"{torch.get_num_threads()}, switch interval {sys.getswitchinterval()}", file=sys.stderr, flush=True)
    return llm


def engine_process_loop(args, common: dict, prompts: list[str]) -> dict:
    """The offline workload through the server's engine process (k3core.serve.engine_process.EngineProcess,
    spawned, ZMQ), no HTTP: the process boundary alone."""
    import functools

    from k3core.config import load_config, resolve_model
    from k3core.serve.engine_process import EngineProcess
    from k3core.serve.metrics import ServerMetrics
    from k3core.tokenizer import load_tokenizer
    metrics = ServerMetrics(args.model)
    options = dict(common, cuda_graphs=args.cuda_graphs)
    loop = EngineProcess(functools.partial(_build_in_child, args.model, options), metrics,
                         lambda: load_tokenizer(resolve_model(args.model), load_config(args.model)))
    loop.start()
    try:
        if not loop.ready.wait(600) or loop.error is not None:
            raise RuntimeError(f"the engine process did not start: {loop.error}")
        print(f"engine process ready at {time.monotonic():.3f}", file=sys.stderr, flush=True)
        return _closed_loop_runs(loop, loop.info.tokenizer, args, prompts, lambda: _snapshot_steps(metrics))
    finally:
        loop.stop()
