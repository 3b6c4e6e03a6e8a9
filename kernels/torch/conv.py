"""Depthwise causal short convolution + SiLU over the packed [q | k | v] channels, with its tail state.

conv_state[slot] [K_conv - 1, C] holds the last K_conv - 1 PRE-conv inputs of the sequence, oldest first
(window-major). Output token t of a sequence is y_t[c] = silu(sum_j weight[c, j] * in_{t - (K_conv - 1) + j}[c]),
where inputs before the sequence start come from the history (or are zero).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.torch._dtypes import compute_dtype


def _check(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor) -> int:
    channels, kernel = weight.shape
    if x.shape[-1] != channels:
        raise ValueError(f"short_conv: x has {x.shape[-1]} channels but weight is [{channels}, {kernel}]")
    if tuple(conv_state.shape[1:]) != (kernel - 1, channels):
        raise ValueError(f"short_conv: conv_state must be [slots, K_conv - 1, C] = [*, {kernel - 1}, {channels}], "
                         f"got {tuple(conv_state.shape)}")
    return kernel


def _conv_silu(window: torch.Tensor, weight: torch.Tensor, kernel: int) -> torch.Tensor:
    """window [L + K_conv - 1, C] (history then inputs) -> silu(conv) [L, C]."""
    taps = window.unfold(0, kernel, 1)                                         # [L, C, K_conv]
    return F.silu((taps * weight).sum(dim=-1))


def short_conv_prefill(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, conv_state: torch.Tensor,
                       slot_ids: torch.Tensor, has_initial_state: torch.Tensor) -> torch.Tensor:
    """x [T, C], weight [C, K_conv] -> y [T, C] (dtype of x); writes each sequence's new tail to conv_state[slot].

    A sequence shorter than K_conv - 1 keeps part of its old history in the new tail (the window simply slides).
    """
    kernel = _check(x, weight, conv_state)
    bounds, slots, has_init = cu_seqlens.tolist(), slot_ids.tolist(), has_initial_state.tolist()
    if bounds[-1] != x.shape[0] or len(slots) != len(bounds) - 1:
        raise ValueError(f"short_conv_prefill: cu_seqlens {bounds} and slot_ids {slots} do not describe {x.shape[0]} "
                         f"tokens in {len(slots)} sequences")
    dtype = compute_dtype(x, weight)
    w = weight.to(dtype)
    y = torch.empty_like(x)
    for b, slot in enumerate(slots):
        start, end = bounds[b], bounds[b + 1]
        if has_init[b]:
            history = conv_state[slot].to(dtype)                              # [K_conv - 1, C]
        else:
            history = x.new_zeros(kernel - 1, x.shape[-1], dtype=dtype)
        window = torch.cat([history, x[start:end].to(dtype)])                 # [K_conv - 1 + L, C]
        if end > start:
            y[start:end] = _conv_silu(window, w, kernel).to(x.dtype)
        conv_state[slot] = window[window.shape[0] - (kernel - 1):].to(conv_state.dtype)
    return y


def short_conv_decode(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                      slot_ids: torch.Tensor) -> torch.Tensor:
    """x [B, C] (one token per sequence) -> y [B, C]; conv_state[slot_ids] slides by one in place (no host sync)."""
    _check(x, weight, conv_state)
    dtype = compute_dtype(x, weight)
    window = torch.cat([conv_state[slot_ids].to(dtype), x.to(dtype)[:, None, :]], dim=1)  # [B, K_conv, C]
    y = F.silu(torch.einsum("bjc,cj->bc", window, weight.to(dtype)))
    conv_state[slot_ids] = window[:, 1:].to(conv_state.dtype)
    return y.to(x.dtype)
