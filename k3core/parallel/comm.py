"""The collectives a plan needs, over torch.distributed (NCCL on NVIDIA, RCCL on AMD, gloo on the CPU).

`Communicator` is what the network and the engine call; with a single rank every method is the identity, so
the unchanged model runs with `SINGLE`. Group membership comes from the plan (`k3core.parallel.plan`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from k3core.parallel.plan import ParallelPlan


class _Group:
    """One process group (or none when it has a single member)."""

    def __init__(self, ranks: list[int], handle, rank: int):
        self.ranks = list(ranks)
        self.handle = handle
        self.index = self.ranks.index(rank)      # this rank's place in the group

    @property
    def size(self) -> int:
        return len(self.ranks)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        out = x.contiguous().clone()
        if out.dtype == torch.bfloat16 and out.device.type == "cpu":
            # gloo has no bf16 reduction; reduce in float32 and round once
            tmp = out.float()
            dist.all_reduce(tmp, group=self.handle)
            return tmp.to(x.dtype)
        dist.all_reduce(out, group=self.handle)
        return out

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every member's tensor (all the same shape), in group order."""
        if self.size == 1:
            return [x]
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.handle)
        return parts

    def all_to_all(self, x: torch.Tensor, send_counts: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Send rows x[sum(send_counts[:j]) : ...] to member j; returns the rows received (in member order) and
        how many came from each member."""
        if self.size == 1:
            return x, list(send_counts)
        counts = torch.tensor(send_counts, dtype=torch.int64, device=x.device)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.handle)
        recv_counts = [int(c) for c in received.tolist()]
        wire = x.float() if x.dtype == torch.bfloat16 and x.device.type == "cpu" else x.contiguous()  # gloo: no bf16
        out = wire.new_empty((sum(recv_counts),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, wire, output_split_sizes=recv_counts, input_split_sizes=list(send_counts),
                               group=self.handle)
        return out.to(x.dtype), recv_counts

    def all_gather_varlen(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Like all_gather, but dim 0 may differ between members."""
        if self.size == 1:
            return [x]
        length = torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device)
        lengths = [int(t.item()) for t in self.all_gather(length)]
        padded = x.new_zeros((max(lengths),) + tuple(x.shape[1:]))
        padded[: x.shape[0]] = x
        return [part[:n] for part, n in zip(self.all_gather(padded), lengths)]


@dataclass
class Communicator:
    plan: ParallelPlan
    rank: int
    tp: _Group
    dcp: _Group
    ep: _Group

    @property
    def coords(self):
        return self.plan.coords(self.rank)

    def send(self, tensor: torch.Tensor, dst: int):
        return dist.isend(tensor.contiguous(), dst)

    def recv(self, shape, dtype, device, src: int) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(out, src)
        return out

    def broadcast_object(self, obj: Any, src: int) -> Any:
        if self.plan.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]


def _single_group(rank: int = 0) -> _Group:
    return _Group([rank], None, rank)


SINGLE = Communicator(ParallelPlan(), 0, _single_group(), _single_group(), _single_group())


def build_communicator(plan: ParallelPlan, rank: int) -> Communicator:
    """Create every subgroup of the plan. Must be called by all ranks in the same order (torch.distributed)."""
    if plan.world_size == 1:
        return SINGLE
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; launch through k3core.parallel.launch or torchrun")
    mine: dict[str, _Group] = {}

    def make(kind: str, groups: list[list[int]]) -> None:
        for ranks in groups:
            handle = dist.new_group(list(ranks)) if len(ranks) > 1 else None
            if rank in ranks:
                mine[kind] = _Group(list(ranks), handle, rank)

    world = range(plan.world_size)
    make("tp", sorted({tuple(plan.tp_group(r)) for r in world}))
    make("dcp", sorted({tuple(plan.dcp_group(r)) for r in world}))
    ep_groups = sorted({tuple(plan.stage_group(plan.coords(r).stage)) for r in world}) if plan.ep > 1 else \
        [[r] for r in world]
    make("ep", [list(g) for g in ep_groups])
    return Communicator(plan, rank, mine["tp"], mine["dcp"], mine["ep"])
