"""`moe_experts` through `torch._grouped_mm` (one grouped GEMM per projection, CUTLASS on sm90+).

Around the two GEMMs, one pass each and no host synchronisation (so the call can be captured in a CUDA graph):
1. one stable sort of the (token, choice) pairs by local expert; `offs` (the end row of each expert) is a
   searchsorted of the sorted keys on the device, never a bincount (whose CUDA version reads its max on the host);
2. one gather of the token rows into sorted order;
3. the GLU activation (SiLU/SiTU) as one Triton kernel over the [gate | up] GEMM output;
4. one Triton combine kernel: each token gathers its k rows, scales them by their routing weights and sums them in
   a fixed order in float32 (no atomics, no float32 copy of the expert outputs).
Rows whose expert lives on another rank (expert parallelism) are sorted to the end, past the last offset; the
GEMMs never write them (they may hold anything, NaN included) and the combine never reads them.

Limits (repeated in `reasons`): bfloat16 on compute capability 9.0+ (the CUTLASS path); every GEMM dimension a
multiple of 8 (16-byte aligned rows). torch also runs `_grouped_mm` on the CPU, and the two Triton kernels run there
under TRITON_INTERPRET=1, which is how tests/test_backends.py checks this adapter in float32 without a GPU.
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
        for name, size in (("expert width", config.expert_width),
                           ("moe_intermediate_size", config.moe_intermediate_size)):
            if size % 8:
                found.append(f"{name} {size} is not a multiple of 8 (grouped GEMM rows must be 16-byte aligned)")
    return found


def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                expert_ids: torch.Tensor, activation: str, situ_beta: float, situ_linear_beta: float | None,
                expert_offset: int = 0) -> torch.Tensor:
    # triton only once the op runs: selecting providers must not import vendor packages
    from kernels.triton.activation import glu_activation  # noqa: PLC0415
    from kernels.triton.moe_blocks import sort_pairs_by_expert  # noqa: PLC0415
    from kernels.triton.moe_experts import combine_expert_rows  # noqa: PLC0415
    num_tokens, width = x.shape                                    # [T, D]
    num_experts, top_k = w13.shape[0], expert_ids.shape[1]
    out = torch.empty(num_tokens, width, dtype=x.dtype, device=x.device)
    if num_tokens == 0 or top_k == 0:
        return out.zero_()
    expert_ids = expert_ids.long().contiguous()
    _, order, ends = sort_pairs_by_expert(expert_ids, expert_offset, num_experts)   # other ranks' pairs sort last
    offs = ends.to(torch.int32)                                    # [E] end row of each expert
    row_of_pair = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=x.device))  # [P]
    rows = x.index_select(0, order // top_k)                       # [P, D]
    hidden = torch._grouped_mm(rows, w13.transpose(-2, -1), offs=offs)                    # [P, 2I]
    act = glu_activation(hidden, activation, situ_beta, situ_linear_beta)                # [P, I] in x.dtype
    expert_out = torch._grouped_mm(act, w2.transpose(-2, -1), offs=offs)                 # [P, D]
    combine_expert_rows(expert_out, row_of_pair, weights, expert_ids, expert_offset, num_experts, out)
    return out
