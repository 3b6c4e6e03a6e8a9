"""Server metrics on `prometheus_client`, in a registry of this server's own (never the process-wide one, so that
several servers in one process, as in the tests, do not clash).

Two families of names describe the same events:
* `k3core_*`: this project's names (docs/serving.md lists them);
* `vllm:*`: the names, labels (`model_name`, `engine`) and buckets of vLLM v1, so that a Grafana board built for
  vLLM reads this server unchanged.

The engine thread records latencies and token counts (`observe_*`) and publishes an `EngineSnapshot` after each
step; a scrape renders both. One lock guards recording and rendering, so a scrape never sees a half-updated
histogram. Values the engine keeps itself (queue lengths, pool bytes, prefix-cache and step counters) are read
from the latest snapshot at scrape time by `_SnapshotCollector`.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

# vLLM v1's buckets (vllm/v1/metrics/loggers.py), kept equal so that quantiles compare across engines
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                              10.0, 20.0, 40.0, 80.0)
VLLM_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
VLLM_FINISH_REASONS = ("stop", "length", "abort")     # pre-created at 0, as vLLM does, so dashboards see them
DEFAULT_MAX_MODEL_LEN = 2_000_000                     # token-count buckets end here when no length is given
ENGINE_INDEX = "0"                                    # vLLM's `engine` label: this server runs one engine


def one_two_five_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


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
    cache_bytes: int = 0            # of kda_bytes + mla_bytes, what the prefix cache owns (checkpoints, tree pages)
    # the steps' mix (k3core.step_counts) and where the engine loop's time went
    num_prefill_steps: int = 0
    num_mixed_steps: int = 0
    num_decode_steps: int = 0
    num_decode_rows: int = 0
    num_prefill_tokens: int = 0
    num_graph_steps: int = 0
    num_split_steps: int = 0
    idle_seconds: float = 0.0       # the loop waited for a command with nothing to run
    step_seconds: float = 0.0       # the loop ran engine steps (launch, and reading the step before)

    @property
    def kv_cache_usage(self) -> float:
        """vLLM's `kv_cache_usage_perc`: the fraction of the pool held by requests. What the prefix cache owns counts
        as free, as vLLM counts its evictable cached blocks, also while a request reads it (a shared prefix, which
        vLLM counts as used): so this reads at most what vLLM would."""
        if self.capacity_bytes <= 0:
            return 0.0
        held = self.kda_bytes + self.mla_bytes - self.cache_bytes
        return min(max(held / self.capacity_bytes, 0.0), 1.0)


class ServerMetrics:
    def __init__(self, model_name: str, max_model_len: int | None = None):
        """max_model_len: where the per-request token-count buckets end (vLLM's choice); None: a generous bound."""
        self.model_name = model_name
        self.snapshot = EngineSnapshot()
        self.ready = False
        self._lock = threading.Lock()
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_SnapshotCollector(self))
        k3 = (["model_name"], (model_name,))                          # (label names, this server's values)
        vllm = (["model_name", "engine"], (model_name, ENGINE_INDEX))

        def histogram(name: str, doc: str, buckets, labels: tuple[list[str], tuple[str, ...]]):
            return Histogram(name, doc, labels[0], buckets=buckets, registry=self.registry).labels(*labels[1])

        def counter(name: str, doc: str, labels: tuple[list[str], tuple[str, ...]]):
            return Counter(name, doc, labels[0], registry=self.registry).labels(*labels[1])

        self.ttft = histogram("k3core_time_to_first_token_seconds", "Arrival to first generated token.",
                              TTFT_BUCKETS, k3)
        self.itl = histogram("k3core_inter_token_latency_seconds", "Time between consecutive tokens.",
                             ITL_BUCKETS, k3)
        self.e2e = histogram("k3core_e2e_request_latency_seconds", "Arrival to the last token.", E2E_BUCKETS, k3)
        self.prompt_tokens = counter("k3core_prompt_tokens", "Prompt tokens of requests that produced a token.", k3)
        self.generation_tokens = counter("k3core_generation_tokens", "Generated tokens.", k3)
        self._finished = Counter("k3core_request_success", "Finished requests by finish reason.",
                                 ["model_name", "finish_reason"], registry=self.registry)

        token_buckets = one_two_five_buckets(max_model_len or DEFAULT_MAX_MODEL_LEN)
        self.vllm_ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in "
                                   "seconds.", VLLM_TTFT_BUCKETS, vllm)
        # vLLM emits both names with the same observations (time_per_output_token is the older one)
        self.vllm_itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                                  VLLM_TOKEN_LATENCY_BUCKETS, vllm)
        self.vllm_tpot = histogram("vllm:time_per_output_token_seconds", "Histogram of time per output token in "
                                   "seconds (the same observations as vllm:inter_token_latency_seconds).",
                                   VLLM_TOKEN_LATENCY_BUCKETS, vllm)
        self.vllm_e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                                  VLLM_REQUEST_LATENCY_BUCKETS, vllm)
        self.vllm_queue = histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase "
                                    "for request.", VLLM_REQUEST_LATENCY_BUCKETS, vllm)
        self.vllm_request_prompt = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                             token_buckets, vllm)
        self.vllm_request_generation = histogram("vllm:request_generation_tokens", "Number of generation tokens "
                                                 "processed.", token_buckets, vllm)
        self.vllm_prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.", vllm)
        self.vllm_generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                              vllm)
        self._vllm_finished = Counter("vllm:request_success", "Count of successfully processed requests.",
                                      vllm[0] + ["finished_reason"], registry=self.registry)
        for reason in VLLM_FINISH_REASONS:
            self._finished.labels(model_name, reason)
            self._vllm_finished.labels(*vllm[1], reason)

    # ---- recording (engine thread, or the engine process's receiver) ---------------------------------------
    def observe_first_token(self, ttft: float, num_prompt_tokens: int) -> None:
        with self._lock:
            self.ttft.observe(ttft)
            self.vllm_ttft.observe(ttft)
            self.prompt_tokens.inc(num_prompt_tokens)
            self.vllm_prompt_tokens.inc(num_prompt_tokens)

    def observe_tokens(self, num_tokens: int, inter_token_latency: float | None) -> None:
        with self._lock:
            self.generation_tokens.inc(num_tokens)
            self.vllm_generation_tokens.inc(num_tokens)
            if inter_token_latency is not None:
                self.itl.observe(inter_token_latency)
                self.vllm_itl.observe(inter_token_latency)
                self.vllm_tpot.observe(inter_token_latency)

    def observe_finish(self, e2e: float, finish_reason: str, queue_time: float = 0.0, num_prompt_tokens: int = 0,
                       num_generation_tokens: int = 0) -> None:
        """One finished (or aborted) request: its latency, time spent waiting for admission, and token counts."""
        with self._lock:
            self.e2e.observe(e2e)
            self._finished.labels(self.model_name, finish_reason).inc()
            self.vllm_e2e.observe(e2e)
            self.vllm_queue.observe(queue_time)
            self.vllm_request_prompt.observe(num_prompt_tokens)
            self.vllm_request_generation.observe(num_generation_tokens)
            self._vllm_finished.labels(self.model_name, ENGINE_INDEX, finish_reason).inc()

    def publish(self, snapshot: EngineSnapshot) -> None:
        self.snapshot = snapshot              # one reference swap: readers see the old or the new copy, whole

    # ---- rendering (HTTP thread) ------------------------------------------------------------------------------
    def render(self) -> str:
        with self._lock:
            return generate_latest(self.registry).decode()


