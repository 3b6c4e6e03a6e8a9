"""MXFP4 (OCP microscaling FP4) as K3's routed experts are stored: compressed-tensors `mxfp4-pack-quantized`.

Layout (K3_ARCHITECTURE.md §4.2):
* `weight_packed` uint8 [..., N, K/2]: two E2M1 codes per byte, the LOW nibble holds the even k, the high nibble
  the odd k. A code is sign (bit 3) and a magnitude index (bits 0-2) into {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
* `weight_scale` uint8 [..., N, K/32]: an E8M0 exponent biased by 127 shared by 32 consecutive k,
  scale = 2^(byte - 127). Byte 255 (NaN in E8M0) is read as 254, as production kernels do.

Dequantisation is exact in float32: every product e2m1 * 2^e is representable (2^-127 is a float32 subnormal),
except that 6 * 2^127 overflows to inf; in float64 every value is finite and exact (the oracle's form).
"""
from __future__ import annotations

import math

import torch

BLOCK_SIZE = 32
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MAX_EXPONENT = 2          # 6 = 1.5 * 2^2: a block scaled by 2^(floor(log2 amax) - 2) lands in [-8, 8)
_SCALE_BIAS = 127


def _code_table(device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[16]: value of each 4-bit code (bit 3 = sign)."""
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=dtype, device=device)
    return torch.cat([magnitudes, -magnitudes])


def _scale_table(device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[256]: 2^(byte - 127), byte 255 read as 254. Built from exact float64 powers of two."""
    values = [math.ldexp(1.0, min(byte, 254) - _SCALE_BIAS) for byte in range(256)]
    return torch.tensor(values, dtype=torch.float64).to(device=device, dtype=dtype)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 packed [..., N, K/2] and scale [..., N, K/32] -> [..., N, K] in `dtype` (float32 or float64: exact,
    but for float32's overflow of 6 * 2^127)."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise TypeError(f"MXFP4 tensors must be uint8, got packed {packed.dtype} and scale {scale.dtype}")
    num_k = packed.shape[-1] * 2
    if num_k % BLOCK_SIZE or scale.shape[-1] != num_k // BLOCK_SIZE or scale.shape[:-1] != packed.shape[:-1]:
        raise ValueError(f"MXFP4 scale shape {tuple(scale.shape)} does not match packed shape {tuple(packed.shape)}: "
                         f"expected [..., N, K/{BLOCK_SIZE}] with K = 2 * packed.shape[-1]")
    codes = _code_table(packed.device, dtype)
    low = codes[(packed & 0x0F).long()]                     # [..., N, K/2] even k
    high = codes[(packed >> 4).long()]                      # [..., N, K/2] odd k
    values = torch.stack([low, high], dim=-1).flatten(-2)   # [..., N, K]: interleave back to k order
    scales = _scale_table(packed.device, dtype)[scale.long()]      # [..., N, K/32]
    values = values.unflatten(-1, (num_k // BLOCK_SIZE, BLOCK_SIZE)) * scales.unsqueeze(-1)  # [..., N, K/32, 32]
    return values.flatten(-2)


def max_scale_of(*scales: torch.Tensor) -> int:
    """The largest E8M0 byte of the scale tensors (0 if all are empty): the `max_scale` bound the MXFP4 expert op
    takes, measured once when the experts are loaded (one host sync per tensor)."""
    return max((int(scale.max()) for scale in scales if scale.numel()), default=0)


QUANTIZE_CHUNK_ELEMENTS = 1 << 24   # elements quantised at once: the nearest-code search holds 8 floats of each


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [..., N, K] (K a multiple of 32) -> (packed uint8 [..., N, K/2], scale uint8 [..., N, K/32]).

    Each block of 32 gets the OCP shared exponent floor(log2(amax)) - 2; each element is rounded to the nearest
    representable E2M1 value (magnitudes above 6 saturate to 6), so dequantize(quantize(w)) is the nearest MXFP4
    value of w under that scale. Rows are quantised QUANTIZE_CHUNK_ELEMENTS at a time (each row on its own, so the
    result does not depend on the chunking): the search's temporaries are 32 bytes an element, which for a whole
    expert stack (k3-mini's gate/up, 0.7G elements) would not fit an 80 GB GPU.
    """
    num_k = weight.shape[-1]
    if num_k % BLOCK_SIZE:
        raise ValueError(f"MXFP4 needs the last dimension to be a multiple of {BLOCK_SIZE}, got {num_k}")
    rows = weight.detach().reshape(-1, num_k)
    step = max(1, QUANTIZE_CHUNK_ELEMENTS // num_k)
    parts = [_quantize_rows(rows[start:start + step]) for start in range(0, max(rows.shape[0], 1), step)]
    packed = torch.cat([part for part, _ in parts])
    scale = torch.cat([part for _, part in parts])
    return (packed.reshape(*weight.shape[:-1], num_k // 2).contiguous(),
            scale.reshape(*weight.shape[:-1], num_k // BLOCK_SIZE).contiguous())


def _quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_mxfp4` of float [R, K] in one piece."""
    num_k = weight.shape[-1]
    blocks = weight.to(torch.float32).unflatten(-1, (num_k // BLOCK_SIZE, BLOCK_SIZE))        # [R, K/32, 32]
    amax = blocks.abs().amax(dim=-1)                                                           # [..., N, K/32]
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(2.0 ** -126))) - _E2M1_MAX_EXPONENT,
                           torch.zeros_like(amax))
    exponent = exponent.clamp(-_SCALE_BIAS, 254 - _SCALE_BIAS)
    scaled = blocks / torch.exp2(exponent).unsqueeze(-1)                                       # [..., N, K/32, 32]
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=weight.device)
    index = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(dim=-1)                     # [..., N, K/32, 32]
    sign = ((scaled < 0) & (index > 0)).to(torch.uint8) << 3                                   # no negative zero codes
    code = (index.to(torch.uint8) | sign).flatten(-2)                                          # [..., N, K]
    packed = code[..., 0::2] | (code[..., 1::2] << 4)                                          # low nibble = even k
    scale = (exponent + _SCALE_BIAS).to(torch.uint8)
    return packed, scale
