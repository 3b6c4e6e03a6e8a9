"""`kda_prefill` (see `k3core.ops`): chunked KDA over a variable-length batch, states by slot, checkpoints.

Two Triton passes (`kda_chunk_intra`: parallel over chunks and heads; `kda_chunk_state`: sequential over the
chunks of a sequence, parallel over value blocks, heads and sequences). This wrapper only does bookkeeping:
it reads cu_seqlens once on the host (one sync per call), cuts every sequence into chunks, and lays out the
checkpoint rows (by sequence, then position).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from k3core.ops import KdaGateParams, KdaPrefillOut
from kernels.triton.kda_chunk_intra import kda_chunk_intra_kernel
from kernels.triton.kda_chunk_state import kda_chunk_state_kernel
from kernels.triton.kda_gate import gate_form_id, gate_tensors
from kernels.triton.tuning import is_interpreted, kernel_config, pow2_at_least

# The dense intra-chunk path multiplies factors up to exp((sub_chunk - 1) * |lower_bound|); keep that below
# exp(80) so a 128-channel sum of them stays finite in float32/bfloat16 (max ~3.4e38 ~ exp(88.7)).
MAX_DENSE_EXPONENT = 80.0


class ChunkPlan(NamedTuple):
    """Host-side description of how the batch is cut (all int32 on the device unless noted)."""
    chunk_start: torch.Tensor        # [num_chunks] first token (global index) of each chunk
    chunk_len: torch.Tensor          # [num_chunks] tokens in each chunk (1..chunk_size)
    seq_chunk: torch.Tensor          # [B + 1] chunks of sequence b are seq_chunk[b] .. seq_chunk[b + 1] - 1
    seq_ckpt: torch.Tensor           # [B + 1] checkpoint rows of sequence b start at seq_ckpt[b]
    ckpt_seq_ids: list[int]          # host: sequence of each checkpoint row
    ckpt_lengths: list[int]          # host: tokens consumed at each checkpoint row


def plan_chunks(bounds: list[int], chunk_size: int, checkpoint_interval: int, device: torch.device) -> ChunkPlan:
    """Cut each sequence at multiples of chunk_size and of checkpoint_interval (so checkpoints end chunks)."""
    starts: list[int] = []
    lengths: list[int] = []
    seq_chunk = [0]
    seq_ckpt = [0]
    ckpt_seq_ids: list[int] = []
    ckpt_lengths: list[int] = []
    for b in range(len(bounds) - 1):
        bos, seq_len = bounds[b], bounds[b + 1] - bounds[b]
        cuts = set(range(chunk_size, seq_len, chunk_size))
        if checkpoint_interval > 0:
            cuts |= set(range(checkpoint_interval, seq_len, checkpoint_interval))
            marks = list(range(checkpoint_interval, seq_len + 1, checkpoint_interval))
            if seq_len > 0 and (not marks or marks[-1] != seq_len):
                marks.append(seq_len)
            ckpt_seq_ids += [b] * len(marks)
            ckpt_lengths += marks
        edges = [0, *sorted(cuts), seq_len] if seq_len > 0 else [0]
        for lo, hi in zip(edges[:-1], edges[1:]):
            starts.append(bos + lo)
            lengths.append(hi - lo)
        seq_chunk.append(len(starts))
        seq_ckpt.append(len(ckpt_lengths))
    as_int32 = dict(dtype=torch.int32, device=device)
    return ChunkPlan(torch.tensor(starts, **as_int32), torch.tensor(lengths, **as_int32),
                     torch.tensor(seq_chunk, **as_int32), torch.tensor(seq_ckpt, **as_int32),
                     ckpt_seq_ids, ckpt_lengths)


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, beta_logits: torch.Tensor,
                  state: torch.Tensor, slots: list[int], num_seqs: int, num_tokens: int) -> None:
    if k.shape != q.shape or f.shape != q.shape or q.dim() != 3:
        raise ValueError(f"kda_prefill: q, k, f must share the shape [T, H, K]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(f.shape)}")
    num_heads, k_dim = q.shape[1:]
    if v.shape[:2] != q.shape[:2] or tuple(beta_logits.shape) != tuple(q.shape[:2]):
        raise ValueError(f"kda_prefill: v must be [T, H, V] and beta_logits [T, H] with T, H = {tuple(q.shape[:2])}; "
                         f"got {tuple(v.shape)} and {tuple(beta_logits.shape)}")
    if tuple(state.shape[1:]) != (num_heads, v.shape[-1], k_dim) or state.dtype != torch.float32:
        raise ValueError(f"kda_prefill: state must be float32 [slots, {num_heads}, {v.shape[-1]}, {k_dim}], "
                         f"got {state.dtype} {tuple(state.shape)}")
    if state.stride()[1:] != (v.shape[-1] * k_dim, k_dim, 1):
        raise ValueError("kda_prefill: the inner [H, V, K] dims of state must be contiguous; pass a view that "
                         "only strides dimension 0")
    if len(slots) != num_seqs or len(set(slots)) != num_seqs or any(not 0 <= s < state.shape[0] for s in slots):
        raise ValueError(f"kda_prefill: slot_ids must be {num_seqs} distinct slots in [0, {state.shape[0]}), "
                         f"got {slots}")
    if num_tokens != q.shape[0]:
        raise ValueError(f"kda_prefill: cu_seqlens ends at {num_tokens} but q has {q.shape[0]} tokens")


def kda_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, beta_logits: torch.Tensor,
                gate: KdaGateParams, cu_seqlens: torch.Tensor, state: torch.Tensor, slot_ids: torch.Tensor,
                has_initial_state: torch.Tensor, scale: float, checkpoint_interval: int = 0, *,
                chunk_size: int = 64) -> KdaPrefillOut:
    """q, k, f [T, H, K], v [T, H, V], beta_logits [T, H] -> KdaPrefillOut; state[slot_ids] updated in place.

    chunk_size (keyword only, a power of two >= 16) exists for tests under the interpreter; any
    checkpoint_interval >= 0 works (chunks are also cut at its multiples).
    """
    if checkpoint_interval < 0:
        raise ValueError(f"kda_prefill: checkpoint_interval must be >= 0, got {checkpoint_interval}")
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"kda_prefill: chunk_size must be a power of two >= 16, got {chunk_size}")
    form = gate_form_id(gate)
    bounds = cu_seqlens.tolist()
    slots = slot_ids.tolist()
    num_seqs = len(bounds) - 1
    _check_inputs(q, k, v, f, beta_logits, state, slots, num_seqs, bounds[-1])
    num_tokens, num_heads, k_dim = q.shape
    v_dim = v.shape[-1]
    device = q.device
    a_log, dt_bias = gate_tensors(gate, num_heads, k_dim, device)
    plan = plan_chunks(bounds, chunk_size, checkpoint_interval, device)
    num_ckpts = len(plan.ckpt_lengths)

    output = torch.empty(num_tokens, num_heads, v_dim, dtype=v.dtype, device=device)
    ckpt_states = torch.empty(num_ckpts, num_heads, v_dim, k_dim, dtype=torch.float32, device=device)
    as_index = dict(dtype=torch.int64, device=device)
    result = KdaPrefillOut(output, ckpt_states, torch.tensor(plan.ckpt_seq_ids, **as_index),
                           torch.tensor(plan.ckpt_lengths, **as_index))
    if num_seqs == 0:
        return result

    q, k, v, f, beta_logits = (t.contiguous() for t in (q, k, v, f, beta_logits))
    # Intermediates in the input precision when it is 16-bit (tensor-core operands), float32 otherwise.
    work_dtype = q.dtype if q.dtype in (torch.bfloat16, torch.float16) else torch.float32
    num_chunks = plan.chunk_len.numel()
    block_k = pow2_at_least(k_dim)
    block_v_full = pow2_at_least(v_dim)
    intra = kernel_config("kda_intra")
    sub_chunk = min(intra.sub_chunk, chunk_size)
    dense = form == 1 and (sub_chunk - 1) * abs(gate.lower_bound) <= MAX_DENSE_EXPONENT
    # float32 inputs ask for float32 results: exact products; 16-bit inputs use the vendor's fast solve setting.
    precision = intra.solve_precision if work_dtype != torch.float32 else "ieee"
    w = torch.empty(num_tokens, num_heads, k_dim, dtype=work_dtype, device=device)       # T (beta k exp G)
    qg = torch.empty_like(w)                                                            # q exp G
    kd = torch.empty_like(w)                                                            # k exp(G_last - G)
    u0 = torch.empty(num_tokens, num_heads, v_dim, dtype=work_dtype, device=device)     # T (beta v)
    aqk = torch.empty(num_tokens, num_heads, chunk_size, dtype=work_dtype, device=device)
    decay = torch.empty(num_chunks, num_heads, k_dim, dtype=torch.float32, device=device)  # exp(G_last)
    if num_chunks > 0:
        kda_chunk_intra_kernel[(num_chunks, num_heads)](
            q, k, v, f, beta_logits, a_log, dt_bias, plan.chunk_start, plan.chunk_len,
            w, u0, qg, kd, aqk, decay, float(gate.lower_bound),
            H=num_heads, K=k_dim, V=v_dim, BT=chunk_size, BK=block_k, BVF=block_v_full, SUB=sub_chunk,
            FORM=form, DENSE=dense, PRECISION=precision,
            num_warps=intra.num_warps, num_stages=intra.num_stages)

    state_cfg = kernel_config("kda_state")
    block_v = min(pow2_at_least(state_cfg.block_v), block_v_full)
    cu32 = torch.tensor(bounds, dtype=torch.int32, device=device)
    slots_dev = slot_ids.to(device=device, dtype=torch.int64)
    has_init = has_initial_state.to(device=device, dtype=torch.int32)
    grid = (triton.cdiv(v_dim, block_v), num_heads, num_seqs)
    kda_chunk_state_kernel[grid](
        w, u0, qg, kd, aqk, decay, output, state, state.stride(0), slots_dev, has_init,
        cu32, plan.seq_chunk, plan.chunk_start, plan.chunk_len,
        ckpt_states, plan.seq_ckpt, max(checkpoint_interval, 1), float(scale),
        H=num_heads, K=k_dim, V=v_dim, BT=chunk_size, BK=block_k, BV=block_v,
        CHECKPOINTS=checkpoint_interval > 0, INTERPRETED=is_interpreted(), PRECISION=precision,
        num_warps=state_cfg.num_warps, num_stages=state_cfg.num_stages)
    return result