class _SnapshotCollector:
    """The gauges and engine-kept counters, read from the latest EngineSnapshot whenever the registry is scraped."""

    def __init__(self, metrics: ServerMetrics):
        self._metrics = metrics

    def collect(self):
        metrics, snap = self._metrics, self._metrics.snapshot
        k3_values, vllm_values = [metrics.model_name], [metrics.model_name, ENGINE_INDEX]

        def k3(family, name: str, doc: str, value: float):
            metric = family(name, doc, labels=["model_name"])
            metric.add_metric(k3_values, value)
            return metric

        def vllm(family, name: str, doc: str, value: float):
            metric = family(name, doc, labels=["model_name", "engine"])
            metric.add_metric(vllm_values, value)
            return metric

        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        yield k3(gauge, "k3core_engine_ready", "1 once the engine has finished its warm-up request.",
                 int(metrics.ready))
        yield k3(gauge, "k3core_num_requests_running", "Requests holding a KDA slot and being computed.",
                 snap.num_running)
        yield k3(gauge, "k3core_num_requests_waiting", "Requests queued for admission.", snap.num_waiting)
        yield k3(gauge, "k3core_prefix_cache_enabled", "1 when the radix prefix cache is on.", int(snap.prefix_cache))
        yield k3(counter, "k3core_prefix_cache_queried_tokens", "Tokens looked up in the prefix cache.",
                 snap.cache_queried_tokens)
        yield k3(counter, "k3core_prefix_cache_hit_tokens", "Looked-up tokens found in the prefix cache.",
                 snap.cache_hit_tokens)
        pool = GaugeMetricFamily("k3core_pool_bytes", "Bytes of the unified pool by kind (kda slots, mla pages, "
                                 "free).", labels=["model_name", "kind"])
        for kind, value in (("kda", snap.kda_bytes), ("mla", snap.mla_bytes), ("free", snap.free_bytes)):
            pool.add_metric([metrics.model_name, kind], value)
        yield pool
        yield k3(gauge, "k3core_pool_capacity_bytes", "Bytes of the unified pool.", snap.capacity_bytes)
        yield k3(gauge, "k3core_pool_slots", "KDA slots in use (working slots and cached checkpoints).",
                 snap.num_slots)
        yield k3(gauge, "k3core_pool_pages", "MLA pages in use.", snap.num_pages)
        yield k3(counter, "k3core_num_retractions", "Requests retracted to free memory and recomputed.",
                 snap.num_retractions)
        yield k3(counter, "k3core_engine_steps", "Engine steps run.", snap.num_steps)
        kinds = CounterMetricFamily("k3core_engine_steps_by_kind", "Engine steps by what they held: prefill "
                                    "chunks only, prefill chunks and decodes (mixed), decodes only.",
                                    labels=["model_name", "kind"])
        for kind, value in (("prefill", snap.num_prefill_steps), ("mixed", snap.num_mixed_steps),
                            ("decode", snap.num_decode_steps)):
            kinds.add_metric([metrics.model_name, kind], value)
        yield kinds
        yield k3(counter, "k3core_engine_decode_rows", "Decode rows summed over steps (over the mixed and decode "
                 "steps: the mean decode batch).", snap.num_decode_rows)
        yield k3(counter, "k3core_engine_prefill_tokens", "Prefill tokens summed over steps.",
                 snap.num_prefill_tokens)
        yield k3(counter, "k3core_engine_graph_steps", "Steps whose decodes were replayed from a captured graph.",
                 snap.num_graph_steps)
        yield k3(counter, "k3core_engine_split_steps", "Mixed steps split into a graph-replayed decode and an "
                 "eager forward of the prefill chunks.", snap.num_split_steps)
        yield k3(counter, "k3core_engine_idle_seconds", "Seconds the engine loop waited with nothing to run.",
                 snap.idle_seconds)
        yield k3(counter, "k3core_engine_step_seconds", "Seconds the engine loop spent in steps.",
                 snap.step_seconds)

        yield vllm(gauge, "vllm:num_requests_running", "Number of requests in model execution batches.",
                   snap.num_running)
        yield vllm(gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                   snap.num_waiting)
        yield vllm(gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                   snap.kv_cache_usage)
        yield vllm(gauge, "vllm:gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage. "
                   "DEPRECATED: Use vllm:kv_cache_usage_perc instead.", snap.kv_cache_usage)
        yield vllm(counter, "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried "
                   "tokens.", snap.cache_queried_tokens)
        yield vllm(counter, "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                   snap.cache_hit_tokens)
        yield vllm(counter, "vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                   snap.num_retractions)


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
