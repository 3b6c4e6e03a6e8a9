"""Serving benchmark: concurrent streaming clients against a running `python -m k3core.serve`.

    python -m bench.serve_bench --url http://127.0.0.1:30000 --dataset shared-prefix --num-prompts 64 \
        --max-concurrency 8 --output bench/results/serve_bench_shared_prefix_cache_on.json

Reports TTFT, inter-token latency (ITL, between streamed chunks), time per output token (TPOT, per request) and
end-to-end latency (mean, median, p99), output tokens/s and requests/s, and the server's prefix-cache hit rate over
the run (from /metrics). Datasets:
* random: prompts of `--input-len` random words, nothing shared;
* shared-prefix: `--num-groups` groups; every prompt of a group starts with the same `--prefix-len` system prompt
  and ends with its own `--question-len` question; prompts of all groups are shuffled together.
Every request asks for exactly `--output-len` tokens (ignore_eos). A request that fails or returns another number
of tokens is counted as failed, and a run with failures prints no speeds and exits with status 1.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import httpx
from tqdm import tqdm

from k3core.serve.metrics import metric_sum, parse_metrics

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


@dataclass
class RequestResult:
    ok: bool
    prompt_chars: int
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""


# ---- datasets ---------------------------------------------------------------------------------------------
def random_text(rng: random.Random, num_chars: int) -> str:
    """About `num_chars` characters of random words (the byte-level tokenizer makes that `num_chars` tokens)."""
    words: list[str] = []
    length = 0
    while length < num_chars:
        word = rng.choice(WORDS)
        words.append(word)
        length += len(word) + 1
    return " ".join(words)[:num_chars]


def make_prompts(args: argparse.Namespace) -> list[str]:
    rng = random.Random(args.seed)
    if args.dataset == "random":
        return [random_text(rng, args.input_len) for _ in range(args.num_prompts)]
    prefixes = [f"System prompt {g}: " + random_text(rng, args.prefix_len) for g in range(args.num_groups)]
    prompts = [prefixes[i % args.num_groups] + "\nQuestion: " + random_text(rng, args.question_len)
               for i in range(args.num_prompts)]
    rng.shuffle(prompts)
    return prompts


# ---- one request --------------------------------------------------------------------------------------------
async def run_one(client: httpx.AsyncClient, url: str, model: str, prompt: str, output_len: int,
                  headers: dict[str, str]) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    result = RequestResult(ok=False, prompt_chars=len(prompt))
    start = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                now = time.perf_counter()
                if "error" in event:
                    result.error = event["error"].get("message", "error event")
                    return result
                if event.get("usage"):
                    result.output_tokens = event["usage"]["completion_tokens"]
                    result.cached_tokens = event["usage"]["prompt_tokens_details"]["cached_tokens"]
                if event.get("choices"):
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2e = time.perf_counter() - start
    result.ok = result.output_tokens == output_len
    if not result.ok:
        result.error = f"got {result.output_tokens} tokens, asked for {output_len}"
    return result


async def run_all(args: argparse.Namespace, prompts: list[str], model: str,
                  headers: dict[str, str]) -> tuple[list[RequestResult], float]:
    limit = asyncio.Semaphore(args.max_concurrency)
    rng = random.Random(args.seed + 1)
    progress = tqdm(total=len(prompts), desc=f"{args.dataset}", unit="req")
    timeout = httpx.Timeout(args.timeout)
    limits = httpx.Limits(max_connections=args.max_concurrency + 4)

    async def limited(client: httpx.AsyncClient, prompt: str) -> RequestResult:
        async with limit:
            result = await run_one(client, args.url, model, prompt, args.output_len, headers)
        progress.update(1)
        return result

    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        tasks = []
        start = time.perf_counter()
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(client, prompt)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))     # Poisson arrivals
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    progress.close()
    return list(results), duration


# ---- summary ------------------------------------------------------------------------------------------------
def stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean_ms": float("nan"), "median_ms": float("nan"), "p99_ms": float("nan")}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {"mean_ms": 1e3 * statistics.fmean(ordered), "median_ms": 1e3 * statistics.median(ordered),
            "p99_ms": 1e3 * p99}


def summarize(results: list[RequestResult], duration: float, cache_before: dict, cache_after: dict) -> dict:
    good = [r for r in results if r.ok]
    queried = metric_sum(cache_after, "k3core_prefix_cache_queried_tokens_total") - \
        metric_sum(cache_before, "k3core_prefix_cache_queried_tokens_total")
    hit = metric_sum(cache_after, "k3core_prefix_cache_hit_tokens_total") - \
        metric_sum(cache_before, "k3core_prefix_cache_hit_tokens_total")
    output_tokens = sum(r.output_tokens for r in good)
    return {
        "num_requests": len(results), "num_failed": len(results) - len(good),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "requests_per_s": len(good) / duration,
        "output_tokens_per_s": output_tokens / duration,
        "total_output_tokens": output_tokens,
        "ttft": stats([r.ttft for r in good]),
        "itl": stats([x for r in good for x in r.itls]),
        "tpot": stats([(r.e2e - r.ttft) / (r.output_tokens - 1) for r in good if r.output_tokens > 1]),
        "e2e": stats([r.e2e for r in good]),
        "server_prefix_cache_enabled": bool(metric_sum(cache_after, "k3core_prefix_cache_enabled")),
        "server_cache_queried_tokens": queried, "server_cache_hit_tokens": hit,
        "server_cache_hit_rate": hit / queried if queried else 0.0,
        "usage_cached_tokens": sum(r.cached_tokens for r in good),
        "server_steps": server_steps(cache_before, cache_after),
    }


def server_steps(before: dict, after: dict) -> dict:
    """The engine's steps between two /metrics reads: by kind, decode rows (and their mean per step with decodes),
    prefill tokens, and the seconds its loop spent idle and in steps (k3core.step_counts)."""
    def delta(name: str, **labels: str) -> float:
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)
    out = {kind: delta("k3core_engine_steps_by_kind_total", kind=kind) for kind in ("prefill", "mixed", "decode")}
    out["decode_rows"] = delta("k3core_engine_decode_rows_total")
    out["prefill_tokens"] = delta("k3core_engine_prefill_tokens_total")
    out["graph_steps"] = delta("k3core_engine_graph_steps_total")
    out["split_steps"] = delta("k3core_engine_split_steps_total")
    with_decode = out["mixed"] + out["decode"]
    out["mean_decode_rows"] = out["decode_rows"] / with_decode if with_decode else 0.0
    out["idle_s"] = delta("k3core_engine_idle_seconds_total")
    out["step_s"] = delta("k3core_engine_step_seconds_total")
    return out


def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    import torch
    return {"cpu": cpu, "num_cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "commit": commit,
            "load_average_1m_at_end": os.getloadavg()[0],   # other work on the box inflates every latency

            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def print_summary(summary: dict) -> None:
    print(f"requests: {summary['num_requests']} ({summary['num_failed']} failed) in {summary['duration_s']:.2f} s")
    print(f"throughput: {summary['requests_per_s']:.2f} req/s, {summary['output_tokens_per_s']:.1f} output tok/s")
    for name in ("ttft", "itl", "tpot", "e2e"):
        s = summary[name]
        print(f"{name.upper():>5}  mean {s['mean_ms']:9.2f} ms   median {s['median_ms']:9.2f} ms   "
              f"p99 {s['p99_ms']:9.2f} ms")
    state = "on" if summary["server_prefix_cache_enabled"] else "off"
    print(f"prefix cache ({state}): hit rate {summary['server_cache_hit_rate']:.1%} "
          f"({summary['server_cache_hit_tokens']:.0f} of {summary['server_cache_queried_tokens']:.0f} tokens)")
    steps = summary["server_steps"]
    print(f"engine steps: {steps['prefill']:.0f} prefill, {steps['mixed']:.0f} mixed, {steps['decode']:.0f} decode; "
          f"{steps['mean_decode_rows']:.1f} decode rows per step with decodes; loop {steps['step_s']:.2f} s in "
          f"steps, {steps['idle_s']:.2f} s idle")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.serve_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--dataset", choices=["random", "shared-prefix"], default="random")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: all")
    parser.add_argument("--input-len", type=int, default=128, help="random: prompt length in characters")
    parser.add_argument("--output-len", type=int, default=32, help="tokens per request (ignore_eos)")
    parser.add_argument("--num-groups", type=int, default=4, help="shared-prefix: groups of prompts")
    parser.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: system prompt characters")
    parser.add_argument("--question-len", type=int, default=32, help="shared-prefix: question characters")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key", default=os.environ.get("K3CORE_API_KEY"))
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--label", default="", help="free text stored in the result (e.g. 'cache off')")
    parser.add_argument("--output", default=None, help="write the JSON result here")
    args = parser.parse_args(argv)

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        model = httpx.get(args.url + "/v1/models", headers=headers, timeout=10).json()["data"][0]["id"]
        before = parse_metrics(httpx.get(args.url + "/metrics", timeout=10).text)
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        print(f"error: cannot reach a k3core server at {args.url} ({exc}); start one with "
              f"`python -m k3core.serve`", file=sys.stderr)
        return 2
    prompts = make_prompts(args)
    load_at_start = os.getloadavg()[0]
    results, duration = asyncio.run(run_all(args, prompts, model, headers))
    after = parse_metrics(httpx.get(args.url + "/metrics", timeout=10).text)
    summary = summarize(results, duration, before, after)
    config = {k: v for k, v in vars(args).items() if k not in ("api_key", "output")}
    if config["request_rate"] == float("inf"):
        config["request_rate"] = "inf"                # strict JSON has no Infinity
    record = {"benchmark": "serve_bench", "model": model, "config": config,
              "machine": {**machine(), "load_average_1m_at_start": load_at_start}, "result": summary}
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(record, indent=2, default=str) + "\n")
    if summary["num_failed"]:
        print(f"{summary['num_failed']} of {len(results)} requests failed (first errors: {summary['errors']}); "
              f"no speeds reported", file=sys.stderr)
        return 1
    print_summary(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
