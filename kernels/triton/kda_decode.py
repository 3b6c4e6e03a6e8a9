"""`kda_decode` (see `k3core.ops`): one KDA step per sequence, state updated in place by slot.

Memory bound: the [V, K] float32 state dominates the traffic, so each program (sequence, head, value block)
reads its state tile once and writes it once; gate, L2 norms and the beta sigmoid are recomputed per program
from the tiny per-token vectors instead of making a trip through memory.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3core.ops import KdaGateParams
from kernels.triton.kda_gate import gate_form_id, gate_log_decay, gate_tensors
from kernels.triton.tuning import pow2_at_least
from kernels.triton.tuning_ops import KdaDecodeConfig, kda_decode_config


@triton.jit
def _kda_decode_kernel(q_ptr, k_ptr, v_ptr, f_ptr, beta_ptr, a_log_ptr, dt_bias_ptr,
                       state_ptr, state_stride, slot_ptr, o_ptr, scale, lower_bound,
                       H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr, FORM: tl.constexpr):
    i_v = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = tl.program_id(2)
    cols_k = tl.arange(0, BK)
    cols_v = i_v * BV + tl.arange(0, BV)
    k_ok = cols_k < K
    v_ok = cols_v < V
    head_row = i_b * H + i_h
    q = tl.load(q_ptr + head_row * K + cols_k, mask=k_ok, other=0.0).to(tl.float32)   # [BK]
    k = tl.load(k_ptr + head_row * K + cols_k, mask=k_ok, other=0.0).to(tl.float32)
    f = tl.load(f_ptr + head_row * K + cols_k, mask=k_ok, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + head_row * V + cols_v, mask=v_ok, other=0.0).to(tl.float32)   # [BV]
    beta = tl.sigmoid(tl.load(beta_ptr + head_row).to(tl.float32))
    q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6)
    k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
    dt_bias = tl.load(dt_bias_ptr + i_h * K + cols_k, mask=k_ok, other=0.0)
    g = gate_log_decay(f, tl.load(a_log_ptr + i_h), dt_bias, lower_bound, FORM)     # [BK]

    slot = tl.load(slot_ptr + i_b).to(tl.int64)
    s_ptrs = state_ptr + slot * state_stride + i_h * V * K + cols_v[:, None] * K + cols_k[None, :]
    mask_s = v_ok[:, None] & k_ok[None, :]
    s = tl.load(s_ptrs, mask=mask_s, other=0.0)                                       # [BV, BK]
    s = s * tl.exp(tl.where(k_ok, g, 0.0))[None, :]
    delta = beta * (v - tl.sum(s * k[None, :], 1))                                   # [BV]
    s = s + delta[:, None] * k[None, :]
    o = scale * tl.sum(s * q[None, :], 1)                                            # [BV]
    tl.store(s_ptrs, s, mask=mask_s)
    tl.store(o_ptr + head_row * V + cols_v, o.to(o_ptr.dtype.element_ty), mask=v_ok)


def kda_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, beta_logits: torch.Tensor,
               gate: KdaGateParams, state: torch.Tensor, slot_ids: torch.Tensor, scale: float,
               config: KdaDecodeConfig | None = None) -> torch.Tensor:
    """q, k, f [B, H, K], v [B, H, V], beta_logits [B, H] -> o [B, H, V] (dtype of v); no host sync. `config`
    defaults to the tuning table's entry for this target and batch (the tuning sweep passes its own)."""
    num_seqs, num_heads, k_dim = q.shape
    v_dim = v.shape[-1]
    if tuple(state.shape[1:]) != (num_heads, v_dim, k_dim) or state.dtype != torch.float32 \
            or tuple(slot_ids.shape) != (num_seqs,):
        raise ValueError(f"kda_decode: state must be float32 [slots, {num_heads}, {v_dim}, {k_dim}] and slot_ids "
                         f"[{num_seqs}], got {state.dtype} {tuple(state.shape)} and {tuple(slot_ids.shape)}")
    if state.stride()[1:] != (v_dim * k_dim, k_dim, 1):
        raise ValueError("kda_decode: the inner [H, V, K] dims of state must be contiguous; pass a view that "
                         "only strides dimension 0")
    form = gate_form_id(gate)
    a_log, dt_bias = gate_tensors(gate, num_heads, k_dim, q.device)
    output = torch.empty(num_seqs, num_heads, v_dim, dtype=v.dtype, device=v.device)
    if num_seqs == 0:
        return output
    q, k, v, f, beta_logits = (t.contiguous() for t in (q, k, v, f, beta_logits))
    config = config or kda_decode_config(q.device, num_seqs)
    if config.block_v < 1 or config.block_v & (config.block_v - 1):
        raise ValueError(f"kda_decode: block_v must be a power of two, got {config.block_v}")
    block_k = pow2_at_least(k_dim)
    block_v = min(config.block_v, pow2_at_least(v_dim, floor=1))     # no tl.dot here: any power of two works
    grid = (triton.cdiv(v_dim, block_v), num_heads, num_seqs)
    _kda_decode_kernel[grid](q, k, v, f, beta_logits, a_log, dt_bias, state, state.stride(0),
                             slot_ids.to(device=q.device, dtype=torch.int64), output, float(scale),
                             float(gate.lower_bound), H=num_heads, K=k_dim, V=v_dim, BK=block_k, BV=block_v,
                             FORM=form, num_warps=config.num_warps)
    return output
