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
from kernels.triton.tuning_ops import KdaDecodeConfig, compute_units, kda_decode_config


@triton.jit
def _tile_inputs(q_ptr, k_ptr, v_ptr, f_ptr, beta_ptr, slot_ptr, i_v, i_h, i_b,
                 H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """The per-token inputs of one (value block, head, sequence) tile, as loaded (no math): q, k, f [BK], v [BV],
    the beta logit and the state slot."""
    cols_k = tl.arange(0, BK)
    cols_v = i_v * BV + tl.arange(0, BV)
    k_ok = cols_k < K
    head_row = i_b * H + i_h
    q = tl.load(q_ptr + head_row * K + cols_k, mask=k_ok, other=0.0)
    k = tl.load(k_ptr + head_row * K + cols_k, mask=k_ok, other=0.0)
    f = tl.load(f_ptr + head_row * K + cols_k, mask=k_ok, other=0.0)
    v = tl.load(v_ptr + head_row * V + cols_v, mask=cols_v < V, other=0.0)
    beta = tl.load(beta_ptr + head_row)
    slot = tl.load(slot_ptr + i_b).to(tl.int64)
    return q, k, f, v, beta, slot


@triton.jit
def _state_ptrs(state_ptr, state_stride, slot, i_v, i_h, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                BV: tl.constexpr):
    """Pointers [BV, BK] of one tile of the [V, K] state in slot `slot`, and their mask."""
    cols_k = tl.arange(0, BK)
    cols_v = i_v * BV + tl.arange(0, BV)
    ptrs = state_ptr + slot * state_stride + i_h * V * K + cols_v[:, None] * K + cols_k[None, :]
    return ptrs, (cols_v < V)[:, None] & (cols_k < K)[None, :]


@triton.jit
def _step_tile(q, k, f, v, beta_logit, s, a_log_ptr, dt_bias_ptr, i_h, scale, lower_bound,
               K: tl.constexpr, BK: tl.constexpr, FORM: tl.constexpr):
    """One KDA step on a loaded state tile s [BV, BK]: returns (new tile, output [BV] float32)."""
    cols_k = tl.arange(0, BK)
    k_ok = cols_k < K
    q = q.to(tl.float32)
    k = k.to(tl.float32)
    beta = tl.sigmoid(beta_logit.to(tl.float32))
    q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6)
    k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
    dt_bias = tl.load(dt_bias_ptr + i_h * K + cols_k, mask=k_ok, other=0.0)
    g = gate_log_decay(f.to(tl.float32), tl.load(a_log_ptr + i_h), dt_bias, lower_bound, FORM)     # [BK]
    s = s * tl.exp(tl.where(k_ok, g, 0.0))[None, :]
    delta = beta * (v.to(tl.float32) - tl.sum(s * k[None, :], 1))                   # [BV]
    s = s + delta[:, None] * k[None, :]
    return s, scale * tl.sum(s * q[None, :], 1)


@triton.jit
def _kda_decode_kernel(q_ptr, k_ptr, v_ptr, f_ptr, beta_ptr, a_log_ptr, dt_bias_ptr,
                       state_ptr, state_stride, slot_ptr, o_ptr, scale, lower_bound,
                       H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr, FORM: tl.constexpr):
    """One program per tile (value block, head, sequence)."""
    i_v = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = tl.program_id(2)
    q, k, f, v, beta, slot = _tile_inputs(q_ptr, k_ptr, v_ptr, f_ptr, beta_ptr, slot_ptr, i_v, i_h, i_b,
                                          H, K, V, BK, BV)
    s_ptrs, mask_s = _state_ptrs(state_ptr, state_stride, slot, i_v, i_h, K, V, BK, BV)
    s = tl.load(s_ptrs, mask=mask_s, other=0.0)                                       # [BV, BK]
    s, o = _step_tile(q, k, f, v, beta, s, a_log_ptr, dt_bias_ptr, i_h, scale, lower_bound, K, BK, FORM)
    tl.store(s_ptrs, s, mask=mask_s)
    cols_v = i_v * BV + tl.arange(0, BV)
    tl.store(o_ptr + (i_b * H + i_h) * V + cols_v, o.to(o_ptr.dtype.element_ty), mask=cols_v < V)


