"""The swap-AB MXFP4 kernels' operands (`kernels.triton.moe_mxfp4_swap`): weight tiles decoded in registers from
the packed codes and E8M0 scales (float32, bf16 pair math, or NVIDIA PTX two codes per bf16x2 multiply), the
`tl.dot_scaled` product on the packed bytes, and the x / hidden rows as the dots' second operands (stride-2 halves,
one contiguous tile split in registers, or presplit runs).

Decoding a byte: the low nibble is column 2j, the high nibble 2j + 1 (`k3core.model.mxfp4`). The three magnitude
bits of a code placed at bits 9-11 of a float16 and its sign at bit 15 make the float16 code * 2^-14 exactly
(index 1, 0.5, becomes the float16 subnormal 2^-15, which the float16 -> float32 conversion keeps exactly), so a
code costs two masks, two shifts and an or instead of a select over the magnitude index. It is then scaled by 2^14
and by its E8M0 scale in float32 (in that order, so no subnormal intermediate) and cast to x's dtype; the two
half-K dots (even columns of x against the low nibbles, odd ones against the high) need no nibble interleave.
"""
from __future__ import annotations

import triton
import triton.language as tl



@triton.jit
def _e8m0_f32(scale):
    """int32 scale bytes -> float32 2^(byte - 127); byte 0 is the subnormal 2^-127, byte 255 reads as 254."""
    byte = tl.minimum(scale, 254)
    return tl.where(byte == 0, 0x00400000, byte << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e8m0_bf16_bits(scale):
    """int32 scale bytes -> the int32 bit patterns of bf16 2^(byte - 127) (what `_e8m0_f32(scale).to(bfloat16)`
    gives, without the conversion): byte << 7 is the exponent field, the floor 0x40 is byte 0's subnormal 2^-127
    (every other byte shifts to 0x80 or more) and the ceiling 0x7F00 reads 255 as 254; two min / max and no select
    (a compare and a select per scale cost 34 more instructions in the sm_90 decode-batch gate/up loop)."""
    return tl.minimum(tl.maximum(scale << 7, 0x40), 0x7F00)


@triton.jit
def _e8m0_bf16(scale):
    """int32 scale bytes -> bf16 2^(byte - 127) (`_e8m0_bf16_bits` bitcast)."""
    return _e8m0_bf16_bits(scale).to(tl.int16).to(tl.bfloat16, bitcast=True)


# SCALE_FOLD: every scale byte of the call is at most FOLD_MAX_SCALE (the op's `max_scale`, measured at load), so
# the decode's constant factor (2^126 for bf16 codes, 2^14 for float16 ones) folds into the scale: 2^(byte - 1)
# is a normal bf16 for byte <= 128, 2^(byte - 113) a normal float32, and each product is the same exact
# code * 2^(byte - 127) as with two multiplies, one multiply per code (or bf16 pair) fewer. Checkpoint scales sit
# far below (weights of magnitude <= 12 need byte <= 128; K3's are near 2^-8, byte ~119).
FOLD_MAX_SCALE = 128


@triton.jit
def _e8m0_bf16_folded_bits(scale):
    """int32 scale bytes <= FOLD_MAX_SCALE -> the int32 bits of bf16 2^(byte - 1): 2^126 x the E8M0 scale."""
    return (scale + 126) << 7


@triton.jit
def _e8m0_f32_folded(scale):
    """int32 scale bytes <= FOLD_MAX_SCALE -> float32 2^(byte - 113): 2^14 x the E8M0 scale."""
    return ((scale + 14) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _f16_code(bits):
    """int32 float16 bit patterns of code * 2^-14 -> the code as float32 (exact)."""
    return _f16_code_scaled(bits) * 16384.0


@triton.jit
def _f16_code_scaled(bits):
    """int32 float16 bit patterns of code * 2^-14 -> code * 2^-14 as float32 (exact)."""
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


# Two packed bytes ($2, 16 bits) and their two bf16 scales ($3) -> the low-nibble codes ($0) and the high-nibble
# codes ($1) as bf16 pairs, times the scale. prmt spreads the bytes to the two 16-bit halves of a register (t); a
# code's three magnitude bits moved to bits 6-8 of its half and its sign to bit 15 make the bf16 code * 2^-126
# exactly (index 1, 0.5, is the subnormal 2^-127); x 2^126 restores the code and x the scale (2^(byte - 127),
# 2^-127 a subnormal) scales it, each product exact or the overflow's inf, as the float32 path gives. Each nibble,
# masked alone in its half, reaches both places with one multiply: n * (2^6 + 2^12) for the low nibble (n << 6
# fills bits 6-9, n << 12 bits 12-15: no shared bit, so no carry), the high nibble, already 4 bits up, times
# 2^2 + 2^8; a mask keeps bits 15 and 6-8 of each half (3 instructions a pair of codes, where two shifts, an or
# and a mask, or two shifts, two masks and an or, took 3 and 4). Two bytes per call: the 16-bit operand is what
# the dot's A fragment holds in one register (four bytes per call made Triton gather bytes from two rows with a
# prmt each).
def _pair_decode_ptx(fold: bool) -> str:
    """The asm text; `fold`: the scale operand already carries the 2^126 (SCALE_FOLD), one multiply per pair."""
    times = ("mul.rn.bf16x2 {out}, a, $3;" if fold else "mul.rn.bf16x2 a, a, c126;  mul.rn.bf16x2 {out}, a, $3;")
    return "\n".join([
        "{",
        ".reg .b32 t, a, c126;",
        "mov.b32 c126, 0x7E807E80;",
        "cvt.u32.u16 t, $2;",
        "prmt.b32 t, t, 0, 0x4140;",
        "and.b32 a, t, 0x000F000F;  mul.lo.u32 a, a, 0x1040;  and.b32 a, a, 0x81C081C0;",
        times.format(out="$0"),
        "and.b32 a, t, 0x00F000F0;  mul.lo.u32 a, a, 0x104;  and.b32 a, a, 0x81C081C0;",
        times.format(out="$1"),
        "}"])


_ASM_PAIR_DECODE = tl.constexpr(_pair_decode_ptx(fold=False))
_ASM_PAIR_DECODE_FOLDED = tl.constexpr(_pair_decode_ptx(fold=True))


@triton.jit
def _asm_pair_decode(byte, scale_bf16, SCALE_FOLD: tl.constexpr = False):
    """uint8 code bytes and bf16 scales (same shape) -> (low nibbles, high nibbles) x scale in bf16: NVIDIA PTX
    (sm_90+: mul.rn.bf16x2), two bytes per call. SCALE_FOLD: the scales are 2^126 x E8M0 (one multiply fewer)."""
    if SCALE_FOLD:
        return tl.inline_asm_elementwise(_ASM_PAIR_DECODE_FOLDED, "=r,=r,h,r", [byte, scale_bf16],
                                         dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=2)
    return tl.inline_asm_elementwise(_ASM_PAIR_DECODE, "=r,=r,h,r", [byte, scale_bf16],
                                     dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=2)


@triton.jit
def _packed_rows(packed_ptr, scale_ptr, expert, packed_expert_stride, packed_row_stride, scale_expert_stride,
                 scale_row_stride, rows, row_mask, k_start, num_k, HALF_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The packed bytes [BLOCK_N, HALF_K] and the scale bytes [BLOCK_N, HALF_K / 16] of W rows `rows` of one
    expert for K columns [k_start, k_start + 2 * HALF_K), as stored (uint8); masked bytes read as code 0, masked
    scales as 127. EVEN_K (num_k a multiple of 2 * HALF_K) drops the K mask, which varies along the contiguous
    bytes and so would make every byte its own load; the row mask is constant along them."""
    j = tl.arange(0, HALF_K)
    if EVEN_K:
        mask = row_mask[:, None]                                        # broadcast: constant along K
    else:
        mask = row_mask[:, None] & (k_start + 2 * j < num_k)[None, :]  # num_k is a multiple of 32: both halves
    packed_rows = (packed_ptr + expert.to(tl.int64) * packed_expert_stride
                   + rows[:, None].to(tl.int64) * packed_row_stride)
    byte = tl.load(packed_rows + (k_start // 2 + j)[None, :], mask=mask, other=0)                 # [BLOCK_N, HALF_K]
    g = tl.arange(0, HALF_K // 16)                                      # 16 bytes = 32 columns share a scale
    if EVEN_K:
        scale_mask = row_mask[:, None]
    else:
        scale_mask = row_mask[:, None] & ((k_start + 32 * g) < num_k)[None, :]
    scale_rows = scale_ptr + expert.to(tl.int64) * scale_expert_stride + rows[:, None].to(tl.int64) * scale_row_stride
    return byte, tl.load(scale_rows + (k_start // 32 + g)[None, :], mask=scale_mask, other=127)


@triton.jit
def _weight_rows(packed_ptr, scale_ptr, expert, packed_expert_stride, packed_row_stride, scale_expert_stride,
                 scale_row_stride, rows, row_mask, k_start, num_k, HALF_K: tl.constexpr, BLOCK_N: tl.constexpr,
                 DTYPE: tl.constexpr, EVEN_K: tl.constexpr, HALF_MATH: tl.constexpr = False,
                 ASM_DECODE: tl.constexpr = False, SCALE_FOLD: tl.constexpr = False):
    """W rows `rows` of one expert for K columns [k_start, k_start + 2 * HALF_K), as (even k, odd k) tiles
    [BLOCK_N, HALF_K] in DTYPE (the bytes and scales from `_packed_rows`); masked entries (past num_k or past the
    rows) are zero. SCALE_FOLD: every scale byte is <= FOLD_MAX_SCALE (one multiply per code or pair fewer, the
    same values)."""
    GROUPS: tl.constexpr = HALF_K // 16                                 # 16 bytes = 32 columns share a scale
    raw, scale_byte = _packed_rows(packed_ptr, scale_ptr, expert, packed_expert_stride, packed_row_stride,
                                   scale_expert_stride, scale_row_stride, rows, row_mask, k_start, num_k, HALF_K,
                                   EVEN_K)
    scale_byte = scale_byte.to(tl.int32)
    if ASM_DECODE:
        if SCALE_FOLD:
            scale_bits = _e8m0_bf16_folded_bits(scale_byte)
        else:
            scale_bits = _e8m0_bf16_bits(scale_byte)
        scale_bf16 = scale_bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
        scale_bf16 = tl.reshape(tl.broadcast_to(scale_bf16[:, :, None], (BLOCK_N, GROUPS, 16)), (BLOCK_N, HALF_K))
        return _asm_pair_decode(raw, scale_bf16, SCALE_FOLD)
    if SCALE_FOLD:
        scale = _e8m0_f32_folded(scale_byte)                            # 2^14 x the scale
    else:
        scale = _e8m0_f32(scale_byte)
    byte = raw.to(tl.int32)
    low_bits = ((byte & 7) << 9) | ((byte & 8) << 12)
    high_bits = ((byte & 0x70) << 5) | ((byte & 0x80) << 8)
    if HALF_MATH:
        # bf16 only: the code in float16 (x 2^14 is exact there: |code| <= 6), then x the scale in bf16 (exact:
        # a power of two, 2^-127 a bf16 subnormal), two elements per instruction; the same values as below
        scale_bf16 = tl.reshape(tl.broadcast_to(scale.to(tl.bfloat16)[:, :, None], (BLOCK_N, GROUPS, 16)),
                                (BLOCK_N, HALF_K))
        low = low_bits.to(tl.int16).to(tl.float16, bitcast=True)
        high = high_bits.to(tl.int16).to(tl.float16, bitcast=True)
        if SCALE_FOLD:                                                  # code * 2^-14 widens exactly to bf16
            return low.to(tl.bfloat16) * scale_bf16, high.to(tl.bfloat16) * scale_bf16
        return (low * 16384.0).to(tl.bfloat16) * scale_bf16, (high * 16384.0).to(tl.bfloat16) * scale_bf16
    scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BLOCK_N, GROUPS, 16)), (BLOCK_N, HALF_K))
    if SCALE_FOLD:
        return (_f16_code_scaled(low_bits) * scale).to(DTYPE), (_f16_code_scaled(high_bits) * scale).to(DTYPE)
    return (_f16_code(low_bits) * scale).to(DTYPE), (_f16_code(high_bits) * scale).to(DTYPE)


@triton.jit
def _weight_tile(packed_ptr, scale_ptr, expert, packed_expert_stride, packed_row_stride, scale_expert_stride,
                 scale_row_stride, rows, row_mask, k_start, num_k, HALF_K: tl.constexpr, BLOCK_N: tl.constexpr,
                 DTYPE: tl.constexpr, EVEN_K: tl.constexpr, HALF_MATH: tl.constexpr, ASM_DECODE: tl.constexpr,
                 SCALE_FOLD: tl.constexpr):
    """`_weight_rows`' two halves interleaved back into column order: W rows `rows` for K columns
    [k_start, k_start + 2 * HALF_K) as one [BLOCK_N, 2 * HALF_K] tile (column 2j the low nibble of byte j)."""
    low, high = _weight_rows(packed_ptr, scale_ptr, expert, packed_expert_stride, packed_row_stride,
                             scale_expert_stride, scale_row_stride, rows, row_mask, k_start, num_k, HALF_K, BLOCK_N,
                             DTYPE, EVEN_K, HALF_MATH, ASM_DECODE, SCALE_FOLD)
    return tl.reshape(tl.join(low, high), (BLOCK_N, 2 * HALF_K))


@triton.jit
def _rows_t(row_ptrs, row_mask, k_start, num_k, HALF_K: tl.constexpr, BLOCK_M: tl.constexpr, EVEN_K: tl.constexpr,
            SPLIT_X: tl.constexpr, PRESPLIT: tl.constexpr = False):
    """Even and odd K columns [k_start, k_start + 2 * HALF_K) of the rows behind `row_ptrs` [BLOCK_M] (pointers
    to each row's first element), as the dot's second operands [HALF_K, BLOCK_M]. SPLIT_X loads the contiguous
    [BLOCK_M, 2 * HALF_K] tile (vector loads) and splits it in registers; PRESPLIT rows are already ordered
    [even | odd] per 2 * HALF_K columns and zero-padded to a whole step (`presplit_columns`), so each half is a
    contiguous run with no K mask; otherwise two stride-2 loads. Padding rows stay masked (zero-filled): read from
    a real row instead, as the Gluon decode kernels do (`moe_mxfp4_gluon._x_rows`), K3's 64-token swap kernels
    lost 6 and 9 of ~500 SASS instructions a step and ran 0.3% (gate/up) and 1.3% (down) longer on an H100
    (14ee48c): on sm_90 these loads become cp.async copies that bypass L1, so each padding column's copy is an L2
    request of its own, where the zero-fill issues none."""
    if PRESPLIT:
        j = tl.arange(0, HALF_K)
        even = tl.load(row_ptrs[None, :] + (k_start + j)[:, None], mask=row_mask[None, :], other=0.0)
        odd = tl.load(row_ptrs[None, :] + (k_start + HALF_K + j)[:, None], mask=row_mask[None, :], other=0.0)
        return even, odd
    if SPLIT_X:
        ks = k_start + tl.arange(0, 2 * HALF_K)
        if EVEN_K:
            mask = row_mask[:, None]
        else:
            mask = row_mask[:, None] & (ks < num_k)[None, :]
        tile = tl.load(row_ptrs[:, None] + ks[None, :], mask=mask, other=0.0)           # [BLOCK_M, 2 * HALF_K]
        even, odd = tl.split(tl.reshape(tile, (BLOCK_M, HALF_K, 2)))
        return tl.trans(even), tl.trans(odd)
    k_even = k_start + 2 * tl.arange(0, HALF_K)
    if EVEN_K:
        mask = row_mask[None, :]
    else:
        mask = (k_even < num_k)[:, None] & row_mask[None, :]
    even = tl.load(row_ptrs[None, :] + k_even[:, None], mask=mask, other=0.0)          # [HALF_K, BLOCK_M]
    odd = tl.load(row_ptrs[None, :] + (k_even + 1)[:, None], mask=mask, other=0.0)
    return even, odd


@triton.jit
def _scaled_dot(acc, packed_ptr, scale_ptr, expert, packed_expert_stride, packed_row_stride, scale_expert_stride,
                scale_row_stride, rows, row_mask, k_start, num_k, x_t, HALF_K: tl.constexpr, BLOCK_N: tl.constexpr,
                EVEN_K: tl.constexpr, X_FORMAT: tl.constexpr):
    """acc + W[rows, k_start:k_start + 2 * HALF_K] x_t through `tl.dot_scaled`: the packed bytes and E8M0 scales
    go to the MMA as they are (native MXFP4 on sm_100 / gfx950; elsewhere Triton upcasts them to bf16 itself).
    Scale byte 255 is clamped to 254 first, as `k3core.model.mxfp4` reads it (E8M0 255 is NaN)."""
    byte, scale = _packed_rows(packed_ptr, scale_ptr, expert, packed_expert_stride, packed_row_stride,
                               scale_expert_stride, scale_row_stride, rows, row_mask, k_start, num_k, HALF_K, EVEN_K)
    return tl.dot_scaled(byte, tl.minimum(scale, 254).to(tl.uint8), "e2m1", x_t, None, X_FORMAT, acc)


@triton.jit
def _rows_k(row_ptrs, row_mask, k_start, num_k, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """K columns [k_start, k_start + BLOCK_K) of the rows behind `row_ptrs` [BLOCK_M], as [BLOCK_K, BLOCK_M]."""
    ks = k_start + tl.arange(0, BLOCK_K)
    if EVEN_K:
        mask = row_mask[None, :]
    else:
        mask = (ks < num_k)[:, None] & row_mask[None, :]
    return tl.load(row_ptrs[None, :] + ks[:, None], mask=mask, other=0.0)
