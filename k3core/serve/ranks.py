"""Serving under a parallel plan: this process is one node's first rank; it starts the node's other ranks.

Global rank 0 (node 0's first rank) serves HTTP and leads the engine (`DistributedEngine`); every other rank
builds the same model shard and follows (`k3core.parallel.distributed_engine.follow`). Ranks talk over NCCL /
RCCL on GPUs and gloo on the CPU; `--dist-init-addr` names where rank 0 listens.
"""
from __future__ import annotations

import logging
import multiprocessing as mp

from k3core.parallel.launch import DistSetup, free_port, init_rank
from k3core.serve.args import ServerArgs

log = logging.getLogger("k3core.serve")


def dist_setup(args: ServerArgs) -> DistSetup:
    addr = args.dist_init_addr or f"127.0.0.1:{free_port()}"
    device = "cpu" if args.resolved_device() == "cpu" else "cuda"
    return DistSetup(addr, nnodes=args.nnodes, node_rank=args.node_rank, device=device)


def global_rank(args: ServerArgs, local_rank: int) -> int:
    return args.node_rank * (args.plan().world_size // args.nnodes) + local_rank


def build_rank_llm(args: ServerArgs, rank: int, setup: DistSetup):
    """Join the world and build this rank's shard of the model."""
    import torch

    from k3core.llm import LLM
    plan = args.plan()
    device = init_rank(rank, plan.world_size, setup)
    if device.type == "cpu":
        torch.set_num_threads(1)
    return LLM(args.model, backend=args.backend, device=str(device), dtype=args.resolved_dtype(), seed=args.seed,
               plan=plan, rank=rank, expert_format=args.expert_format, **args.engine_options())


def _follower_main(args: ServerArgs, local_rank: int, setup: DistSetup) -> None:
    run_follower(args, global_rank(args, local_rank), setup)


def run_follower(args: ServerArgs, rank: int, setup: DistSetup) -> None:
    """Build this rank's shard and mirror the leader's engine until it shuts down (or goes away)."""
    from k3core.parallel.distributed_engine import follow
    llm = build_rank_llm(args, rank, setup)
    log.info("rank %d following rank 0", rank)
    try:
        follow(llm.engine, llm.comm)
    except RuntimeError as exc:         # the leader stopped without a shutdown message (killed): leave quietly
        log.warning("rank %d: lost the leader (%s); exiting", rank, str(exc).splitlines()[0])


def start_local_ranks(args: ServerArgs, setup: DistSetup) -> list[mp.Process]:
    """Start this node's ranks other than its first (which is the calling process)."""
    local = args.plan().world_size // args.nnodes
    context = mp.get_context("spawn")
    processes = [context.Process(target=_follower_main, args=(args, r, setup), daemon=True, name=f"k3core-rank{r}")
                 for r in range(1, local)]
    for process in processes:
        process.start()
    return processes


def build_leader_llm(args: ServerArgs, setup: DistSetup):
    """Rank 0: the model shard, with its engine wrapped so that every state change reaches the followers."""
    from k3core.parallel.distributed_engine import DistributedEngine
    llm = build_rank_llm(args, 0, setup)
    llm.engine = DistributedEngine(llm.engine, llm.comm)
    return llm


def run_follower_node(args: ServerArgs, setup: DistSetup) -> None:
    """On a node other than node 0, the first local rank follows too (the HTTP server lives on node 0)."""
    _follower_main(args, 0, setup)


def torchrun_setup(args: ServerArgs, launched: tuple[int, int]) -> tuple[int, DistSetup]:
    """This process's rank and the world torchrun set up; the plan must use exactly that many ranks."""
    rank, world_size = launched
    if world_size != args.plan().world_size:
        raise SystemExit(f"torchrun started {world_size} processes but the plan needs {args.plan().world_size} "
                         "(tp x pp x ... as max(tp, dcp) x pp); make --nproc-per-node x --nnodes match it")
    device = "cpu" if args.resolved_device() == "cpu" else "cuda"
    return rank, DistSetup("env://", device=device)
