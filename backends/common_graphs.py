"""One graph-capture interface over CUDA graphs and HIP graphs (torch.cuda.CUDAGraph drives both).

The core never touches graph APIs: it asks its backend for `graph_runner(fn, buckets)`, captures once at start,
and calls `run(*inputs)` every decode step. Rules a captured `fn` must keep (the same as for any CUDA graph):
its inputs are tensors with the batch on dim 0; it neither synchronises with the host nor depends on values
read on the host; and every tensor it reads besides its inputs (weights, caches, the pool arena) stays at the
same address for the runner's lifetime. Outputs returned by `run` are views into static buffers and are valid
until the next `run` of any bucket that shares them; copy them if they must live longer.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch


class GraphCaptureUnavailable(RuntimeError):
    """Graph capture was asked for where it cannot work (no GPU)."""


@dataclass
class CapturedGraph:
    batch_size: int
    graph: Any                               # torch.cuda.CUDAGraph
    static_inputs: tuple[torch.Tensor, ...]
    static_outputs: Any                      # whatever fn returned: tensors, tuples, NamedTuples of tensors


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):      # NamedTuple (MlaDecodeOut, ...)
        return type(value)(*(_map_tensors(v, fn) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_map_tensors(v, fn) for v in value)
    return value


class GraphRunner:
    """Captures `fn` once per batch-size bucket and replays the smallest bucket that holds each call."""

    def __init__(self, fn: Callable[..., Any], buckets: Sequence[int], device: torch.device | str | None = None,
                 warmup_iters: int = 2):
        if not torch.cuda.is_available():
            raise GraphCaptureUnavailable(
                "graph capture needs a CUDA or ROCm GPU and none is visible (torch.cuda.is_available() is False); "
                "run the step eagerly instead")
        if not buckets or min(buckets) < 1:
            raise ValueError(f"buckets must be positive batch sizes, got {list(buckets)}")
        self.fn = fn
        self.buckets = sorted(set(int(b) for b in buckets))
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        self.warmup_iters = warmup_iters
        self.graphs: dict[int, CapturedGraph] = {}
        self._pool = None                    # one memory pool shared by every bucket, as capture order allows

    def bucket_for(self, batch_size: int) -> int:
        index = bisect.bisect_left(self.buckets, batch_size)
        if index == len(self.buckets):
            raise ValueError(f"batch size {batch_size} exceeds the largest captured bucket {self.buckets[-1]}; "
                             "add a larger bucket or run this step eagerly")
        return self.buckets[index]

    def capture(self, example_inputs: Callable[[int], Sequence[torch.Tensor]]) -> None:
        """`example_inputs(bucket)` makes inputs of that batch size; they become the static input buffers.
        Buckets are captured largest first so smaller graphs reuse the largest graph's memory pool."""
        for batch_size in reversed(self.buckets):
            inputs = tuple(t.to(self.device) for t in example_inputs(batch_size))
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):     # warm-up outside capture: lazy initialisation, autotuning, JIT
                for _ in range(self.warmup_iters):
                    self.fn(*inputs)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                outputs = self.fn(*inputs)
            if self._pool is None:
                self._pool = graph.pool()
            self.graphs[batch_size] = CapturedGraph(batch_size, graph, inputs, outputs)

    def run(self, *inputs: torch.Tensor) -> Any:
        if not self.graphs:
            raise RuntimeError("GraphRunner.run was called before capture(); capture once at engine start")
        batch_size = inputs[0].shape[0]
        captured = self.graphs[self.bucket_for(batch_size)]
        if len(inputs) != len(captured.static_inputs):
            raise ValueError(f"captured with {len(captured.static_inputs)} inputs, called with {len(inputs)}")
        for static, new in zip(captured.static_inputs, inputs):
            static[:batch_size].copy_(new)   # rows past batch_size keep stale values: fn must be row-independent
        captured.graph.replay()
        return _map_tensors(captured.static_outputs,
                            lambda t: t[:batch_size] if t.dim() and t.shape[0] == captured.batch_size else t)
