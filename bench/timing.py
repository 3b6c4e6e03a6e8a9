"""How the kernel benchmark times things, and the two ceilings every rate is compared against.

On a GPU every time is the median of `triton.testing.do_bench` (CUDA events; it flushes L2 between runs); decode-
sized work is captured in a CUDA graph first so launch gaps do not dominate. Under `--smoke` (CPU, Triton
interpreter) the same calls run through a host clock: the numbers only prove that the plumbing works.
"""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

WARMUP_MS = 25          # do_bench warm-up budget (milliseconds, not iterations)
REP_MS = 100            # do_bench measuring budget
SWEEP_WARMUP_MS, SWEEP_REP_MS = 5, 25   # the tuning sweeps' shorter budget (hundreds of configs in one call)
MAX_INPUT_SETS = 32     # cap on rotated input sets (each costs memory and, for graphs, capture time)
# A timed graph makes at least this many calls (cycling through the input sets), so that the graph's own launch and
# the dirty lines do_bench's L2 flush leaves before every replay are shared by 8 calls, as a decode step's graph
# shares them among its many kernels. The decode rows also record the one-pass reading (1-2 calls for inputs of
# 100+ MB), which earlier results used.
GRAPH_MIN_CALLS = 8
DEFAULT_L2_BYTES = 50 * 2**20   # H100/H200 L2, used when torch does not report it


@dataclass(frozen=True)
class Ceilings:
    """Measured in the same run as the kernels: what 'fraction of copy / of matmul' is a fraction of."""
    copy_tbps: float            # device-to-device copy, (bytes read + bytes written) / time, TB/s
    matmul_tflops: float        # square matmul in the bench dtype, TFLOP/s
    copy_bytes: int             # size of the copied buffer (one direction)
    matmul_n: int               # the matmul is n x n x n


@dataclass(frozen=True)
class Timing:
    ms: float                   # per call
    method: str                 # "do_bench median", "CUDA graph of 8 calls, do_bench median", "host clock (smoke)"


@dataclass(frozen=True)
class PairTiming:
    """Ours and the anchor timed alternately, `repeats` times each: the medians, and every repeat's speed-up."""
    ours_ms: float
    anchor_ms: float
    speedups: tuple[float, ...]     # anchor / ours of each repeat, in order

    def note(self, anchor_name: str) -> str:
        low, high = min(self.speedups), max(self.speedups)
        return (f"{len(self.speedups)} alternating timings of ours and {anchor_name} (medians above): speed-up "
                f"median {statistics.median(self.speedups):.3f}, range {low:.3f}-{high:.3f}")


