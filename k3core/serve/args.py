"""Command-line and YAML arguments of `python -m k3core.serve`, merged into one typed `ServerArgs`.

Precedence: a flag given on the command line beats the same key in `--config FILE.yaml`, which beats the built-in
default. YAML keys are the long flag names (`memory-fraction: 0.3`; `memory_fraction` is accepted too).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from k3core.host_threads import GPU_ENGINE_CPU_THREADS, default_engine_threads  # noqa: F401 (re-exported)

DEFAULT_MODEL = "k3-demo"           # the shipped trained demo model (k3core/presets/k3-demo)


@dataclass
class ServerArgs:
    model: str = DEFAULT_MODEL
    served_model_name: str | None = None     # the name clients pass as `model`; default: the --model value
    backend: str = "auto"
    device: str = "auto"                     # auto: cpu for the default k3-demo, else the GPU when there is one
    dtype: str = "auto"                      # auto: float32 on the CPU, bfloat16 on a GPU
    expert_format: str | None = None         # routed experts: mxfp4 | bf16 (default: as the checkpoint has them)
    seed: int = 0
    cpu_threads: int | None = None           # torch intra-op threads on the CPU; None: all cores but one
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    context_length: int | None = None        # cap below the model's max_position_embeddings
    default_max_tokens: int = 32768          # chat requests without max_tokens: min(this, room left in context)
    max_body_bytes: int = 32 << 20           # larger request bodies get 413
    # request limits (docs/serving.md, "Limits")
    max_choices_per_request: int = 1024      # prompts x n of one request
    max_queued_requests: int = 4096          # engine requests held (running or waiting); more: 429
    max_queued_tokens: int = 1 << 24         # their prompt tokens; more: 429
    request_timeout: float | None = None     # seconds from arrival until a request is aborted (504); None: never
    header_read_timeout: float = 10.0        # seconds a connection may take to send a request's headers
    body_read_timeout: float = 60.0          # seconds a request may take to send its body (408)
    keep_alive_timeout: float = 5.0          # seconds an idle keep-alive connection stays open
    max_stream_buffer_events: int = 8192     # events a stream may hold for a client that does not read; more: abort
    hide_cached_tokens: bool = False         # leave usage.prompt_tokens_details.cached_tokens out of responses
    log_level: str = "info"
    disable_log_requests: bool = False       # no access-log line per request (error lines stay)
    # engine options (k3core.engine.EngineOptions)
    memory_fraction: float = 0.5
    memory_bytes: int | None = None
    max_running_requests: int = 64
    chunked_prefill_tokens: int | None = None   # None: 2048 on a GPU, 512 on the CPU
    page_size: int = 16
    checkpoint_interval: int | None = None   # None: from the state size (EngineOptions)
    disable_prefix_cache: bool = False
    disable_overlap: bool = False
    disable_mixed_step_split: bool = False    # one forward over a step's prefill chunks and decodes (debugging)
    engine_in_process: bool = False
    no_http_warmup: bool = False              # /health turns 200 without warm-up requests through the HTTP path
    cuda_graphs: bool = False
    graph_batch_sizes: str = "1,2,4,8,16,32,64"   # comma-separated; a YAML list is accepted too
    graph_max_context: int = 32768
    # parallel plan (k3core.parallel): ranks are started by the server itself
    tp: int = 1
    pp: int = 1
    dcp: int = 1
    ep: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None         # host:port of node 0's rank 0 (default: a free loopback port)
    rank_heartbeat_timeout: float = 5.0       # seconds without a heartbeat before a live rank counts as wedged

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def engine_options(self) -> dict[str, Any]:
        """Keyword arguments for `LLM(..., **engine_options)`."""
        return dict(prefix_cache=not self.disable_prefix_cache, chunked_prefill_tokens=self.chunked_prefill_tokens,
                    max_running_requests=self.max_running_requests, page_size=self.page_size,
                    checkpoint_interval=self.checkpoint_interval, memory_bytes=self.memory_bytes,
                    overlap=not self.disable_overlap, split_mixed_steps=not self.disable_mixed_step_split,
                    memory_fraction=self.memory_fraction, cuda_graphs=self.cuda_graphs,
                    graph_batch_sizes=parse_batch_sizes(self.graph_batch_sizes),
                    graph_max_context=self.graph_max_context)

    def plan(self):
        from k3core.parallel.plan import ParallelPlan
        return ParallelPlan(tp=self.tp, pp=self.pp, dcp=self.dcp, ep=self.ep)

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch
        if self.model == DEFAULT_MODEL or not torch.cuda.is_available():
            return "cpu"
        return "cuda"

    def resolved_cpu_threads(self) -> int:
        """Torch intra-op threads of the engine: --cpu-threads, else k3core.host_threads' default (1 beside a GPU,
        all cores but one on the CPU; why and what was measured is there)."""
        if self.cpu_threads is not None:
            return self.cpu_threads
        return default_engine_threads(self.resolved_device())

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "float32" if self.resolved_device() == "cpu" else "bfloat16"


_HELP = {
    "model": f"checkpoint directory, config file or preset name (default {DEFAULT_MODEL}: the shipped trained "
             "demo model, CPU; architecture presets such as k3-tiny have random weights)",
    "served_model_name": "the model name clients must send (default: the --model value)",
    "backend": "op backend: auto | cuda | rocm | torch",
    "device": "cpu, cuda, cuda:1, ... (auto: cpu for the default k3-demo, else a GPU when one is visible)",
    "dtype": "float32 | bfloat16 | float16 (auto: float32 on the CPU, bfloat16 on a GPU)",
    "expert_format": "routed-expert storage, mxfp4 (packed, W4A16 kernels) or bf16 (default: as the checkpoint "
                     "stores them; a preset's own setting)",
    "seed": "seed of the random weights of a preset",
    "cpu_threads": "torch intra-op threads of the engine (default: on the CPU all cores but one, which is left to "
                   "the HTTP side; beside a GPU 1, since more only spin against the engine's own thread)",
    "host": "address to bind (default loopback only; 0.0.0.0 exposes the server to the network)",
    "port": "port to bind",
    "api_key": "require `Authorization: Bearer KEY` on /v1/*, /abort_request and /flush_cache",
    "context_length": "maximum prompt + completion tokens (default: the model's max_position_embeddings)",
    "default_max_tokens": "cap on max_tokens of a chat request that gives none, which otherwise gets all the room "
                          "left in the context and the pool (a thinking model needs room to think before answering)",
    "max_body_bytes": "largest accepted request body in bytes (larger: 413)",
    "max_choices_per_request": "most choices (prompts x n) one request may ask for (more: 400)",
    "max_queued_requests": "most engine requests (choices) the server holds, running or waiting; a request that "
                           "would pass it gets 429 with Retry-After",
    "max_queued_tokens": "most prompt tokens the server holds over those requests (more: 429 with Retry-After)",
    "request_timeout": "seconds after arrival at which a request is aborted (504, or an error event in a stream); "
                       "default: no deadline",
    "header_read_timeout": "seconds a connection may take to send its request line and headers (slow: closed)",
    "body_read_timeout": "seconds a request may take to send its body (slow: 408)",
    "keep_alive_timeout": "seconds an idle keep-alive connection stays open",
    "max_stream_buffer_events": "events a streamed response may hold for a client that reads too slowly; past it "
                                "the request is aborted and its memory freed",
    "hide_cached_tokens": "leave usage.prompt_tokens_details.cached_tokens out, so that one client cannot tell "
                          "from it which prompts others sent (the prefix cache is shared)",
    "log_level": "log level of the server and uvicorn: critical | error | warning | info | debug",
    "disable_log_requests": "do not write the access-log line of every request (logger k3core.serve.access); the "
                            "line with the reason of every 4xx/5xx response stays",
    "memory_fraction": "pool size as a fraction of free device memory (CPU: of 1 GiB)",
    "memory_bytes": "pool size in bytes (overrides --memory-fraction)",
    "max_running_requests": "most requests decoding at once",
    "chunked_prefill_tokens": "token budget of one engine step (prefill is chunked to fit; default 2048 on a GPU, "
                              "512 on the CPU)",
    "page_size": "tokens per MLA page",
    "checkpoint_interval": "tokens between cached KDA checkpoints (a multiple of --page-size; default: the fewest "
                           "pages whose MLA bytes reach one KDA state slot, so checkpoints never outweigh the KV)",
    "disable_prefix_cache": "turn the radix prefix cache off",
    "disable_overlap": "run each step's host work after its GPU work instead of beside the next step's (debugging)",
    "disable_mixed_step_split": "with --cuda-graphs, run a step of prefill chunks and decodes as one eager forward "
                                "instead of the decodes replayed beside an eager forward of the chunks (debugging; "
                                "the same tokens, slower)",
    "engine_in_process": "run the engine on a thread of the server process instead of a process of its own "
                         "(debugging; the HTTP side then shares the engine's GIL)",
    "no_http_warmup": "say ready (/health 200) as soon as the engine has warmed up, without first sending warm-up "
                      "requests through the HTTP path (the first client request then pays that path's one-time "
                      "costs)",
    "cuda_graphs": "replay decode steps from CUDA/HIP graphs captured at start (one GPU, backend cuda or rocm)",
    "graph_batch_sizes": "batch sizes to capture a decode graph for, comma-separated (larger batches run eagerly)",
    "graph_max_context": "longest context a replayed decode step holds; longer ones run eagerly (a wider graph "
                         "packs a wider page table every step and splits MLA decode of short contexts coarser)",
    "tp": "tensor-parallel size (KDA/MLA heads and MLP widths split; all-reduce after row-parallel projections)",
    "pp": "pipeline stages (contiguous layers; prefill cut into micro-chunks that flow through the stages)",
    "dcp": "decode context parallelism: MLA KV split by token position inside the ranks of a stage",
    "ep": "expert parallelism: 1, or the ranks per stage (max(tp, dcp)) to split the routed experts",
    "nnodes": "number of nodes (each starts its local ranks; node 0's first rank serves HTTP)",
    "node_rank": "this node's index among --nnodes",
    "dist_init_addr": "host:port where node 0's first rank listens for the others (required when --nnodes > 1)",
    "rank_heartbeat_timeout": "seconds a running rank or the engine process may go without a heartbeat before the "
                              "server counts it as wedged, turns /health to 503 and exits (docs/serving.md, "
                              "Liveness)",
}


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    """"1,2,4" -> (1, 2, 4); raises ValueError with the flag's name on anything else."""
    try:
        return tuple(int(part) for part in str(text).split(","))
    except ValueError:
        raise ValueError(f"--graph-batch-sizes {text!r} must be comma-separated integers, e.g. 1,2,4,8") from None


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m k3core.serve",
                                     description="OpenAI-compatible HTTP server for k3core models.")
    parser.add_argument("--config", default=None, help="YAML file whose keys are these long flag names")
    for field in fields(ServerArgs):
        default = field.default
        kind = {"int | None": int, "float": float, "float | None": float, "int": int, "str | None": str,
                "str": str}.get(str(field.type))
        if field.type == "bool" or isinstance(default, bool):
            # default=None so that "not given" is distinguishable from "given" when merging with the YAML file
            parser.add_argument(_flag(field.name), action="store_true", default=None, help=_HELP[field.name])
        else:
            parser.add_argument(_flag(field.name), type=kind or str, default=None,
                                help=f"{_HELP[field.name]} [default: {default}]")
    return parser


