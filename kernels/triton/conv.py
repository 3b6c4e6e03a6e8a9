"""Short causal depthwise convolution + SiLU (see `k3core.ops`), prefill and decode, with the window state.

conv_state[slot] [K_conv - 1, C] holds the last K_conv - 1 PRE-conv inputs of a sequence, oldest first.
y_t[c] = silu(sum_j weight[c, j] * in_{t - (K_conv - 1) + j}[c]); inputs before the sequence start come from
conv_state[slot] when has_initial_state, else are zero.
Prefill runs two kernels so that no program reads history another program has already overwritten: the
first computes y (reading the old windows), the second writes the new windows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.host_index import index_tables
from kernels.triton.tuning import kernel_config, pow2_at_least


@triton.jit
def _conv_prefill_kernel(x_ptr, w_ptr, y_ptr, conv_state_ptr, state_stride, slot_ptr, has_init_ptr,
                         cu_seqlens_ptr, block_seq_ptr, block_pos_ptr, C,
                         KW: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    i_block = tl.program_id(0)
    i_c = tl.program_id(1)
    seq = tl.load(block_seq_ptr + i_block)
    bos = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    seq_len = tl.load(cu_seqlens_ptr + seq + 1) - bos
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    has_init = tl.load(has_init_ptr + seq) != 0
    pos = tl.load(block_pos_ptr + i_block) + tl.arange(0, BT)                  # [BT] position in the sequence
    chans = i_c * BC + tl.arange(0, BC)
    c_ok = chans < C
    row_ok = pos < seq_len
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(KW):
        src = pos - (KW - 1) + j                                                # [BT] input position (< 0: history)
        from_x = row_ok & (src >= 0)
        from_hist = row_ok & (src < 0) & has_init
        x = tl.load(x_ptr + (bos + src)[:, None] * C + chans[None, :],
                    mask=from_x[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
        hist = tl.load(conv_state_ptr + slot * state_stride + (KW - 1 + src)[:, None] * C + chans[None, :],
                       mask=from_hist[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
        weight = tl.load(w_ptr + chans * KW + j, mask=c_ok, other=0.0).to(tl.float32)  # [BC]
        acc += (x + hist) * weight[None, :]
    y = acc * tl.sigmoid(acc)
    tl.store(y_ptr + (bos + pos)[:, None] * C + chans[None, :], y.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & c_ok[None, :])


@triton.jit
def _conv_window_kernel(x_ptr, conv_state_ptr, state_stride, slot_ptr, has_init_ptr, cu_seqlens_ptr, C,
                        KW: tl.constexpr, BW: tl.constexpr, BC: tl.constexpr):
    """New window of sequence b: the last K_conv - 1 entries of [old window | this call's inputs]."""
    i_b = tl.program_id(0)
    i_c = tl.program_id(1)
    bos = tl.load(cu_seqlens_ptr + i_b).to(tl.int64)
    seq_len = tl.load(cu_seqlens_ptr + i_b + 1) - bos
    slot = tl.load(slot_ptr + i_b).to(tl.int64)
    has_init = tl.load(has_init_ptr + i_b) != 0
    idx = tl.arange(0, BW)                                                      # window row
    chans = i_c * BC + tl.arange(0, BC)
    c_ok = chans < C
    row_ok = idx < KW - 1
    src = seq_len - (KW - 1) + idx                                              # [BW] input position
    from_x = row_ok & (src >= 0)
    from_hist = row_ok & (src < 0) & has_init
    x = tl.load(x_ptr + (bos + src)[:, None] * C + chans[None, :],
                mask=from_x[:, None] & c_ok[None, :], other=0.0)
    hist = tl.load(conv_state_ptr + slot * state_stride + (KW - 1 + src)[:, None] * C + chans[None, :],
                   mask=from_hist[:, None] & c_ok[None, :], other=0.0)
    window = x.to(tl.float32) + hist.to(tl.float32)                             # [BW, BC]
    # A short sequence shifts its own window: every lane must read before any lane writes.
    tl.debug_barrier()
    tl.store(conv_state_ptr + slot * state_stride + idx[:, None] * C + chans[None, :],
             window.to(conv_state_ptr.dtype.element_ty), mask=row_ok[:, None] & c_ok[None, :])


@triton.jit
def _conv_decode_kernel(x_ptr, w_ptr, y_ptr, conv_state_ptr, state_stride, slot_ptr, C,
                        KW: tl.constexpr, BW: tl.constexpr, BC: tl.constexpr):
    i_b = tl.program_id(0)
    i_c = tl.program_id(1)
    slot = tl.load(slot_ptr + i_b).to(tl.int64)
    idx = tl.arange(0, BW)                                                      # tap index j
    chans = i_c * BC + tl.arange(0, BC)
    c_ok = chans < C
    base = conv_state_ptr + slot * state_stride
    x = tl.load(x_ptr + i_b * C + chans, mask=c_ok, other=0.0).to(tl.float32)  # [BC]
    # taps[j] = window row j for j < K_conv - 1, the new input for j = K_conv - 1.
    in_window = (idx < KW - 1)[:, None] & c_ok[None, :]
    taps = tl.load(base + idx[:, None] * C + chans[None, :], mask=in_window, other=0.0).to(tl.float32)
    taps = tl.where((idx == KW - 1)[:, None], x[None, :], taps)                 # [BW, BC]
    weight = tl.load(w_ptr + chans[None, :] * KW + idx[:, None],
                     mask=(idx < KW)[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
    acc = tl.sum(taps * weight, 0)                                              # [BC]
    y = acc * tl.sigmoid(acc)
    # New window row j = taps[j + 1]: read the old rows 1.. before anyone writes row 0.
    shifted = tl.load(base + (idx + 1)[:, None] * C + chans[None, :],
                      mask=(idx + 1 < KW - 1)[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
    shifted = tl.where((idx == KW - 2)[:, None], x[None, :], shifted)
    tl.debug_barrier()
    tl.store(base + idx[:, None] * C + chans[None, :], shifted.to(conv_state_ptr.dtype.element_ty),
             mask=in_window)
    tl.store(y_ptr + i_b * C + chans, y.to(y_ptr.dtype.element_ty), mask=c_ok)


def _check(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor) -> int:
    channels, kernel = weight.shape
    if x.shape[-1] != channels or kernel < 2:
        raise ValueError(f"short_conv: x has {x.shape[-1]} channels but weight is [{channels}, {kernel}] "
                         f"(need C channels and K_conv >= 2)")
    if tuple(conv_state.shape[1:]) != (kernel - 1, channels) or conv_state.stride()[1:] != (channels, 1):
        raise ValueError(f"short_conv: conv_state must be [slots, K_conv - 1, C] = [*, {kernel - 1}, {channels}] "
                         f"with contiguous inner dims, got {tuple(conv_state.shape)} strides {conv_state.stride()}")
    return kernel


def short_conv_prefill(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, conv_state: torch.Tensor,
                       slot_ids: torch.Tensor, has_initial_state: torch.Tensor) -> torch.Tensor:
    """x [T, C], weight [C, K_conv] -> y [T, C] (dtype of x); conv_state[slot_ids] gets each new window."""
    kernel = _check(x, weight, conv_state)
    bounds = cu_seqlens.tolist()                     # one host sync per call (none when cu_seqlens is on the host)
    num_seqs = len(bounds) - 1
    if bounds[-1] != x.shape[0] or slot_ids.numel() != num_seqs or has_initial_state.numel() != num_seqs:
        raise ValueError(f"short_conv_prefill: cu_seqlens {bounds}, slot_ids [{slot_ids.numel()}] and "
                         f"has_initial_state [{has_initial_state.numel()}] do not describe {x.shape[0]} tokens")
    y = torch.empty_like(x)
    if num_seqs == 0:
        return y
    cfg = kernel_config("conv_prefill")
    channels = x.shape[1]
    x, weight = x.contiguous(), weight.contiguous()
    block_seq, block_pos = [], []
    for b in range(num_seqs):
        for pos in range(0, bounds[b + 1] - bounds[b], cfg.block_t):
            block_seq.append(b)
            block_pos.append(pos)
    device = x.device
    cu32, slots, block_seq_t, block_pos_t = index_tables([bounds, slot_ids.tolist(), block_seq, block_pos], device)
    has_init = has_initial_state.to(device=device, dtype=torch.int32)
    block_c = min(cfg.block_c, pow2_at_least(channels))
    num_c_blocks = triton.cdiv(channels, block_c)
    if block_seq:
        _conv_prefill_kernel[(len(block_seq), num_c_blocks)](
            x, weight, y, conv_state, conv_state.stride(0), slots, has_init, cu32, block_seq_t, block_pos_t, channels,
            KW=kernel, BT=cfg.block_t, BC=block_c, num_warps=cfg.num_warps)
    _conv_window_kernel[(num_seqs, num_c_blocks)](
        x, conv_state, conv_state.stride(0), slots, has_init, cu32, channels,
        KW=kernel, BW=pow2_at_least(kernel - 1, floor=2), BC=block_c, num_warps=cfg.num_warps)
    return y


def short_conv_decode(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                      slot_ids: torch.Tensor) -> torch.Tensor:
    """x [B, C] (one token per sequence) -> y [B, C]; conv_state[slot_ids] slides by one in place (no host sync)."""
    kernel = _check(x, weight, conv_state)
    y = torch.empty_like(x)
    num_seqs, channels = x.shape
    if num_seqs == 0:
        return y
    cfg = kernel_config("conv_decode")
    block_c = min(cfg.block_c, pow2_at_least(channels))
    _conv_decode_kernel[(num_seqs, triton.cdiv(channels, block_c))](
        x.contiguous(), weight.contiguous(), y, conv_state, conv_state.stride(0),
        slot_ids.to(device=x.device, dtype=torch.int64), channels,
        KW=kernel, BW=pow2_at_least(kernel, floor=2), BC=block_c, num_warps=cfg.num_warps)
    return y
