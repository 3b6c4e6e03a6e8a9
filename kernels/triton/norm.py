"""RMSNorm (HF rounding) and gated RMSNorm: one program per row, the whole row in registers."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.tuning_ops import row_config


@triton.jit
def _rms_norm_kernel(x_ptr, weight_ptr, out_ptr, x_row_stride, out_row_stride, width, eps,
                     BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < width
    x_raw = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    x = x_raw.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / width + eps)
    # HF rounds the normalised row to the input dtype before the weight multiply
    normed = (x * rstd).to(x_raw.dtype).to(tl.float32)
    # the weight is rounded to x's dtype too: the product of two x-dtype values, rounded once
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(x_raw.dtype).to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_rms_norm_kernel(x_ptr, gate_ptr, weight_ptr, out_ptr, x_row_stride, gate_row_stride, out_row_stride,
                           width, eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < width
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + row * gate_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / width + eps)
    y = x * rstd * weight * tl.sigmoid(gate)
    tl.store(out_ptr + row * out_row_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """[..., D] -> [N, D] with a unit inner stride (a copy only when the input is not already so)."""
    rows = t.reshape(-1, width)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    width = x.shape[-1]
    if weight.shape != (width,):
        raise ValueError(f"rms_norm weight has shape {tuple(weight.shape)} but x is {width} wide; "
                         f"pass a [{width}] weight")
    rows = _rows(x, width)                                   # [N, D]
    out = torch.empty_like(rows)                             # [N, D] dtype of x
    if rows.shape[0] > 0:
        block = triton.next_power_of_2(width)
        _rms_norm_kernel[(rows.shape[0],)](rows, weight.contiguous(), out, rows.stride(0), out.stride(0), width, eps,
                                           BLOCK_D=block, num_warps=row_config(x.device, block).num_warps)
    return out.view(x.shape)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    width = x.shape[-1]
    if gate.shape != x.shape or weight.shape != (width,):
        raise ValueError(f"gated_rms_norm needs gate of x's shape {tuple(x.shape)} and weight [{width}], got "
                         f"{tuple(gate.shape)} and {tuple(weight.shape)}")
    rows = _rows(x, width)                                   # [N, D]
    gate_rows = _rows(gate, width)                           # [N, D]
    out = torch.empty_like(rows)
    if rows.shape[0] > 0:
        block = triton.next_power_of_2(width)
        _gated_rms_norm_kernel[(rows.shape[0],)](rows, gate_rows, weight.contiguous(), out, rows.stride(0),
                                                 gate_rows.stride(0), out.stride(0), width, eps, BLOCK_D=block,
                                                 num_warps=row_config(x.device, block).num_warps)
    return out.view(x.shape)