def _load_yaml(path: str) -> dict[str, Any]:
    import yaml
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"config file {path!r} does not exist; pass an existing YAML file to --config")
    data = yaml.safe_load(file.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path!r} must hold a mapping of flag names to values")
    known = {f.name for f in fields(ServerArgs)}
    out = {}
    for key, value in data.items():
        name = str(key).lstrip("-").replace("-", "_")
        if name not in known:
            raise ValueError(f"unknown key {key!r} in {path}; valid keys: "
                             f"{', '.join(sorted(_flag(k)[2:] for k in known))}")
        out[name] = value
    return out


def _coerce(name: str, value: Any) -> Any:
    """Give a YAML value the type of the field (YAML reads `1e9` as a string, `memory-bytes: 1_000` as int)."""
    default = getattr(ServerArgs, name)
    if value is None:
        return None
    try:
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise ValueError
            return value
        if isinstance(default, float) or name == "request_timeout":
            return float(value)
        if name == "graph_batch_sizes" and isinstance(value, list):
            return ",".join(str(int(v)) for v in value)
        if isinstance(default, int) or name in ("memory_bytes", "context_length", "cpu_threads",
                                                "checkpoint_interval", "chunked_prefill_tokens"):
            as_float = float(value)
            if as_float != int(as_float):
                raise ValueError
            return int(as_float)
        return str(value)
    except (TypeError, ValueError):
        raise ValueError(f"config key {_flag(name)[2:]!r} has value {value!r} of the wrong type; "
                         f"give a {type(default).__name__ if default is not None else 'number'}") from None


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    """Parse flags, merge the YAML file under them, and check the values. Raises SystemExit on bad input."""
    parser = build_parser()
    namespace = parser.parse_args(argv)
    merged: dict[str, Any] = {}
    if namespace.config is not None:
        try:
            merged.update({k: _coerce(k, v) for k, v in _load_yaml(namespace.config).items()})
        except ValueError as exc:
            parser.error(str(exc))
    merged.update({k: v for k, v in vars(namespace).items() if k != "config" and v is not None})
    args = ServerArgs(**merged)
    problem = check_args(args)
    if problem:
        parser.error(problem)
    return args


