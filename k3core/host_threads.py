"""How many torch intra-op (OpenMP) threads the process of an engine runs.

Beside a GPU the host side of a step is small tensors (batch tables, page tables, sampled ids) that never amortise a
pool of threads, while the pool's idle threads spin after every parallel region and compete with the engine's own
thread and with everything else on the box. On the H200 machine (16 cores; bench/results/serving-nvidia-h200.md,
offline_threads) the offline 64-stream workload took 10.6 s at 1 thread and 16.1 s at 16 on a busy host, and an
engine process at 16 threads kept 8-9 cores busy. On the CPU the model itself is the host work: there all cores but
one (one left to the HTTP side) are the server's default; an in-process LLM on the CPU keeps torch's setting.
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:                # torch is imported where threads are set, not by k3core.serve.args' importers
    import torch

GPU_ENGINE_CPU_THREADS = 1     # torch intra-op threads of an engine whose model runs on a GPU

log = logging.getLogger(__name__)


def default_engine_threads(device_type: str) -> int:
    """The server's default: GPU_ENGINE_CPU_THREADS beside a GPU, all cores but one on the CPU."""
    if device_type != "cpu":
        return GPU_ENGINE_CPU_THREADS
    return max(1, (os.cpu_count() or 2) - 1)


def set_engine_threads(device: "torch.device", requested: int | None) -> int:
    """Apply `requested` threads, or with None the default beside a GPU (unless OMP_NUM_THREADS says otherwise);
    on the CPU None leaves torch's setting. Returns the threads in effect."""
    import torch
    if requested is None:
        if device.type == "cpu" or os.environ.get("OMP_NUM_THREADS"):
            return torch.get_num_threads()
        requested = GPU_ENGINE_CPU_THREADS
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise ValueError(f"cpu_threads must be a positive integer, got {requested!r}")
    if torch.get_num_threads() != requested:
        log.info("torch intra-op threads %d -> %d for the engine on %s (cpu_threads= chooses)",
                 torch.get_num_threads(), requested, device)
        torch.set_num_threads(requested)
    return requested
