"""How the network holds the weight table's tensors, so that nothing is held twice and `k3core.sizing` can say
exactly what a GPU holds.

* Projections that read the same input run as one GEMM over their rows concatenated (KDA's q, k, v, f_a, b and g,
  and the q/k/v short-conv weights; MLA's q_a, kv_a and gate; a GLU's gate and up; the LatentMoE down projection
  with the shared experts' gate and up). `fuse_rows` builds the concatenation once and turns the table's entries
  into views of it, so the separate tensors are freed rather than kept beside the fused one (the q/k/v and gate/up
  copies held beside the table were 6.7 GB a GPU at K3's TP8 shapes).
* KDA's fused rows are padded with zero rows to a multiple of FUSED_ROW_MULTIPLE: cuBLAS picks a poor kernel for
  k3-mini's 6284 rows (bench/results/decode-linears-k3-mini-*: on the H200 at BS=1 a gemv at 66% of copy, padded
  to 6400 78%; at BS=64 49% and 80%; on an H100 80/83% and 61/85%). The padding belongs to no table entry;
  `kda_padding_rows` says how much there is, and `k3core.sizing` counts it.
* The router is stored in the model dtype (the checkpoints have it so) and held in float32, where expert
  selection computes: `held_kind` says which storage class a table entry is held in.
"""
from __future__ import annotations

import torch

from k3core.model.weights import TensorSpec

FLOAT32_HELD = ("mlp.gate.weight",)      # suffixes of "weight"-class tensors the network holds in float32
FUSED_ROW_MULTIPLE = 128                 # KDA's fused x-projection rows are padded to a multiple of this


def kda_x_names(full_rank_gate: bool) -> list[str]:
    """The KDA projections of x fused into one GEMM, in row order (q, k, v, f_a, b, then g or its low-rank g_a)."""
    return [f"self_attn.{part}_proj.weight" for part in "qkv"] + [
        "self_attn.f_a_proj.weight", "self_attn.b_proj.weight",
        "self_attn.g_proj.weight" if full_rank_gate else "self_attn.g_a_proj.weight"]


def kda_padding_rows(rows: int) -> int:
    """Zero rows after KDA's `rows` fused rows."""
    return -rows % FUSED_ROW_MULTIPLE


def held_kind(name: str, spec: TensorSpec) -> str:
    """The storage class `name` is held in once the network is built ("fp32" for the router, else the table's)."""
    return "fp32" if spec.kind == "weight" and name.endswith(FLOAT32_HELD) else spec.kind


def hold_float32(weights: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """weights[name] in float32, replacing the table's entry (the upcast from bf16 or fp16 is exact)."""
    weights[name] = weights[name].float()
    return weights[name]


def fuse_rows(weights: dict[str, torch.Tensor], names: list[str], padding: int = 0) -> torch.Tensor:
    """One tensor of the named tensors' rows, in order, then `padding` zero rows; afterwards each weights[name] is
    a view of its rows.

    Entries that are already consecutive views of one tensor (a second network built on the same table), with its
    padding after them, are returned as that tensor without a copy."""
    parts = [weights[name] for name in names]
    rows = sum(part.shape[0] for part in parts) + padding
    first = parts[0]
    end = (first.storage_offset() + rows * first[0].numel()) * first.element_size()      # bytes, padding included
    if all(_follows(prev, part) for prev, part in zip(parts, parts[1:])) and end <= first.untyped_storage().nbytes():
        return torch.as_strided(first, (rows, *first.shape[1:]), first.stride(), first.storage_offset())
    fused = torch.cat(parts + ([first.new_zeros(padding, *first.shape[1:])] if padding else []))
    start = 0
    for name, part in zip(names, parts):
        weights[name] = fused[start: start + part.shape[0]]
        start += part.shape[0]
    return fused


def _follows(prev: torch.Tensor, part: torch.Tensor) -> bool:
    """`part` starts where the contiguous `prev` ends, in the same storage, with the same row shape."""
    return (prev.is_contiguous() and part.is_contiguous() and prev.shape[1:] == part.shape[1:]
            and prev.dtype == part.dtype and prev.device == part.device
            and prev.untyped_storage().data_ptr() == part.untyped_storage().data_ptr()
            and part.storage_offset() == prev.storage_offset() + prev.numel())