def time_pair(time_ours: Callable[[], Timing], time_anchor: Callable[[], Timing], repeats: int) -> PairTiming:
    """Time ours, then the anchor, `repeats` times over: slow drift of the machine (clocks, heat, a neighbour) then
    falls on both alike, and the spread of the per-repeat speed-ups says how far one reading can be trusted."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    ours, anchor = [], []
    for _ in range(repeats):
        ours.append(time_ours().ms)
        anchor.append(time_anchor().ms)
    return PairTiming(statistics.median(ours), statistics.median(anchor),
                      tuple(a / o for o, a in zip(ours, anchor)))


class Timer:
    """One timing policy for the whole run (device events on a GPU, a host clock in smoke runs)."""

    def __init__(self, device: torch.device, warmup_ms: int = WARMUP_MS, rep_ms: int = REP_MS,
                 method: str = "do_bench median"):
        self.device = device
        self.on_gpu = device.type == "cuda"
        self.warmup_ms, self.rep_ms, self.method = warmup_ms, rep_ms, method

    def time(self, fn: Callable[[], object]) -> Timing:
        if not self.on_gpu:
            return Timing(_host_ms(fn), "host clock, one call (smoke: not a measurement)")
        import triton.testing  # noqa: PLC0415  (triton only where a GPU is)
        ms = triton.testing.do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median")
        return Timing(float(ms), self.method)

    def time_rotating(self, calls: Sequence[Callable[[], object]]) -> Timing:
        """Eager timing that cycles through the input sets, one set per call."""
        state = {"i": 0}

        def step() -> object:
            state["i"] = (state["i"] + 1) % len(calls)
            return calls[state["i"]]()

        timing = self.time(step)
        return Timing(timing.ms, f"{timing.method}, {len(calls)} rotated input sets")

    def time_graph(self, calls: Sequence[Callable[[], object]], min_calls: int = GRAPH_MIN_CALLS) -> Timing:
        """Capture one CUDA graph that cycles through the calls (one per input set) until it has made at least
        `min_calls`, and time its replay; the time per call is the replay time over the calls made. Falls back to
        eager timing, saying so, where capture fails."""
        if not self.on_gpu:
            timing = self.time_rotating(calls)
            return Timing(timing.ms, f"{timing.method}; no CUDA graph on the CPU")
        sets = len(calls)
        calls = [calls[i % sets] for i in range(max(sets, min_calls))]
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):            # compile / autotune / lazy init outside the capture
                for _ in range(2):
                    for call in calls:
                        call()
            torch.cuda.current_stream(self.device).wait_stream(side)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for call in calls:
                    call()
        except Exception as exc:  # a call that syncs with the host cannot be captured: time it eagerly instead
            torch.cuda.synchronize(self.device)
            timing = self.time_rotating(calls)
            return Timing(timing.ms, f"{timing.method}; graph capture failed ({type(exc).__name__}: "
                                     f"{str(exc)[:120]})")
        timing = self.time(graph.replay)
        return Timing(timing.ms / len(calls), f"CUDA graph of {len(calls)} calls over {sets} input set(s), "
                                              f"do_bench median")

    def single_pass_note(self, ours: Sequence[Callable[[], object]],
                         anchor: Sequence[Callable[[], object]] | None = None) -> str:
        """The same calls timed with one pass over the input sets per replay (how earlier results timed graphs),
        for a row's notes, so that old and new readings can be set side by side."""
        text = f"one pass of the sets per replay (as earlier results): ours {self.time_graph(ours, 1).ms:.4f}"
        if anchor:
            text += f", anchor {self.time_graph(anchor, 1).ms:.4f}"
        return text + " ms"


def sweep_timer(device: torch.device) -> Timer:
    """The same policy with the sweeps' shorter do_bench budget (tools.tune.tune_decode, tools.tune.tune_prefill)."""
    return Timer(device, SWEEP_WARMUP_MS, SWEEP_REP_MS, "do_bench median (sweep budget)")


def _host_ms(fn: Callable[[], object]) -> float:
    """One call on the host clock: a smoke run's time only shows that the timing path runs (the interpreter is
    100-1000x slower than the kernel, so a warm-up and a median buy nothing but CI minutes)."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def l2_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 1 * 2**20
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "L2_cache_size", 0) or DEFAULT_L2_BYTES)


def num_input_sets(bytes_per_call: float, device: torch.device, smoke: bool) -> int:
    """Enough distinct input sets that one pass over them is >= 3x the L2, so no call finds its inputs cached."""
    if smoke:
        return 2                                    # exercise the rotation path without slowing the interpreter
    needed = math.ceil(3 * l2_bytes(device) / max(bytes_per_call, 1.0))
    return max(1, min(MAX_INPUT_SETS, needed))


def measure_ceilings(timer: Timer, dtype: torch.dtype, smoke: bool) -> Ceilings:
    """A large device-to-device copy (bytes read + written) and an n^3 matmul on random data (never zeros: a
    matmul on zeros has been seen to run faster than on real data)."""
    device = timer.device
    copy_elems = (2**20 if smoke else 2**29)        # 1 GiB of bf16 on the GPU: far past L2
    src = torch.randn(copy_elems, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    copy_ms = timer.time(lambda: dst.copy_(src)).ms
    copy_bytes = src.numel() * src.element_size()
    n = 256 if smoke else 8192
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    matmul_ms = timer.time(lambda: a @ b).ms
    return Ceilings(copy_tbps=2 * copy_bytes / (copy_ms * 1e-3) / 1e12,
                    matmul_tflops=2 * n**3 / (matmul_ms * 1e-3) / 1e12, copy_bytes=copy_bytes, matmul_n=n)
