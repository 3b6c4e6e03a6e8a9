"""GLU activations: SwiGLU ("silu") and SiTU-GLU ("situ", K3_ARCHITECTURE.md section 2)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.torch._dtypes import compute_dtype

ACTIVATIONS = ("silu", "situ")


def glu_activation(x: torch.Tensor, activation: str, situ_beta: float | None = 4.0,
                   situ_linear_beta: float | None = 25.0) -> torch.Tensor:
    """x [T, 2I] = [gate | up] (non-interleaved) -> [T, I] in x.dtype, float32 math.

    silu: silu(gate) * up.
    situ: (b * tanh(gate / b) * sigmoid(gate)) * (bl * tanh(up / bl)); the up soft-clip is skipped when bl is None.
    The tanh terms soft-clip gate to +-b and up to +-bl, the ranges the MXFP8 QAT of K3 was trained against.
    """
    if x.shape[-1] % 2 != 0:
        raise ValueError(f"glu_activation: last dim {x.shape[-1]} is odd; x must be [gate | up] of equal halves")
    dtype = compute_dtype(x)
    gate, up = x.to(dtype).chunk(2, dim=-1)  # [T, I] each
    if activation == "silu":
        out = F.silu(gate) * up
    elif activation == "situ":
        if situ_beta is None or situ_beta <= 0:
            raise ValueError(f"glu_activation: situ needs a positive situ_beta, got {situ_beta!r}")
        out = situ_beta * torch.tanh(gate / situ_beta) * torch.sigmoid(gate)
        if situ_linear_beta is not None:
            out = out * (situ_linear_beta * torch.tanh(up / situ_linear_beta))
        else:
            out = out * up
    else:
        raise ValueError(f"glu_activation: unknown activation {activation!r}; choose one of {', '.join(ACTIVATIONS)}")
    return out.to(x.dtype)
