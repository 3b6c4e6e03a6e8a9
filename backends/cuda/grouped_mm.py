"""`moe_experts` through `torch._grouped_mm` (one grouped GEMM per projection, CUTLASS on sm90+).

Tokens are sorted by expert so that each expert's rows are contiguous; `offs` holds the cumulative row counts.
Rows whose expert lives on another rank (expert parallelism) are sorted to the end, past the last offset, and
masked out with `where` (not multiplied by zero: rows past the last group are never written by the GEMM and may
hold anything, NaN included). No host synchronisation, so the call can be captured in a CUDA graph.

Limits (repeated in `reasons`): bfloat16 on compute capability 9.0+ (the CUTLASS path); every GEMM dimension a
multiple of 8 (16-byte aligned rows). torch also runs `_grouped_mm` on the CPU, which is how
tests/test_backends.py checks this adapter in float32 against the reference without a GPU.
"""
from __future__ import annotations

import torch

from k3core.backend import OpSpec


def available() -> str | None:
    from backends.common import vendor_device_missing  # noqa: PLC0415
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm (needs torch 2.8 or newer)"
    missing = vendor_device_missing("cuda")
    if missing:
        return missing
    major, minor = torch.cuda.get_device_capability()
    if major < 9:
        return f"compute capability {major}.{minor} is below 9.0 (torch._grouped_mm's CUTLASS path needs sm90+)"
    return None


def reasons(spec: OpSpec) -> list[str]:
    found = []
    if spec.dtype != torch.bfloat16:
        found.append(f"torch._grouped_mm on sm90 serves bfloat16 only, not {str(spec.dtype).removeprefix('torch.')}")
    if spec.device.type != "cuda":
        found.append(f"device is {spec.device.type.upper()}; torch._grouped_mm's fast path needs a CUDA device")
    config = spec.config
    if config is not None and "moe" in config.mlp_types:
        for name, size in (("expert width", config.expert_width), ("moe_intermediate_size", config.moe_intermediate_size)):
            if size % 8:
                found.append(f"{name} {size} is not a multiple of 8 (grouped GEMM rows must be 16-byte aligned)")
    return found


def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                expert_ids: torch.Tensor, activation: str, situ_beta: float, situ_linear_beta: float | None,
                expert_offset: int = 0) -> torch.Tensor:
    from kernels.torch.activation import glu_activation  # noqa: PLC0415  (one definition of the activation)
    num_tokens, width = x.shape                                    # [T, D]
    num_experts, top_k = w13.shape[0], expert_ids.shape[1]
    if num_tokens == 0:
        return x.new_zeros(0, width)
    local = expert_ids.long() - expert_offset                      # [T, k]
    on_this_rank = (local >= 0) & (local < num_experts)
    group = torch.where(on_this_rank, local, num_experts).flatten()  # [T*k]; foreign experts -> past the end
    order = torch.argsort(group, stable=True)                      # [T*k]
    counts = torch.bincount(group, minlength=num_experts + 1)[:num_experts]
    offs = torch.cumsum(counts, 0).to(torch.int32)                 # [E] end row of each expert
    token_of_row = order // top_k                                  # [T*k]
    rows = x[token_of_row]                                         # [T*k, D]
    hidden = torch._grouped_mm(rows, w13.transpose(-2, -1), offs=offs)                    # [T*k, 2I]
    act = glu_activation(hidden, activation, situ_beta, situ_linear_beta)                # [T*k, I]
    out = torch._grouped_mm(act.to(x.dtype), w2.transpose(-2, -1), offs=offs)             # [T*k, D]
    row_weight = weights.flatten()[order].float()                  # [T*k]
    keep = on_this_rank.flatten()[order]
    out = torch.where(keep[:, None], out.float() * row_weight[:, None], 0.0)
    y = torch.zeros(num_tokens, width, dtype=torch.float32, device=x.device)
    y.index_add_(0, token_of_row, out)                             # sum over the k experts in float32
    return y.to(x.dtype)