def check_args(args: ServerArgs) -> str | None:
    """The first problem with the arguments, as a sentence, or None."""
    if not 0 < args.port < 65536:
        return f"--port {args.port} is not a TCP port; give 1..65535"
    if args.backend not in ("auto", "cuda", "rocm", "torch"):
        return f"--backend {args.backend!r} is unknown; choose auto, cuda, rocm or torch"
    if args.context_length is not None and args.context_length < 2:
        return f"--context-length {args.context_length} is too small; give at least 2"
    if args.cpu_threads is not None and args.cpu_threads < 1:
        return f"--cpu-threads {args.cpu_threads} must be at least 1"
    if args.default_max_tokens < 1:
        return "--default-max-tokens must be at least 1"
    if args.max_body_bytes < 1024:
        return "--max-body-bytes must be at least 1024"
    for name in ("max_choices_per_request", "max_queued_requests", "max_queued_tokens", "max_stream_buffer_events"):
        if getattr(args, name) < 1:
            return f"{_flag(name)} must be at least 1"
    for name in ("request_timeout", "header_read_timeout", "body_read_timeout", "keep_alive_timeout"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            return f"{_flag(name)} must be a positive number of seconds"
    try:
        from k3core.engine import EngineOptions
        EngineOptions(**args.engine_options())
    except ValueError as exc:
        return f"bad engine option: {exc}"
    try:
        plan = args.plan()
    except ValueError as exc:
        return f"bad parallel plan: {exc}"
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        return f"--node-rank {args.node_rank} must be in 0..{args.nnodes - 1}"
    if plan.world_size % args.nnodes:
        return f"the plan's {plan.world_size} ranks do not split evenly over --nnodes {args.nnodes}"
    if args.nnodes > 1 and not args.dist_init_addr:
        return "--dist-init-addr HOST:PORT is required when --nnodes > 1"
    if not args.rank_heartbeat_timeout > 0:
        return f"--rank-heartbeat-timeout {args.rank_heartbeat_timeout} must be a positive number of seconds"
    if plan.world_size > 1 and args.cuda_graphs:
        return "--cuda-graphs needs the whole model on one GPU; drop it under a parallel plan"
    if plan.world_size > 1 and args.memory_bytes is None:
        return "under a parallel plan give --memory-bytes, so that every rank's pool has the same size"
    return None
