"""Server metrics in the Prometheus text format (version 0.0.4), written by hand: no client library needed.

The engine thread records latencies and token counts (`observe_*`) and publishes an `EngineSnapshot` after each
step; the HTTP thread renders both. One lock guards the counters, so a scrape never sees a half-updated histogram.
"""
from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine state copied on the engine thread after a step; the HTTP side only ever reads these copies."""
    num_running: int = 0
    num_waiting: int = 0
    kda_bytes: int = 0
    mla_bytes: int = 0
    free_bytes: int = 0
    capacity_bytes: int = 0
    num_slots: int = 0
    num_pages: int = 0
    prefix_cache: bool = False
    cache_queried_tokens: int = 0
    cache_hit_tokens: int = 0
    num_retractions: int = 0
    num_steps: int = 0


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)     # the last one is +Inf
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out, cumulative = [], 0
        for bound, count in zip(self.buckets, self.counts):
            cumulative += count
            out.append(f'{name}_bucket{{{labels},le="{bound:g}"}} {cumulative}')
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.count}')
        out.append(f"{name}_sum{{{labels}}} {self.total:.6f}")
        out.append(f"{name}_count{{{labels}}} {self.count}")
        return out


class ServerMetrics:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self._lock = threading.Lock()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = {}
        self.snapshot = EngineSnapshot()
        self.ready = False

    # ---- recording (engine thread) ----------------------------------------------------------------
    def observe_first_token(self, ttft: float, num_prompt_tokens: int) -> None:
        with self._lock:
            self.ttft.observe(ttft)
            self.prompt_tokens += num_prompt_tokens

    def observe_tokens(self, num_tokens: int, inter_token_latency: float | None) -> None:
        with self._lock:
            self.generation_tokens += num_tokens
            if inter_token_latency is not None:
                self.itl.observe(inter_token_latency)

    def observe_finish(self, e2e: float, finish_reason: str) -> None:
        with self._lock:
            self.e2e.observe(e2e)
            self.finished[finish_reason] = self.finished.get(finish_reason, 0) + 1

    def publish(self, snapshot: EngineSnapshot) -> None:
        self.snapshot = snapshot              # one reference swap: readers see the old or the new copy, whole

    # ---- rendering (HTTP thread) ------------------------------------------------------------------
    def render(self) -> str:
        snap = self.snapshot
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[str]) -> None:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            lines.extend(samples)

        escaped = self.model_name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        model = f'model_name="{escaped}"'
        with self._lock:
            metric("k3core_engine_ready", "gauge", "1 once the engine has finished its warm-up request.",
                   [f"k3core_engine_ready{{{model}}} {int(self.ready)}"])
            metric("k3core_num_requests_running", "gauge", "Requests holding a KDA slot and being computed.",
                   [f"k3core_num_requests_running{{{model}}} {snap.num_running}"])
            metric("k3core_num_requests_waiting", "gauge", "Requests queued for admission.",
                   [f"k3core_num_requests_waiting{{{model}}} {snap.num_waiting}"])
            metric("k3core_prompt_tokens_total", "counter", "Prompt tokens of requests that produced a token.",
                   [f"k3core_prompt_tokens_total{{{model}}} {self.prompt_tokens}"])
            metric("k3core_generation_tokens_total", "counter", "Generated tokens.",
                   [f"k3core_generation_tokens_total{{{model}}} {self.generation_tokens}"])
            metric("k3core_request_success_total", "counter", "Finished requests by finish reason.",
                   [f'k3core_request_success_total{{{model},finish_reason="{reason}"}} {count}'
                    for reason, count in sorted(self.finished.items())])
            metric("k3core_time_to_first_token_seconds", "histogram", "Arrival to first generated token.",
                   self.ttft.lines("k3core_time_to_first_token_seconds", model))
            metric("k3core_inter_token_latency_seconds", "histogram", "Time between consecutive tokens.",
                   self.itl.lines("k3core_inter_token_latency_seconds", model))
            metric("k3core_e2e_request_latency_seconds", "histogram", "Arrival to the last token.",
                   self.e2e.lines("k3core_e2e_request_latency_seconds", model))
        metric("k3core_prefix_cache_enabled", "gauge", "1 when the radix prefix cache is on.",
               [f"k3core_prefix_cache_enabled{{{model}}} {int(snap.prefix_cache)}"])
        metric("k3core_prefix_cache_queried_tokens_total", "counter", "Tokens looked up in the prefix cache.",
               [f"k3core_prefix_cache_queried_tokens_total{{{model}}} {snap.cache_queried_tokens}"])
        metric("k3core_prefix_cache_hit_tokens_total", "counter", "Looked-up tokens found in the prefix cache.",
               [f"k3core_prefix_cache_hit_tokens_total{{{model}}} {snap.cache_hit_tokens}"])
        metric("k3core_pool_bytes", "gauge", "Bytes of the unified pool by kind (kda slots, mla pages, free).",
               [f'k3core_pool_bytes{{{model},kind="{kind}"}} {value}'
                for kind, value in (("kda", snap.kda_bytes), ("mla", snap.mla_bytes), ("free", snap.free_bytes))])
        metric("k3core_pool_capacity_bytes", "gauge", "Bytes of the unified pool.",
               [f"k3core_pool_capacity_bytes{{{model}}} {snap.capacity_bytes}"])
        metric("k3core_pool_slots", "gauge", "KDA slots in use (working slots and cached checkpoints).",
               [f"k3core_pool_slots{{{model}}} {snap.num_slots}"])
        metric("k3core_pool_pages", "gauge", "MLA pages in use.",
               [f"k3core_pool_pages{{{model}}} {snap.num_pages}"])
        metric("k3core_num_retractions_total", "counter", "Requests retracted to free memory and recomputed.",
               [f"k3core_num_retractions_total{{{model}}} {snap.num_retractions}"])
        metric("k3core_engine_steps_total", "counter", "Engine steps run.",
               [f"k3core_engine_steps_total{{{model}}} {snap.num_steps}"])
        return "\n".join(lines) + "\n"


def parse_metrics(text: str) -> dict[str, float]:
    """`{"name{labels}": value}` from Prometheus text; comments skipped. For tests and the benchmark."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def metric_sum(values: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (other labels, e.g. model_name, ignored)."""
    total = 0.0
    for key, value in values.items():
        base, _, rest = key.partition("{")
        if base == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total