@triton.jit
def _tile_coords(tile, H: tl.constexpr, NUM_VB: tl.constexpr):
    return tile % NUM_VB, (tile // NUM_VB) % H, tile // (NUM_VB * H)


@triton.jit
def _kda_decode_persistent_kernel(q_ptr, k_ptr, v_ptr, f_ptr, beta_ptr, a_log_ptr, dt_bias_ptr,
                                  state_ptr, state_stride, slot_ptr, o_ptr, scale, lower_bound, num_tiles,
                                  H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                                  BV: tl.constexpr, NUM_VB: tl.constexpr, FORM: tl.constexpr):
    """A fixed grid that strides over the tiles (value block fastest, then head, then sequence). Each iteration
    first issues the next tile's loads (its inputs, then its state from the slot loaded one iteration earlier),
    then steps and stores the current tile, so a program always has a state tile in flight.

    Tiles past num_tiles (the last iteration's look-ahead) are clamped to the last tile: their loads are
    in bounds and their values unused.
    """
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    last = num_tiles - 1
    i_v, i_h, i_b = _tile_coords(pid, H, NUM_VB)
    q, k, f, v, beta, slot = _tile_inputs(q_ptr, k_ptr, v_ptr, f_ptr, beta_ptr, slot_ptr, i_v, i_h, i_b,
                                          H, K, V, BK, BV)
    s_ptrs, mask_s = _state_ptrs(state_ptr, state_stride, slot, i_v, i_h, K, V, BK, BV)
    s = tl.load(s_ptrs, mask=mask_s, other=0.0)
    # the loop carries the slot, not the [BV, BK] pointer tile (64-bit pointers would double the registers)
    for tile in range(pid, num_tiles, step):
        n_v, n_h, n_b = _tile_coords(tl.minimum(tile + step, last), H, NUM_VB)
        nq, nk, nf, nv, nbeta, nslot = _tile_inputs(q_ptr, k_ptr, v_ptr, f_ptr, beta_ptr, slot_ptr, n_v, n_h, n_b,
                                                    H, K, V, BK, BV)
        n_ptrs, n_mask = _state_ptrs(state_ptr, state_stride, nslot, n_v, n_h, K, V, BK, BV)
        ns = tl.load(n_ptrs, mask=n_mask, other=0.0)
        i_v, i_h, i_b = _tile_coords(tile, H, NUM_VB)
        s, o = _step_tile(q, k, f, v, beta, s, a_log_ptr, dt_bias_ptr, i_h, scale, lower_bound, K, BK, FORM)
        s_ptrs, mask_s = _state_ptrs(state_ptr, state_stride, slot, i_v, i_h, K, V, BK, BV)
        tl.store(s_ptrs, s, mask=mask_s)
        cols_v = i_v * BV + tl.arange(0, BV)
        tl.store(o_ptr + (i_b * H + i_h) * V + cols_v, o.to(o_ptr.dtype.element_ty), mask=cols_v < V)
        q, k, f, v, beta, s, slot = nq, nk, nf, nv, nbeta, ns, nslot


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
    if config.programs_per_unit < 0:
        raise ValueError(f"kda_decode: programs_per_unit must be >= 0, got {config.programs_per_unit}")
    block_k = pow2_at_least(k_dim)
    block_v = min(config.block_v, pow2_at_least(v_dim, floor=1))     # no tl.dot here: any power of two works
    num_vb = triton.cdiv(v_dim, block_v)
    args = (q, k, v, f, beta_logits, a_log, dt_bias, state, state.stride(0),
            slot_ids.to(device=q.device, dtype=torch.int64), output, float(scale), float(gate.lower_bound))
    num_tiles = num_vb * num_heads * num_seqs
    programs = config.programs_per_unit * compute_units(q.device)
    if config.programs_per_unit and programs < num_tiles:
        _kda_decode_persistent_kernel[(programs,)](*args, num_tiles, H=num_heads, K=k_dim, V=v_dim, BK=block_k,
                                                   BV=block_v, NUM_VB=num_vb, FORM=form, num_warps=config.num_warps)
    else:
        _kda_decode_kernel[(num_vb, num_heads, num_seqs)](*args, H=num_heads, K=k_dim, V=v_dim, BK=block_k,
                                                          BV=block_v, FORM=form, num_warps=config.num_warps)
    return output
