"""Starting the ranks of a plan: local processes (one per GPU, or CPU processes over gloo), or torchrun.

`spawn(fn, plan, args)` starts `plan.world_size` local processes, initialises torch.distributed in each (NCCL on
CUDA/ROCm devices, gloo on the CPU), calls `fn(rank, plan, *args)` and returns every rank's result in rank
order. Under torchrun (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set), `torchrun_rank()` says which rank this
process is and the server joins that world instead of spawning; multi-node runs otherwise use
`--nnodes/--node-rank/--dist-init-addr` like SGLang.
"""
from __future__ import annotations

import os
import pickle
import socket
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k3core.parallel.plan import ParallelPlan


@dataclass(frozen=True)
class DistSetup:
    init_addr: str                 # host:port of rank 0, or "env://" under torchrun
    nnodes: int = 1
    node_rank: int = 0
    device: str = "cpu"            # "cpu" (gloo) or "cuda" (NCCL / RCCL)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_rank(rank: int, world_size: int, setup: DistSetup) -> torch.device:
    """Join the process group; returns this rank's device."""
    backend = "nccl" if setup.device == "cuda" else "gloo"
    device = torch.device("cpu")
    if setup.device == "cuda":
        local = rank % max(torch.cuda.device_count(), 1)
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    # torchrun's workers join the store its agent already serves (env://); our own launches start one (tcp://).
    init_method = setup.init_addr if setup.init_addr == "env://" else f"tcp://{setup.init_addr}"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    return device


def torchrun_rank() -> tuple[int, int] | None:
    """(rank, world size) when this process was started by torchrun (or any launcher that sets RANK,
    WORLD_SIZE, MASTER_ADDR and MASTER_PORT for an env:// rendezvous), else None."""
    names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if not all(name in os.environ for name in names):
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def _worker(rank: int, fn: Callable, plan: ParallelPlan, setup: DistSetup, args: tuple, results) -> None:
    global_rank = setup.node_rank * (plan.world_size // setup.nnodes) + rank
    try:
        torch.set_num_threads(1)          # several ranks share a few CPU cores
        device = init_rank(global_rank, plan.world_size, setup)
        # pickled here, by value: a tensor sent through the queue as itself travels as a shared-memory handle that
        # dies with this process, which may exit before the parent reads it
        results.put((global_rank, "ok", pickle.dumps(fn(global_rank, plan, device, *args))))
    except BaseException:                 # report every failure to the parent instead of hanging it
        results.put((global_rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable[..., Any], plan: ParallelPlan, args: tuple = (), setup: DistSetup | None = None,
          timeout_s: float = 600.0) -> list[Any]:
    """Run `fn(rank, plan, device, *args)` on every local rank; `fn` must be a module-level function."""
    setup = setup or DistSetup(f"127.0.0.1:{free_port()}")
    local_ranks = plan.world_size // setup.nnodes
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_worker, args=(r, fn, plan, setup, args, results), daemon=True)
                 for r in range(local_ranks)]
    for process in processes:
        process.start()
    collected: dict[int, Any] = {}
    errors = []
    try:
        for _ in processes:
            rank, status, value = results.get(timeout=timeout_s)
            if status == "error":
                errors.append(f"rank {rank} failed:\n{value}")
                break
            collected[rank] = pickle.loads(value)
    finally:
        for process in processes:
            process.join(timeout=5 if errors else 60)
            if process.is_alive():
                process.terminate()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [collected[r] for r in sorted(collected)]
