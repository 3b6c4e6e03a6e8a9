"""RMSNorm (Hugging Face rounding order) and the gated RMSNorm of the KDA output."""
from __future__ import annotations

import torch

from kernels.torch._dtypes import compute_dtype


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] -> [..., D] in x.dtype.

    Normalise in float32 (float64 for float64 x), round to x.dtype, then multiply by the weight: the order of the
    Hugging Face modeling code, so a bf16 model matches it bit for bit.
    """
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"rms_norm: x has last dim {x.shape[-1]} but weight has {weight.shape[-1]}; they must match")
    dtype = compute_dtype(x)
    xc = x.to(dtype)
    normed = xc * torch.rsqrt(xc.pow(2).mean(dim=-1, keepdim=True) + eps)  # [..., D]
    return normed.to(x.dtype) * weight.to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], gate [..., D], weight [D] -> [..., D] in x.dtype.

    x / sqrt(mean(x^2) + eps) * weight * sigmoid(gate), all in float32 and rounded once at the end (the fused
    o_norm of the KDA layer; the gate is the output-gate projection).
    """
    if x.shape != gate.shape:
        raise ValueError(f"gated_rms_norm: x {tuple(x.shape)} and gate {tuple(gate.shape)} must have the same shape")
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"gated_rms_norm: x has last dim {x.shape[-1]} but weight has {weight.shape[-1]}")
    dtype = compute_dtype(x, gate)
    xc = x.to(dtype)
    normed = xc * torch.rsqrt(xc.pow(2).mean(dim=-1, keepdim=True) + eps)  # [..., D]
    return (normed * weight.to(dtype) * torch.sigmoid(gate.to(dtype))).to(x.dtype)
