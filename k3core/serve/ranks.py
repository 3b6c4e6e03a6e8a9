"""Serving under a parallel plan: this process is one node's first rank; it starts the node's other ranks.

Global rank 0 (node 0's first rank) serves HTTP and leads the engine (`DistributedEngine`); every other rank
builds the same model shard and follows (`k3core.parallel.distributed_engine.follow`). Ranks talk over NCCL /
RCCL on GPUs and gloo on the CPU; `--dist-init-addr` names where rank 0 listens. The ranks this process starts
heartbeat back to it (`k3core.serve.liveness`), so that a dead or wedged one stops the server instead of hanging it.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import traceback
from multiprocessing.connection import Connection

from k3core.parallel.launch import DistSetup, free_port, init_rank
from k3core.serve.args import ServerArgs
from k3core.serve.liveness import Heartbeat, WatchedRank

RANK_FAILED_EXIT = 3          # a follower rank that failed (its reason went to the server first)

log = logging.getLogger("k3core.serve")


def dist_setup(args: ServerArgs) -> DistSetup:
    addr = args.dist_init_addr or f"127.0.0.1:{free_port()}"
    device = "cpu" if args.resolved_device() == "cpu" else "cuda"
    return DistSetup(addr, nnodes=args.nnodes, node_rank=args.node_rank, device=device)


def global_rank(args: ServerArgs, local_rank: int) -> int:
    return args.node_rank * (args.plan().world_size // args.nnodes) + local_rank


def build_rank_llm(args: ServerArgs, rank: int, setup: DistSetup):
    """Join the world and build this rank's shard of the model."""
    from k3core.llm import LLM
    plan = args.plan()
    device = init_rank(rank, plan.world_size, setup)
    # ranks on the CPU share its cores; beside a GPU more intra-op threads only spin (k3core.host_threads)
    threads = 1 if device.type == "cpu" else args.resolved_cpu_threads()
    return LLM(args.model, backend=args.backend, device=str(device), dtype=args.resolved_dtype(), seed=args.seed,
               plan=plan, rank=rank, expert_format=args.expert_format, cpu_threads=threads,
               **args.engine_options())


def _follower_main(args: ServerArgs, local_rank: int, setup: DistSetup, beat: Connection | None = None) -> None:
    heartbeat = None
    if beat is not None:               # started by the server, which owns its lifetime: Ctrl-C is for the server
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        heartbeat = Heartbeat(beat)
    run_follower(args, global_rank(args, local_rank), setup, heartbeat)


def run_follower(args: ServerArgs, rank: int, setup: DistSetup, heartbeat: Heartbeat | None = None) -> None:
    """Build this rank's shard and mirror the leader's engine until it shuts down (or goes away). A failure of this
    rank is reported through `heartbeat` (to the server that started it) and ends the process with
    RANK_FAILED_EXIT."""
    from k3core.parallel.distributed_engine import LeaderLost, follow
    try:
        llm = build_rank_llm(args, rank, setup)
        log.info("rank %d (pid %d) following rank 0", rank, os.getpid())
        follow(llm.engine, llm.comm)
    except LeaderLost as exc:           # the leader stopped without a shutdown message (killed): leave quietly
        log.warning("rank %d: lost the leader (%s); exiting", rank, str(exc).splitlines()[0])
    except Exception as exc:            # noqa: BLE001 (this rank cannot go on: say why, then exit non-zero)
        reason = f"rank {rank} failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        log.error("%s\n%s", reason, traceback.format_exc())
        if heartbeat is not None:
            heartbeat.fail(reason)
        raise SystemExit(RANK_FAILED_EXIT) from None


def start_local_ranks(args: ServerArgs, setup: DistSetup) -> list[WatchedRank]:
    """Start this node's ranks other than its first (which is the calling process), each with a heartbeat pipe
    back to this process (`RankWatcher` reads them)."""
    local = args.plan().world_size // args.nnodes
    context = mp.get_context("spawn")
    ranks = []
    for r in range(1, local):
        read, write = context.Pipe(duplex=False)
        process = context.Process(target=_follower_main, args=(args, r, setup, write), daemon=True,
                                  name=f"k3core-rank{r}")
        process.start()
        write.close()                   # the child holds it now: its exit closes the pipe
        log.info("started rank %d (pid %d)", global_rank(args, r), process.pid)
        ranks.append(WatchedRank(global_rank(args, r), process, read))
    return ranks


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
