"""KDA forget gate: the log-decay g from the raw projection f, as a Triton helper and as the `kda_gate` op.

softplus form (Kimi-Linear):   g = -exp(A_log[h]) * softplus(f + dt_bias)
lower_bound form (K3 'safe'):  g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias))
The prefill and decode kernels call `gate_log_decay` on tiles they already hold, so g never makes a round trip
through memory there; the op below exists for callers that want g itself.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3core.ops import KdaGateParams
from kernels.triton.tuning import kernel_config

GATE_FORMS = {"softplus": 0, "lower_bound": 1}


def gate_form_id(params: KdaGateParams) -> int:
    if params.form not in GATE_FORMS:
        raise ValueError(f"unknown KDA gate form {params.form!r}; choose one of: {', '.join(GATE_FORMS)}")
    return GATE_FORMS[params.form]


@triton.jit
def softplus(x):
    """log(1 + exp(x)), exact to float32 for tiny exp(x) (no log1p in portable Triton)."""
    e = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + e
    # Goldberg's trick: log(u) * e / (u - 1) cancels the rounding of 1 + e; when u rounds to 1, log1p(e) == e.
    denom = tl.where(u == 1.0, 1.0, u - 1.0)
    log1p_e = tl.where(u == 1.0, e, tl.log(u) * (e / denom))
    return tl.where(x > 20.0, x, log1p_e)


@triton.jit
def gate_log_decay(f, a_log, dt_bias, lower_bound, FORM: tl.constexpr):
    """f: any tile (float32), a_log: per-head scalar, dt_bias: broadcastable to f -> g <= 0 (float32)."""
    x = f + dt_bias
    if FORM == 1:
        g = lower_bound * tl.sigmoid(tl.exp(a_log) * x)
    else:
        g = -tl.exp(a_log) * softplus(x)
    return g


@triton.jit
def _kda_gate_kernel(f_ptr, g_ptr, a_log_ptr, dt_bias_ptr, num_elements, lower_bound,
                     H: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr, FORM: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # flat index into [T, H, K]
    mask = offs < num_elements
    channel = offs % (H * K)                                             # h * K + c: dt_bias index
    head = channel // K
    f = tl.load(f_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    a_log = tl.load(a_log_ptr + head, mask=mask, other=0.0)
    dt_bias = tl.load(dt_bias_ptr + channel, mask=mask, other=0.0)
    g = gate_log_decay(f, a_log, dt_bias, lower_bound, FORM)
    tl.store(g_ptr + offs, g, mask=mask)


def gate_tensors(params: KdaGateParams, num_heads: int, head_dim: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(A_log [H], dt_bias [H * K]) as contiguous float32 on the device; A_log may be padded past H."""
    a_log = params.A_log.reshape(-1)
    if a_log.numel() < num_heads or params.dt_bias.numel() != num_heads * head_dim:
        raise ValueError(f"KDA gate needs A_log with >= {num_heads} entries and dt_bias with {num_heads * head_dim}, "
                         f"got {a_log.numel()} and {params.dt_bias.numel()}")
    a_log = a_log[:num_heads].to(device=device, dtype=torch.float32).contiguous()
    dt_bias = params.dt_bias.reshape(-1).to(device=device, dtype=torch.float32).contiguous()
    return a_log, dt_bias


def kda_gate(f: torch.Tensor, params: KdaGateParams) -> torch.Tensor:
    """f [T, H, K] -> g [T, H, K] float32 log-decay (<= 0)."""
    if f.dim() != 3:
        raise ValueError(f"kda_gate: f must be [T, H, K], got shape {tuple(f.shape)}")
    form = gate_form_id(params)
    num_tokens, num_heads, head_dim = f.shape
    a_log, dt_bias = gate_tensors(params, num_heads, head_dim, f.device)
    f = f.contiguous()
    g = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32, device=f.device)
    if g.numel() == 0:
        return g
    cfg = kernel_config("kda_gate")
    grid = (triton.cdiv(g.numel(), cfg.block_c),)
    _kda_gate_kernel[grid](f, g, a_log, dt_bias, g.numel(), float(params.lower_bound),
                           H=num_heads, K=head_dim, BLOCK=cfg.block_c, FORM=form, num_warps=cfg.num_warps)
    return g
