"""The operands of the Gluon MXFP4 decode kernels (`kernels.triton.moe_mxfp4_gluon`): how the packed weight
bytes and x reach mma.sync's registers, the kernels' K order, the four-byte decode, and the column order of x
and the expert hidden.

How the operands reach the MMA without a gather. A thread of an m16n8k16 MMA holds, of each 16-column slab of the
A operand, columns 2t, 2t+1, 2t+8, 2t+9 of rows g and g+8 (lane = 4g + t), and of B the same K positions of token
column g. The sum over K is order-free, so the kernel uses its own K order: dot position kappa = 16s + 8h + 2t + p
(slab s, half h, pair element p) is weight byte j = 32t + 4s + 2h + p of the step's 128 bytes (the low nibbles
give the even columns' dot, the high nibbles the odd columns', as in the swap kernels), and x column j of the
step's presplit even (or odd) half (`moe_mxfp4.presplit_columns`). Each thread then loads 32 consecutive weight
bytes of each of its two rows (two 16-byte loads) and 32 consecutive x values of its token (four), and the
reshape / permute `_kappa_rows` / `_kappa_cols` maps them onto the MMA's operand layouts with no data movement
(`convert_layout(..., assert_trivial=True)` checks it at compile time). A thread's 32 bytes of a row are two
scale groups (16 bytes = 32 columns each).

Decode: four bytes per PTX call (`_QUAD_DECODE`): one byte permute and one shift, then per pair of codes a mask, a
multiply that places the nibble's sign and magnitude bits at once, and a mask (bf16 code * 2^-126, exact, as
`moe_mxfp4_operands._pair_decode_ptx`), and one bf16x2 multiply by 2^126 x the scale (SCALE_FOLD) or two: 18
instructions for 8 codes, against 20 in the two-permute form it replaced.

Tried and not kept (3322492, reverted): pairing bytes (0, 2) and (1, 3) of a word, as its 16-bit lanes already
hold them, drops the byte permute (17 instructions for 8 codes) if x and hidden are stored with columns 4a + 2p + h
at 4a + 2h + p to match. Offline sm_90 the K loop went 362 -> 344 (1 token) and, with the decode tile capped at 80
registers to avoid a spill, 352 -> 337 (16 tokens); on an H100 the calls at 1-32 tokens were unchanged (within
0.3%, two calls), so the H100 decode tiles are not bound by these instructions. Not measured on an H200.

Layout options for the 32-64-token L1 pressure (tile fields coalesced_x, coalesced_w; on an H100 at 2365f32 they
lost to the swap tile at 64 tokens, 2.13-2.74x the bf16 experts against 3.03x, and are in no default tile): a
quarter warp's x load touches four 16-byte pieces 64 bytes apart of each of two tokens (16 cache lines a warp for
512 bytes), its weight load four pieces 32 bytes apart of each of two rows. coalesced_x
stores x and hidden so that the four threads of a token read 64 contiguous bytes (`gluon_columns`, `_x_layout`);
coalesced_w (with coalesced_x) gives each thread weight bytes 16t.. and 64 + 16t.. instead of 32t.. (a row's 64
contiguous bytes a quarter warp; K order and scales follow). Neither changes a product.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from kernels.triton.moe_mxfp4 import presplit_columns

STEP_BYTES: gl.constexpr = gl.constexpr(128)     # a K step is 256 columns: 128 bytes of a row


def gluon_columns(t: torch.Tensor, coalesced_x: bool, coalesced_w: bool) -> torch.Tensor:
    """[R, K] -> [R, K] in the order the kernels read x and hidden (K a multiple of 256): each 256 columns as [the
    even ones | the odd ones] (`moe_mxfp4.presplit_columns`) and, `coalesced_x` (a tile's), within each half
    column j = 32t + 8c + r at 32c + 8t + r, or with `coalesced_w` j = 64q + 16t + 8h + r at 64q + 32h + 8t + r
    (`_x_layout`). One copy through a permuted view (no index tensor: the decode-sized calls run inside CUDA
    graphs)."""
    rows, num_k = t.shape
    if num_k % 256:
        raise ValueError(f"gluon_columns: K must be a multiple of 256, got {num_k}")
    if not coalesced_x:
        return presplit_columns(t, 256)
    if coalesced_w:
        split = t.reshape(rows, num_k // 256, 2, 4, 2, 8, 2)         # column 2j + odd, j = 64q + 16t + 8h + r
        return split.permute(0, 1, 6, 2, 4, 3, 5).reshape(rows, num_k)  # [R, step, odd, q, h, t, r]
    split = t.reshape(rows, num_k // 256, 4, 4, 8, 2)                # column 2j + odd, j = 32t + 8c + r
    return split.permute(0, 1, 5, 3, 2, 4).reshape(rows, num_k)      # [R, step, odd, c, t, r]


def _quad_decode_ptx(fold: bool) -> str:
    """Four packed bytes ($4) and the bf16x2 scales of bytes (0, 1) ($5) and (2, 3) ($6) -> the low-nibble codes of
    bytes (0, 1) ($0) and (2, 3) ($1), the high-nibble codes of (0, 1) ($2) and (2, 3) ($3), as bf16 pairs times
    the scale. The bits land as in `moe_mxfp4_operands._pair_decode_ptx` (sign at bit 15, the three magnitude bits
    at 8..6: bf16 code * 2^-126). One byte permute puts bytes 0 and 1 in the low byte of the two 16-bit lanes and
    bytes 2 and 3 above them; a nibble n of each lane, masked alone, goes to both places with one multiply, n * 2^6
    + n * 2^12 (low nibble) or n * 2^2 + n * 2^8 (high nibble: the nibble sits 4 bits up), whose two terms share
    no bit, and a mask keeps bits 15 and 8..6. A shift by 8 brings bytes 2 and 3 down for the second pair."""
    def times(out: str, scale: str) -> str:
        if fold:
            return f"mul.rn.bf16x2 {out}, a, {scale};"
        return f"mul.rn.bf16x2 a, a, c126;  mul.rn.bf16x2 {out}, a, {scale};"

    def nibble(word: str, mask: str, spread: str, out: str, scale: str) -> str:
        return (f"and.b32 a, {word}, {mask};  mul.lo.u32 a, a, {spread};  and.b32 a, a, 0x81C081C0;  "
                + times(out, scale))
    lines = ["{", ".reg .b32 w, v, a, c126;", "mov.b32 c126, 0x7E807E80;",
             "prmt.b32 w, $4, 0, 0x3120;",            # bytes (0, 2, 1, 3): lanes b0 | b2 << 8 and b1 | b3 << 8
             "shr.b32 v, w, 8;"]                      # the lanes' low bytes: b2 and b3
    for word, out_low, out_high, scale in (("w", "$0", "$2", "$5"), ("v", "$1", "$3", "$6")):
        lines += [nibble(word, "0x000F000F", "0x1040", out_low, scale),
                  nibble(word, "0x00F000F0", "0x104", out_high, scale)]
    return "\n".join(lines + ["}"])


_QUAD_DECODE = gl.constexpr(_quad_decode_ptx(fold=False))
_QUAD_DECODE_FOLDED = gl.constexpr(_quad_decode_ptx(fold=True))


@gluon.constexpr_function
def _flat_layout():
    return gl.BlockedLayout([1], [32], [4], [0])


@gluon.constexpr_function
def _mma_layout():
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8])


@gluon.constexpr_function
def _bytes_layout(rows, coalesced_w):
    """[rows (64 or 128), 128 bytes]: thread 4g + t of warp w holds rows 16w + g and + 8 (and those + 64 at 128
    rows: a second m16 tile against the same x), in two 16-byte pieces: plain bytes 32t..32t+31 (a quarter
    warp's load: four pieces 32 bytes apart of each of two rows), COALESCED_W bytes 16t..16t+15 and 64 + 16t..
    (64 contiguous bytes of each row)."""
    second_tile = [[64, 0]] if rows == 128 else []
    if coalesced_w:
        return gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [0, 64], [8, 0]] + second_tile,
                                          lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]],
                                          warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[rows, 128])
    return gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [0, 16], [8, 0]] + second_tile,
                                      lane_bases=[[0, 32], [0, 64], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[rows, 128])


@gluon.constexpr_function
def _scale_layout(rows, coalesced_w):
    """[rows, 8 groups, 16 bytes]: the scale of each byte of `_bytes_layout(rows, coalesced_w)`, held where that
    byte is (groups 2t and 2t + 1, or t and 4 + t)."""
    second_tile = [[64, 0, 0]] if rows == 128 else []
    if coalesced_w:
        return gl.DistributedLinearLayout(reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 4, 0],
                                                     [8, 0, 0]] + second_tile,
                                          lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
                                          warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[rows, 8, 16])
    return gl.DistributedLinearLayout(reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 1, 0], [8, 0, 0]]
                                      + second_tile,
                                      lane_bases=[[0, 2, 0], [0, 4, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
                                      warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[rows, 8, 16])


@gluon.constexpr_function
def _operand_layout(index):
    return gl.DotOperandLayout(operand_index=index, parent=_mma_layout(), k_width=2)


@gluon.constexpr_function
def _slice(dim, layout):
    return gl.SliceLayout(dim, layout)


@gluon.constexpr_function
def _x_layout(block_m, coalesced_x, coalesced_w):
    """[128 stored columns of a presplit half, BLOCK_M tokens] as loaded: thread 4g + t holds token g (and g + 8 at
    16 tokens) and the 32 columns j of its weight bytes (`_bytes_layout`; the dot positions of `_kappa_cols`),
    in four 16-byte pieces: plain j = 32t + 8c + r, COALESCED_W j = 64q + 16t + 8h + r (piece c = 2q + h).
    Plain x lies in that order, four pieces 16 bytes apart; COALESCED_X (`gluon_columns`) piece c of thread t lies
    at 32c + 8t: the four threads of a token read 64 contiguous bytes a load. Every warp holds the same.
    COALESCED_W comes only with COALESCED_X (`moe_mxfp4_tiles.check_tile`)."""
    tokens = [[0, 8]] if block_m == 16 else []
    if coalesced_x:
        regs, lanes = [[1, 0], [2, 0], [4, 0], [32, 0], [64, 0]], [[8, 0], [16, 0]]
    else:
        regs, lanes = [[1, 0], [2, 0], [4, 0], [8, 0], [16, 0]], [[32, 0], [64, 0]]
    return gl.DistributedLinearLayout(reg_bases=regs + tokens, lane_bases=lanes + [[0, 1], [0, 2], [0, 4]],
                                      warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[128, block_m])


@gluon.jit
def _kappa_rows(tile, WEIGHT_ROWS: gl.constexpr, COALESCED_W: gl.constexpr):
    """[WEIGHT_ROWS, 128] indexed by byte j = 32t + 4s + 2h + p (COALESCED_W: j = 64q + 16t + 4s' + 2h + p with
    s = 4q + s') -> indexed by dot position kappa = 16s + 8h + 2t + p."""
    if COALESCED_W:
        tile = tile.reshape([WEIGHT_ROWS, 2, 4, 4, 2, 2]).permute([0, 1, 3, 4, 2, 5])   # [row, q, s', h, t, p]
    else:
        tile = tile.reshape([WEIGHT_ROWS, 4, 8, 2, 2]).permute([0, 2, 3, 1, 4])         # [row, s, h, t, p]
    return tile.reshape([WEIGHT_ROWS, 128])


@gluon.jit
def _stored_to_column(tile, BLOCK_M: gl.constexpr, COALESCED_W: gl.constexpr):
    """A COALESCED_X x tile [128, BLOCK_M] indexed by stored place -> indexed by column j (`_x_layout`; no data
    movement: thread t holds both): place 32c + 8t + r holds j = 32t + 8c + r, or with COALESCED_W place
    64q + 32h + 8t + r holds j = 64q + 16t + 8h + r."""
    if COALESCED_W:
        tile = tile.reshape([2, 2, 4, 8, BLOCK_M]).permute([0, 2, 1, 3, 4])    # [q, h, t, r, token] -> [q, t, h, r]
    else:
        tile = tile.reshape([4, 4, 8, BLOCK_M]).permute([1, 0, 2, 3])          # [c, t, r, token] -> [t, c, r]
    return tile.reshape([128, BLOCK_M])


@gluon.jit
def _kappa_cols(tile, BLOCK_M: gl.constexpr, COALESCED_W: gl.constexpr):
    """`_kappa_rows` for the x operand [128, BLOCK_M] (K first)."""
    if COALESCED_W:
        tile = tile.reshape([2, 4, 4, 2, 2, BLOCK_M]).permute([0, 2, 3, 1, 4, 5])  # [q, t, s', h, p] -> [q, s', h, t]
    else:
        tile = tile.reshape([4, 8, 2, 2, BLOCK_M]).permute([1, 2, 0, 3, 4])        # [t, s, h, p] -> [s, h, t, p]
    return tile.reshape([128, BLOCK_M])


@gluon.jit
def _quad_decode(byte, scale, WEIGHT_ROWS: gl.constexpr, BYTES: gl.constexpr, bytes_layout: gl.constexpr,
                 SCALE_FOLD: gl.constexpr):
    """Packed bytes [WEIGHT_ROWS, BYTES] in `bytes_layout` and their scale bytes [WEIGHT_ROWS, BYTES / 16, 1] ->
    (low-nibble, high-nibble) bf16 tiles [WEIGHT_ROWS, BYTES] in `bytes_layout` (`_QUAD_DECODE`: the scale
    broadcast to its 16 bytes)."""
    scale = scale.to(gl.int32)
    if SCALE_FOLD:
        bits = (scale + 126) << 7                                  # bf16 2^(byte - 1): 2^126 x the scale
    else:
        bits = gl.minimum(gl.maximum(scale << 7, 0x40), 0x7F00)    # bf16 2^(byte - 127); 0 subnormal, 255 as 254
    scale = bits.to(gl.int16).to(gl.bfloat16, bitcast=True).broadcast_to([WEIGHT_ROWS, BYTES // 16, 16])
    scale = scale.reshape([WEIGHT_ROWS, BYTES])
    scale = gl.convert_layout(scale, bytes_layout)
    if SCALE_FOLD:
        return gl.inline_asm_elementwise(_QUAD_DECODE_FOLDED, "=r,=r,=r,=r,r,r,r", [byte, scale],
                                         dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4)
    return gl.inline_asm_elementwise(_QUAD_DECODE, "=r,=r,=r,=r,r,r,r", [byte, scale],
                                     dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4)


@gluon.jit
def _weight_halves(byte_ptrs, scale_ptrs, step, WEIGHT_ROWS: gl.constexpr, SCALE_FOLD: gl.constexpr,
                   COALESCED_W: gl.constexpr):
    """K step `step` of the WEIGHT_ROWS weight rows: (low-nibble, high-nibble) tiles [WEIGHT_ROWS, 128] in the A operand
    layout."""
    byte = gl.load(byte_ptrs + step * STEP_BYTES)                                          # [WEIGHT_ROWS, 128] uint8
    scale = gl.load(scale_ptrs + step * 8)                                                 # [WEIGHT_ROWS, 8, 1]
    return _decoded_halves(byte, scale, WEIGHT_ROWS, SCALE_FOLD, COALESCED_W)


@gluon.jit
def _decoded_halves(byte, scale, WEIGHT_ROWS: gl.constexpr, SCALE_FOLD: gl.constexpr, COALESCED_W: gl.constexpr):
    """A step's packed bytes [WEIGHT_ROWS, 128] in `_bytes_layout` and their scale bytes [WEIGHT_ROWS, 8, 1] ->
    (low-nibble, high-nibble) tiles [WEIGHT_ROWS, 128] in the A operand layout."""
    low, high = _quad_decode(byte, scale, WEIGHT_ROWS, 128, _bytes_layout(WEIGHT_ROWS, COALESCED_W), SCALE_FOLD)
    return (gl.convert_layout(_kappa_rows(low, WEIGHT_ROWS, COALESCED_W), _operand_layout(0), assert_trivial=True),
            gl.convert_layout(_kappa_rows(high, WEIGHT_ROWS, COALESCED_W), _operand_layout(0), assert_trivial=True))


@gluon.constexpr_function
def _stage_layout(rows):
    """[rows / 16 pieces, 128 threads, 16 bytes]: thread T = 32w + lane holds 16 contiguous bytes of each piece, the
    pieces being its 16-byte loads of `_bytes_layout(rows, ...)` (`_thread_pieces`)."""
    return gl.BlockedLayout([rows // 16, 1, 16], [1, 32, 1], [1, 4, 1], [2, 1, 0])


@gluon.constexpr_function
def _stage_smem_layout():
    """A stage [pieces, 128 threads, 16 bytes] of an allocation [stages, ...], unswizzled: for each piece a warp's
    16-byte copies and reads are 512 contiguous bytes, so neither conflicts."""
    return gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[2, 1, 0])


@gluon.jit
def _thread_pieces(tile, WEIGHT_ROWS: gl.constexpr, COALESCED_W: gl.constexpr):
    """[WEIGHT_ROWS, 128 bytes] as `_bytes_layout` spreads it -> [WEIGHT_ROWS / 16, 128, 16] indexed by (piece,
    thread, byte of the piece), a reshape / permute only. Row 64a2 + 16w + 8a + g, byte 32t + 16b + c (COALESCED_W:
    64b + 16t + c) is held by thread T = 32w + 4g + t as byte c of piece P = 4a2 + 2a + b. Plain reshapes and
    permutes, so that a CPU test can run it on a torch tensor (`.fn`)."""
    if WEIGHT_ROWS == 128:
        if COALESCED_W:
            tile = tile.reshape([2, 4, 2, 8, 2, 4, 16]).permute([0, 2, 4, 1, 3, 5, 6])   # [a2, w, a, g, b, t, c]
        else:
            tile = tile.reshape([2, 4, 2, 8, 4, 2, 16]).permute([0, 2, 5, 1, 3, 4, 6])   # [a2, w, a, g, t, b, c]
    else:
        if COALESCED_W:
            tile = tile.reshape([4, 2, 8, 2, 4, 16]).permute([1, 3, 0, 2, 4, 5])         # [w, a, g, b, t, c]
        else:
            tile = tile.reshape([4, 2, 8, 4, 2, 16]).permute([1, 4, 0, 2, 3, 5])         # [w, a, g, t, b, c]
    return tile.reshape([WEIGHT_ROWS // 16, 128, 16])                                    # [(a2,) a, b, w, g, t, c]


@gluon.jit
def _piece_rows(pieces, WEIGHT_ROWS: gl.constexpr, COALESCED_W: gl.constexpr):
    """`_thread_pieces`' inverse: [WEIGHT_ROWS / 16, 128, 16] -> [WEIGHT_ROWS, 128 bytes]."""
    if WEIGHT_ROWS == 128:
        tile = pieces.reshape([2, 2, 2, 4, 8, 4, 16])                                   # [a2, a, b, w, g, t, c]
        if COALESCED_W:
            tile = tile.permute([0, 3, 1, 4, 2, 5, 6])                                  # [a2, w, a, g, b, t, c]
        else:
            tile = tile.permute([0, 3, 1, 4, 5, 2, 6])                                  # [a2, w, a, g, t, b, c]
    else:
        tile = pieces.reshape([2, 2, 4, 8, 4, 16])                                      # [a, b, w, g, t, c]
        if COALESCED_W:
            tile = tile.permute([2, 0, 3, 1, 4, 5])                                     # [w, a, g, b, t, c]
        else:
            tile = tile.permute([2, 0, 3, 4, 1, 5])                                     # [w, a, g, t, b, c]
    return tile.reshape([WEIGHT_ROWS, 128])


@gluon.jit
def _x_halves(x_ptrs, k_start, BLOCK_M: gl.constexpr, COALESCED_X: gl.constexpr, COALESCED_W: gl.constexpr):
    """Presplit x (or hidden) columns [k_start, k_start + 256) of the block's rows (each pointer a real row's:
    `moe_mxfp4_gluon._x_rows`): (even, odd) halves [128, BLOCK_M] in the B operand layout."""
    even = gl.load(x_ptrs + k_start)
    odd = gl.load(x_ptrs + (k_start + 128))
    if COALESCED_X:
        even = _stored_to_column(even, BLOCK_M, COALESCED_W)
        odd = _stored_to_column(odd, BLOCK_M, COALESCED_W)
    return (gl.convert_layout(_kappa_cols(even, BLOCK_M, COALESCED_W), _operand_layout(1), assert_trivial=True),
            gl.convert_layout(_kappa_cols(odd, BLOCK_M, COALESCED_W), _operand_layout(1), assert_trivial=True))


@gluon.jit
def _weight_pointers(packed_ptr, scale_ptr, expert, packed_expert_stride, packed_row_stride, scale_expert_stride,
                     scale_row_stride, w_rows, BYTES: gl.constexpr, bytes_layout: gl.constexpr,
                     scale_layout: gl.constexpr):
    """Byte pointers [rows, BYTES] in `bytes_layout` and scale pointers [rows, BYTES / 16, 1] in `scale_layout` of
    K step 0 of weight rows `w_rows` [rows] (any 1-D layout; converted here)."""
    rows_b = gl.convert_layout(w_rows, _slice(1, bytes_layout))
    cols_b = gl.arange(0, BYTES, layout=_slice(0, bytes_layout))
    byte_ptrs = (packed_ptr + expert.to(gl.int64) * packed_expert_stride
                 + rows_b.to(gl.int64)[:, None] * packed_row_stride + cols_b[None, :])
    rows_s = gl.convert_layout(w_rows, _slice(1, _slice(2, scale_layout)))
    groups = gl.arange(0, BYTES // 16, layout=_slice(0, _slice(2, scale_layout)))
    scale_ptrs = (scale_ptr + expert.to(gl.int64) * scale_expert_stride
                  + rows_s.to(gl.int64)[:, None] * scale_row_stride + groups[None, :])
    return byte_ptrs, gl.expand_dims(scale_ptrs, 2)


@gluon.jit
def _x_pointers(row_starts, BLOCK_M: gl.constexpr, COALESCED_X: gl.constexpr, COALESCED_W: gl.constexpr):
    """Pointers [128, BLOCK_M] to the first 128 stored columns of each of the block's rows (`row_starts`
    [BLOCK_M])."""
    cols = gl.arange(0, 128, layout=_slice(1, _x_layout(BLOCK_M, COALESCED_X, COALESCED_W)))
    starts = gl.convert_layout(row_starts, _slice(0, _x_layout(BLOCK_M, COALESCED_X, COALESCED_W)))
    return starts[None, :] + cols[:, None]
