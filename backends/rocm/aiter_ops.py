"""aiter (AMD's kernel library) behind k3core's `mla_decode` and `moe_experts` signatures.

MLA decode: `aiter.mla.mla_decode_fwd(q [B, H, 576], kv_buffer [pages, page_size, 1, 576], o [B, H, 512],
qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q, page_size=, nhead_kv=, sm_scale=,
return_lse=True) -> (logits, lse)`. Its split-k reduction combines partials with exp/log, so the LSE is natural
log, like ours. Older aiter releases have neither `max_seqlen_q` nor `return_lse`; `mla_reasons` rejects them
(the LSE is needed to merge decode-context-parallel partials) instead of calling with the wrong arguments.

Fused MoE: `aiter.fused_moe.fused_moe(x, w1 [E, 2I, D], w2 [E, D, I], topk_weight, topk_ids, activation=)`,
the same gate|up layout as ours, weights applied after the down projection. Only SiLU/GELU activations exist in
`aiter.ActivationType`, so SiTU-GLU (K3) is a reason. Expert ids of other ranks are remapped to expert 0 with
weight 0 here rather than passed through aiter's `expert_mask`, whose size must equal the global expert count.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect

import torch

from k3core.backend import OpSpec
from k3core.ops import MlaDecodeOut

MLA_LATENT, MLA_ROPE = 512, 64


def _dtype_reason(spec: OpSpec, library_op: str) -> list[str]:
    if spec.dtype not in (torch.bfloat16, torch.float16):
        return [f"aiter {library_op} needs bfloat16 or float16, not {str(spec.dtype).removeprefix('torch.')}"]
    return []


def _device_reason(spec: OpSpec) -> list[str]:
    return [] if spec.device.type == "cuda" else [f"device is {spec.device.type.upper()}; aiter needs a ROCm GPU"]


def mla_reasons(spec: OpSpec) -> list[str]:
    found = _dtype_reason(spec, "MLA decode") + _device_reason(spec)
    config = spec.config
    if config is not None and "mla" in config.layer_types and (
            config.kv_lora_rank != MLA_LATENT or config.qk_rope_head_dim != MLA_ROPE):
        found.append(f"latent {config.kv_lora_rank} + rope {config.qk_rope_head_dim}: aiter's MLA decode kernels "
                     f"serve only {MLA_LATENT} + {MLA_ROPE}")
    if importlib.util.find_spec("aiter") is not None:
        params = inspect.signature(importlib.import_module("aiter.mla").mla_decode_fwd).parameters
        if "return_lse" not in params or "max_seqlen_q" not in params:
            found.append("this aiter release's mla_decode_fwd cannot return the LSE; upgrade aiter")
    return found


def moe_reasons(spec: OpSpec) -> list[str]:
    found = _dtype_reason(spec, "fused_moe") + _device_reason(spec)
    config = spec.config
    if config is not None and "moe" in config.mlp_types and config.activation != "silu":
        found.append(f"activation {config.activation!r} is not an aiter ActivationType (SiLU and GELU only)")
    return found


def mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor,
               scale: float, v_dim: int) -> MlaDecodeOut:
    from aiter.mla import mla_decode_fwd  # noqa: PLC0415
    batch, num_heads, latent_width = q.shape                       # [B, H, D_latent]
    if batch == 0:
        return MlaDecodeOut(q.new_empty(0, num_heads, v_dim), torch.empty(0, num_heads, device=q.device))
    page_size = kv_cache.shape[1]
    lens = seq_lens.long()
    pages_per_request = (lens + page_size - 1) // page_size        # [B]
    kv_indptr = torch.zeros(batch + 1, dtype=torch.int32, device=q.device)
    kv_indptr[1:] = torch.cumsum(pages_per_request, 0)
    used = torch.arange(page_table.shape[1], device=q.device)[None, :] < pages_per_request[:, None]
    kv_indices = page_table[used].to(torch.int32)                  # [sum pages]
    last_page_lens = (lens - (pages_per_request - 1) * page_size).to(torch.int32)  # [B], 1..page_size
    qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
    output = q.new_empty(batch, num_heads, v_dim)
    _, lse = mla_decode_fwd(q, kv_cache.unsqueeze(2), output, qo_indptr, kv_indptr, kv_indices, last_page_lens,
                            1, page_size=page_size, nhead_kv=1, sm_scale=scale, return_lse=True)
    return MlaDecodeOut(output, lse.reshape(batch, num_heads).float())


def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                expert_ids: torch.Tensor, activation: str, situ_beta: float, situ_linear_beta: float | None,
                expert_offset: int = 0) -> torch.Tensor:
    from aiter import ActivationType  # noqa: PLC0415
    from aiter.fused_moe import fused_moe  # noqa: PLC0415
    if activation != "silu":
        raise ValueError(f"aiter fused_moe cannot apply activation {activation!r}; select another provider")
    if x.shape[0] == 0:
        return x.new_zeros(0, x.shape[1])
    local = expert_ids.long() - expert_offset                      # [T, k]
    on_this_rank = (local >= 0) & (local < w13.shape[0])
    local = torch.where(on_this_rank, local, 0).to(torch.int32)
    weights = torch.where(on_this_rank, weights.float(), 0.0)
    return fused_moe(x, w13, w2, weights, local, activation=ActivationType.Silu)
