"""GLU activations: SiLU-GLU and SiTU-GLU (K3_ARCHITECTURE.md §2) over x = [gate | up], float32 math."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.tuning_ops import row_config

ACTIVATIONS = ("silu", "situ")


@triton.jit
def tanh_f32(x):
    """tanh from exp only (no vendor libdevice, so the same code builds for NVIDIA and AMD)."""
    magnitude = tl.abs(x)
    decay = tl.exp(-2.0 * magnitude)
    large = (1.0 - decay) / (1.0 + decay)
    # below 1/16 the formula above cancels; the odd Taylor series to x^7 is exact to float32 there
    x2 = magnitude * magnitude
    small = magnitude * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
    value = tl.where(magnitude < 0.0625, small, large)
    return tl.where(x < 0, -value, value)


@triton.jit
def glu_f32(gate, up, IS_SITU: tl.constexpr, HAS_LINEAR_CLIP: tl.constexpr, beta, linear_beta):
    """act(gate) * up for float32 tiles; SiTU soft-clips gate to +-beta and (optionally) up to +-linear_beta."""
    if IS_SITU:
        activated = beta * tanh_f32(gate / beta) * tl.sigmoid(gate)
        if HAS_LINEAR_CLIP:
            up = linear_beta * tanh_f32(up / linear_beta)
    else:
        activated = gate * tl.sigmoid(gate)
    return activated * up


@triton.jit
def _glu_kernel(x_ptr, out_ptr, x_row_stride, out_row_stride, width, beta, linear_beta,
                IS_SITU: tl.constexpr, HAS_LINEAR_CLIP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_row_stride + width + cols, mask=mask, other=0.0).to(tl.float32)
    out = glu_f32(gate, up, IS_SITU, HAS_LINEAR_CLIP, beta, linear_beta)
    tl.store(out_ptr + row * out_row_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def check_activation(activation: str, situ_beta: float | None) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {activation!r}; choose one of: {', '.join(ACTIVATIONS)}")
    if activation == "situ" and (situ_beta is None or situ_beta <= 0):
        raise ValueError(f"situ needs a positive situ_beta (K3 uses 4.0), got {situ_beta!r}")


def glu_activation(x: torch.Tensor, activation: str, situ_beta: float | None = 4.0,
                   situ_linear_beta: float | None = 25.0) -> torch.Tensor:
    check_activation(activation, situ_beta)
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"glu_activation needs x of shape [T, 2I] with an even last dim, got {tuple(x.shape)}")
    num_rows, width = x.shape[0], x.shape[1] // 2
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(num_rows, width, dtype=x.dtype, device=x.device)     # [T, I]
    if num_rows == 0 or width == 0:
        return out
    block = min(triton.next_power_of_2(width), 4096)
    grid = (num_rows, triton.cdiv(width, block))
    _glu_kernel[grid](x, out, x.stride(0), out.stride(0), width, float(situ_beta or 1.0),
                      float(situ_linear_beta) if situ_linear_beta is not None else 1.0,
                      IS_SITU=activation == "situ", HAS_LINEAR_CLIP=situ_linear_beta is not None, BLOCK=block,
                      num_warps=row_config(x.device, block).num_warps)
    return out
