"""MXFP4 expert weights re-laid at load time in the order the sm_90 MMA holds them ("fragment order"), and the swap-AB
expert GEMMs that read them: each thread loads its own weight codes as whole 32-bit words (16 bytes at a time) and
decodes a word straight into the four registers of its wgmma A fragment, with no byte gathering.

Why. The swap kernels of `kernels.triton.moe_mxfp4_swap` read the checkpoint's byte order: a thread's A fragment
(rows r and r + 8, columns c, c + 1, c + 8, c + 9 of a 16-column slab) is two bytes here and two there, so every
K step spends a 16-bit shared-memory load, a byte permute and a shift-and-mask decode per two bytes. Here the 8 codes
of one thread's fragment of one slab are one int32 word whose bits are placed so that three of its four bf16 pairs
are one shift and one mask each (`decode_word`).

Layout of a weight matrix W [N, K] (one expert), rows padded to a multiple of 64 (TILE_ROWS) and K to a multiple of
256 (STEP_K), codes zero in the padding:
* words int32 [N / 64, K / 256, 4 (kb), 4 (warp w), 8 (g), 4 (t), 4 (slab s)]: the word of thread 4g + t of warp w
  for the 16-column slab 4 kb + s of a 256-column step of a 64-row tile. Its tile rows are 16w + g (r0) and
  16w + g + 8 (r1), its columns c = 64 kb + 16 s + 2t (c0) and c0 + 8, so its four bf16 pairs are
  p0 = (r0, c0..c0+1), p1 = (r1, c0..), p2 = (r0, c0+8..), p3 = (r1, c0+8..), the wgmma A registers a0..a3.
* scales uint8 [N / 64, K / 256, 4 (w), 8 (g), 2 (jr), 8 (group)]: the E8M0 byte of tile row 16w + 8jr + g for the
  32-column group of the step, 16 bytes per (w, g), one vector load for the four threads that share them.
Bits of a word (lo / hi: the pair's first / second column, hi = lo + 16): each code's sign at bit 15 and three
magnitude bits at 6-8 of its half makes the bf16 code * 2^-126 (`kernels.triton.moe_mxfp4_operands`), and
p0 sits there as stored (w & M), p1 three bits lower ((w << 3) & M), p2 six lower ((w << 6) & M), p3 in what is
left: sign at 14, magnitude bits 0, 1, 2 at 10, 11, 13 (three shifts). M = 0x81C081C0.

Gate/up weights are also stacked at pack time: tile t holds the gate rows of I columns 32t..32t+31 over their up
rows, so one dot per K step gives both halves of the GLU for 32 columns (`Mxfp4Tile.stacked`'s idea, here in the
layout). Down weights keep their row order. x and the expert hidden stay in column order: no presplit copy.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.triton.activation import glu_f32
from kernels.triton.moe_mxfp4_operands import _e8m0_bf16_bits, _e8m0_bf16_folded_bits, _rows_k

TILE_ROWS = 64                      # one warpgroup's wgmma M
STEP_K = 256                        # columns per K step (and per word block / scale block of the layout)
WORDS_PER_STEP = TILE_ROWS * STEP_K // 8      # 2048 int32 words, 8 codes each
SCALES_PER_STEP = TILE_ROWS * STEP_K // 32    # 512 bytes: 64 rows x 8 groups of 32 columns
_ROWS, _STEP, _WORDS, _SCALES = (tl.constexpr(v) for v in (TILE_ROWS, STEP_K, WORDS_PER_STEP, SCALES_PER_STEP))
# source bit of each magnitude bit (0, 1, 2) and of the sign, per pair p0..p3, in the low half of a word
_MAGNITUDE_BITS = ((6, 7, 8), (3, 4, 5), (0, 1, 2), (10, 11, 13))
_SIGN_BITS = (15, 12, 9, 14)


class FragmentWeights(NamedTuple):
    """One expert weight set in fragment order (`pack_fragments`)."""
    words: torch.Tensor            # int32 [E, N / 64, K / 256, 2048]
    scales: torch.Tensor           # uint8 [E, N / 64, K / 256, 512]
    num_rows: int                  # N before padding (for gate/up: 2 I, gate rows then up rows)
    num_k: int                     # K before padding


def _pad_to(t: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    extra = -t.shape[dim] % multiple
    if not extra:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [0, extra]
    return torch.nn.functional.pad(t, pad)


def stacked_rows(inter_dim: int) -> torch.Tensor:
    """The W13 row of each packed row for gate/up: per 32 columns of I, their 32 gate rows then their 32 up rows
    (I a multiple of 32)."""
    cols = torch.arange(inter_dim).view(-1, 1, 32)                              # [I / 32, 1, 32]
    return torch.cat([cols, cols + inter_dim], dim=1).reshape(-1)              # [2 I]


def pack_fragments(packed: torch.Tensor, scale: torch.Tensor, row_order: torch.Tensor | None = None) -> FragmentWeights:
    """Checkpoint-order MXFP4 ([E, N, K/2] codes, [E, N, K/32] scales) -> fragment order, on the tensors' device.
    `row_order`: the source row of each packed row (`stacked_rows` for gate/up), else the rows as they are."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8 or packed.dim() != 3:
        raise TypeError(f"pack_fragments takes uint8 [E, N, K/2] codes and [E, N, K/32] scales, got "
                        f"{packed.dtype} {tuple(packed.shape)} and {scale.dtype} {tuple(scale.shape)}")
    experts, num_rows, half_k = packed.shape
    num_k = 2 * half_k
    if scale.shape != (experts, num_rows, num_k // 32):
        raise ValueError(f"pack_fragments: scale {tuple(scale.shape)} does not match codes {tuple(packed.shape)}")
    if row_order is not None:
        packed, scale = packed[:, row_order.to(packed.device)], scale[:, row_order.to(scale.device)]
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)        # [E, N, K] uint8, k order
    codes = _pad_to(_pad_to(codes, 1, TILE_ROWS), 2, STEP_K).to(torch.int32)
    tiles, steps = codes.shape[1] // TILE_ROWS, codes.shape[2] // STEP_K
    # [E, T, w, jr, g, S, kb, s, jh, t, P] -> [E, T, S, kb, w, g, t, s, jh, jr, P]
    codes = codes.view(experts, tiles, 4, 2, 8, steps, 4, 4, 2, 4, 2).permute(0, 1, 5, 6, 2, 4, 9, 7, 8, 3, 10)
    word = torch.zeros(codes.shape[:-3], dtype=torch.int32, device=codes.device)
    for pair in range(4):                               # p = 2 jh + jr
        for half in range(2):
            code = codes[..., pair // 2, pair % 2, half]
            for bit, position in enumerate(_MAGNITUDE_BITS[pair]):
                word |= ((code >> bit) & 1) << (position + 16 * half)
            word |= ((code >> 3) & 1) << (_SIGN_BITS[pair] + 16 * half)
    scales = _pad_to(_pad_to(scale, 1, TILE_ROWS), 2, STEP_K // 32)            # [E, N', K' / 32]
    # [E, T, w, jr, g, S, group] -> [E, T, S, w, g, jr, group]
    scales = scales.view(experts, tiles, 4, 2, 8, steps, 8).permute(0, 1, 5, 2, 4, 3, 6)
    return FragmentWeights(word.reshape(experts, tiles, steps, WORDS_PER_STEP).contiguous(),
                           scales.reshape(experts, tiles, steps, SCALES_PER_STEP).contiguous(), num_rows, num_k)


def unpack_fragments(weights: FragmentWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `pack_fragments` without a row order: checkpoint-order codes and scales (tests)."""
    words, scales = weights.words, weights.scales
    experts, tiles, steps, _ = words.shape
    word = words.view(experts, tiles, steps, 4, 4, 8, 4, 4)
    codes = torch.zeros(*word.shape, 2, 2, 2, dtype=torch.int32, device=words.device)   # [..., jh, jr, P]
    for pair in range(4):
        for half in range(2):
            code = torch.zeros_like(word)
            for bit, position in enumerate(_MAGNITUDE_BITS[pair]):
                code |= ((word >> (position + 16 * half)) & 1) << bit
            code |= ((word >> (_SIGN_BITS[pair] + 16 * half)) & 1) << 3
            codes[..., pair // 2, pair % 2, half] = code
    # [E, T, S, kb, w, g, t, s, jh, jr, P] -> [E, T, w, jr, g, S, kb, s, jh, t, P]
    codes = codes.permute(0, 1, 4, 9, 5, 2, 3, 7, 8, 6, 10).reshape(experts, tiles * TILE_ROWS, steps * STEP_K)
    codes = codes[:, :weights.num_rows, :weights.num_k].to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scale = scales.view(experts, tiles, steps, 4, 8, 2, 8).permute(0, 1, 3, 5, 4, 2, 6)
    scale = scale.reshape(experts, tiles * TILE_ROWS, steps * 8)[:, :weights.num_rows, :weights.num_k // 32]
    return packed.contiguous(), scale.contiguous()


# One word -> its four bf16 pairs p0..p3 as int32 bit patterns of code * 2^-126 (module docstring's bit plan).
_WORD_DECODE = tl.constexpr("""{
.reg .b32 t, u;
and.b32 $0, $4, 0x81C081C0;
shl.b32 t, $4, 3;  and.b32 $1, t, 0x81C081C0;
shl.b32 t, $4, 6;  and.b32 $2, t, 0x81C081C0;
shl.b32 t, $4, 1;  and.b32 t, t, 0x80008000;
shr.b32 u, $4, 4;  and.b32 u, u, 0x00C000C0;  or.b32 t, t, u;
shr.b32 u, $4, 5;  and.b32 u, u, 0x01000100;  or.b32 $3, t, u;
}""")
_BF16X2_MUL = tl.constexpr("mul.rn.bf16x2 $0, $1, $2;")


@triton.jit
def decode_word(word, ASM: tl.constexpr):
    """int32 words -> the int32 bit patterns of their four bf16 pairs (code * 2^-126 each): PTX on NVIDIA
    (ASM), else the same bits with Triton integer ops."""
    if ASM:
        return tl.inline_asm_elementwise(_WORD_DECODE, "=r,=r,=r,=r,r", [word],
                                         dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    mask = 0x81C081C0 - (1 << 32)                       # as int32 (Triton's literals must fit the type)
    signs = 0x80008000 - (1 << 32)
    p3 = ((word << 1) & signs) | ((word >> 4) & 0x00C000C0) | ((word >> 5) & 0x01000100)
    return word & mask, (word << 3) & mask, (word << 6) & mask, p3


@triton.jit
def _pair_values(bits, ASM: tl.constexpr):
    """int32 bf16-pair bits -> [..., 2] values (first column, second): bf16 on NVIDIA (ASM), else float32 (the
    interpreter's bf16 is unreliable; a bf16 pattern shifted to the top of a float32 is the same number)."""
    if ASM:
        low = (bits & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
        high = (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        low = (bits << 16).to(tl.float32, bitcast=True)
        high = (bits & -65536).to(tl.float32, bitcast=True)
    return tl.join(low, high)


@triton.jit
def fragment_tile(words_ptr, scales_ptr, step, DTYPE: tl.constexpr, ASM: tl.constexpr, SCALE_FOLD: tl.constexpr):
    """The [64, 256] weight tile of K step `step` of the 64-row tile whose words and scales start at `words_ptr` /
    `scales_ptr`, decoded and scaled in DTYPE. The index arithmetic is the layout (module docstring); the join /
    permute / reshape chain maps each thread's loaded words onto the wgmma A fragment they feed, so Triton leaves no
    layout conversion between them (offline sm_90: four 16-byte shared-memory loads a step, no byte gathering)."""
    kb = tl.arange(0, 4)[:, None, None, None, None]
    w = tl.arange(0, 4)[None, :, None, None, None]
    g = tl.arange(0, 8)[None, None, :, None, None]
    t = tl.arange(0, 4)[None, None, None, :, None]
    s = tl.arange(0, 4)[None, None, None, None, :]
    word = tl.load(words_ptr + step * _WORDS + (((kb * 4 + w) * 8 + g) * 4 + t) * 4 + s)   # [4, 4, 8, 4, 4]
    p0, p1, p2, p3 = decode_word(word, ASM)
    # [kb, w, g, t, s, P, jr, jh] -> [w, jr, g, kb, s, jh, t, P]: row 16w + 8jr + g, column 64kb + 16s + 8jh + 2t + P
    tile = tl.join(tl.join(_pair_values(p0, ASM), _pair_values(p1, ASM)),
                   tl.join(_pair_values(p2, ASM), _pair_values(p3, ASM)))
    tile = tl.reshape(tl.permute(tile, (1, 6, 2, 0, 4, 7, 3, 5)), (_ROWS, _STEP))
    sw = tl.arange(0, 4)[:, None, None, None]
    sg = tl.arange(0, 8)[None, :, None, None]
    sj = tl.arange(0, 2)[None, None, :, None]
    group = tl.arange(0, 8)[None, None, None, :]
    byte = tl.load(scales_ptr + step * _SCALES + ((sw * 8 + sg) * 2 + sj) * 8 + group).to(tl.int32)
    byte = tl.reshape(tl.permute(byte, (0, 2, 1, 3)), (_ROWS, _STEP // 32))    # [rows, groups]
    return _scaled(tile, byte, DTYPE, ASM, SCALE_FOLD)


@triton.jit
def _scaled(tile, byte, DTYPE: tl.constexpr, ASM: tl.constexpr, SCALE_FOLD: tl.constexpr):
    """code * 2^-126 tiles [R, 256] times 2^126 x their E8M0 scales (bytes [R, 8], one per 32 columns), in DTYPE."""
    ROWS: tl.constexpr = tile.shape[0]
    if ASM:
        if SCALE_FOLD:
            bits = _e8m0_bf16_folded_bits(byte)                                     # 2^126 x the scale
        else:
            bits = _e8m0_bf16_bits(byte)
        scale = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
        scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (ROWS, 8, 32)), (ROWS, 256))
        if not SCALE_FOLD:
            tile = tl.inline_asm_elementwise(_BF16X2_MUL, "=r,r,r", [tile, tl.full(tile.shape, 2.0 ** 126, tl.bfloat16)],
                                             dtype=tl.bfloat16, is_pure=True, pack=2)
        return tl.inline_asm_elementwise(_BF16X2_MUL, "=r,r,r", [tile, scale], dtype=tl.bfloat16, is_pure=True,
                                         pack=2)
    exponent = tl.minimum(byte, 254)
    scale = tl.where(exponent == 0, 0x00400000, exponent << 23).to(tl.float32, bitcast=True)   # 2^(byte - 127)
    scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (ROWS, 8, 32)), (ROWS, 256))
    return (tile * 8.507059173023462e37 * scale).to(DTYPE)                         # x 2^126 (exact) x the scale


@triton.jit
def _gate_up_fragment_kernel(x_ptr, words_ptr, scales_ptr, hidden_ptr, sorted_pairs_ptr, block_experts_ptr,
                             x_row_stride, words_expert_stride, scales_expert_stride, hidden_row_stride, num_pairs,
                             num_experts, hidden_dim, inter_dim, beta, linear_beta, TOP_K: tl.constexpr,
                             IS_SITU: tl.constexpr, HAS_LINEAR_CLIP: tl.constexpr, BLOCK_M: tl.constexpr,
                             EVEN_K: tl.constexpr, ASM: tl.constexpr, SCALE_FOLD: tl.constexpr):
    """One (row block, 64-row stacked tile = 32 columns of I): gate^T and up^T [32, rows] from one dot a K step,
    the GLU in float32, stored in x's dtype at the sorted rows."""
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert >= num_experts:
        return
    tile = tl.program_id(1)
    steps = tl.cdiv(hidden_dim, _STEP)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    row_mask = pairs < num_pairs                                        # padding rows hold num_pairs
    x_rows = x_ptr + (pairs // TOP_K).to(tl.int64) * x_row_stride                   # [BLOCK_M] row starts
    words = words_ptr + expert.to(tl.int64) * words_expert_stride + tile * steps * _WORDS
    scales = scales_ptr + expert.to(tl.int64) * scales_expert_stride + tile * steps * _SCALES
    acc = tl.zeros((_ROWS, BLOCK_M), tl.float32)
    for step in range(0, steps):
        x_t = _rows_k(x_rows, row_mask, step * _STEP, hidden_dim, _STEP, EVEN_K)        # [256, BLOCK_M]
        w = fragment_tile(words, scales, step, x_ptr.dtype.element_ty, ASM, SCALE_FOLD)  # [64, 256]
        acc = tl.dot(w, x_t, acc, input_precision="ieee")
    gate, up = tl.split(tl.permute(tl.reshape(acc, (2, _ROWS // 2, BLOCK_M)), (1, 2, 0)))   # [32, BLOCK_M] each
    cols = tile * (_ROWS // 2) + tl.arange(0, _ROWS // 2)
    hidden = glu_f32(gate, up, IS_SITU, HAS_LINEAR_CLIP, beta, linear_beta)
    tl.store(hidden_ptr + rows[None, :].to(tl.int64) * hidden_row_stride + cols[:, None],
             hidden.to(hidden_ptr.dtype.element_ty), mask=(cols < inter_dim)[:, None] & row_mask[None, :])


@triton.jit
def _down_fragment_kernel(hidden_ptr, words_ptr, scales_ptr, rows_out_ptr, sorted_pairs_ptr, block_experts_ptr,
                          hidden_row_stride, words_expert_stride, scales_expert_stride, rows_out_row_stride,
                          num_pairs, num_experts, hidden_dim, inter_dim, BLOCK_M: tl.constexpr,
                          EVEN_K: tl.constexpr, ASM: tl.constexpr, SCALE_FOLD: tl.constexpr):
    """One (row block, 64 output columns of D): (W2 hidden^T) [64, rows] over I, stored in float32 at the sorted
    rows. The grid is one axis, column tiles fastest (a row block's programs share its hidden rows in L2)."""
    col_tiles = tl.cdiv(hidden_dim, _ROWS)
    block = tl.program_id(0) // col_tiles
    tile = tl.program_id(0) % col_tiles
    expert = tl.load(block_experts_ptr + block)
    if expert >= num_experts:
        return
    steps = tl.cdiv(inter_dim, _STEP)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = tl.load(sorted_pairs_ptr + rows) < num_pairs
    h_rows = hidden_ptr + rows.to(tl.int64) * hidden_row_stride
    words = words_ptr + expert.to(tl.int64) * words_expert_stride + tile * steps * _WORDS
    scales = scales_ptr + expert.to(tl.int64) * scales_expert_stride + tile * steps * _SCALES
    acc = tl.zeros((_ROWS, BLOCK_M), tl.float32)
    for step in range(0, steps):
        h_t = _rows_k(h_rows, row_mask, step * _STEP, inter_dim, _STEP, EVEN_K)          # [256, BLOCK_M]
        w = fragment_tile(words, scales, step, hidden_ptr.dtype.element_ty, ASM, SCALE_FOLD)
        acc = tl.dot(w, h_t, acc, input_precision="ieee")
    cols = tile * _ROWS + tl.arange(0, _ROWS)
    tl.store(rows_out_ptr + rows[None, :].to(tl.int64) * rows_out_row_stride + cols[:, None], acc,
             mask=(cols < hidden_dim)[:, None] & row_mask[None, :])


class FragmentTile(NamedTuple):
    """Launch shape of the fragment-order kernels: token rows per block, pipeline stages, register cap (0: none).
    The weight tile is fixed by the layout: 64 rows x 256 columns a K step, 4 warps (one warpgroup)."""
    block_m: int = 16
    num_stages: int = 3
    maxnreg: int = 0


def pack_expert_weights(w13_packed: torch.Tensor, w13_scale: torch.Tensor, w2_packed: torch.Tensor,
                        w2_scale: torch.Tensor) -> tuple[FragmentWeights, FragmentWeights]:
    """Both expert GEMMs' weights in fragment order: gate/up stacked per 32 columns of I, down as it is."""
    inter_dim = w13_packed.shape[1] // 2
    return (pack_fragments(w13_packed, w13_scale, stacked_rows(inter_dim)), pack_fragments(w2_packed, w2_scale))


def moe_experts_fragments(x: torch.Tensor, w13: FragmentWeights, w2: FragmentWeights, weights: torch.Tensor,
                          expert_ids: torch.Tensor, activation: str, situ_beta: float | None,
                          situ_linear_beta: float | None, expert_offset: int = 0, *, max_scale: int | None = None,
                          tile: FragmentTile = FragmentTile()) -> torch.Tensor:
    """`moe_experts_mxfp4` on weights in fragment order (`pack_expert_weights`): [T, D] in x's dtype."""
    from kernels.triton.activation import check_activation
    from kernels.triton.moe_blocks import group_pairs_by_expert
    from kernels.triton.moe_experts import combine_expert_rows
    from kernels.triton.moe_mxfp4 import scale_fold
    from kernels.triton.tuning_ops import target
    check_activation(activation, situ_beta)
    fold = scale_fold(max_scale)
    num_experts, hidden_dim, inter_dim = w13.words.shape[0], w2.num_rows, w2.num_k
    if w13.num_rows != 2 * inter_dim or w13.num_k != hidden_dim or x.shape[-1] != hidden_dim:
        raise ValueError(f"moe_experts_fragments: gate/up is {w13.num_rows} x {w13.num_k}, down {w2.num_rows} x "
                         f"{w2.num_k}, x {tuple(x.shape)}: expected 2I x D, D x I and [T, D]")
    where = target(x.device)
    asm = where == "nvidia" and x.dtype == torch.bfloat16
    if where == "nvidia" and not asm:
        raise ValueError(f"moe_experts_fragments: the NVIDIA path decodes to bf16; got {x.dtype} activations")
    options = dict(num_warps=4, num_stages=tile.num_stages)
    if tile.maxnreg and where == "nvidia":
        options["maxnreg"] = tile.maxnreg
    x = x.contiguous()
    num_tokens = x.shape[0]
    out = torch.empty(num_tokens, hidden_dim, dtype=x.dtype, device=x.device)
    if num_tokens == 0 or expert_ids.shape[1] == 0:
        return out.zero_()
    top_k = expert_ids.shape[1]
    expert_ids = expert_ids.long().contiguous()
    blocks = group_pairs_by_expert(expert_ids, expert_offset, num_experts, tile.block_m)
    num_blocks = blocks.block_experts.numel()
    hidden = torch.empty(num_blocks * tile.block_m, inter_dim, dtype=x.dtype, device=x.device)
    _gate_up_fragment_kernel[(num_blocks, triton.cdiv(inter_dim, TILE_ROWS // 2))](
        x, w13.words, w13.scales, hidden, blocks.sorted_pairs, blocks.block_experts, x.stride(0),
        w13.words.stride(0), w13.scales.stride(0), hidden.stride(0), blocks.row_of_pair.numel(), num_experts,
        hidden_dim, inter_dim, float(situ_beta if situ_beta is not None else 1.0),
        float(situ_linear_beta) if situ_linear_beta is not None else 1.0, TOP_K=top_k,
        IS_SITU=activation == "situ", HAS_LINEAR_CLIP=situ_linear_beta is not None, BLOCK_M=tile.block_m,
        EVEN_K=hidden_dim % STEP_K == 0, ASM=asm, SCALE_FOLD=fold, **options)
    rows_out = torch.empty(num_blocks * tile.block_m, hidden_dim, dtype=torch.float32, device=x.device)
    _down_fragment_kernel[(num_blocks * triton.cdiv(hidden_dim, TILE_ROWS),)](
        hidden, w2.words, w2.scales, rows_out, blocks.sorted_pairs, blocks.block_experts, hidden.stride(0),
        w2.words.stride(0), w2.scales.stride(0), rows_out.stride(0), blocks.row_of_pair.numel(), num_experts,
        hidden_dim, inter_dim, BLOCK_M=tile.block_m, EVEN_K=inter_dim % STEP_K == 0, ASM=asm, SCALE_FOLD=fold,
        **options)
    combine_expert_rows(rows_out, blocks.row_of_pair, weights, expert_ids, expert_offset, num_experts, out)
    return out
