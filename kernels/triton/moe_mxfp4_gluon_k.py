"""MXFP4 decode-sized expert GEMMs in Gluon with the warps sharing each K step (`Mxfp4Tile.k_warps` 2 or 4), NVIDIA
only: `kernels.triton.moe_mxfp4_gluon`'s decode and MMA, with its operand trick, on another split of the work.

Why. In `moe_mxfp4_gluon` each of the 4 warps owns 16 of the program's 64 weight rows and runs the whole K loop,
so every warp loads the block's x (or hidden) rows for every K step: 4 copies of x through L1 for one copy of the
weights. Nsight Compute on the H200 (bench/results/moe-mxfp4-gluon-k-nvidia-h200.md) had those kernels at 77-84% of
L1 / L2 throughput against 45-67% of DRAM at 32-64 tokens. Here the 4 warps are k_warps parts of each 256-column K
step times 4 / k_warps row groups: a warp holds 16 k_warps rows and a k_warps-th of the step's columns, so x
crosses L1 4 / k_warps times a step instead of 4, and the parts' float32 partial sums are added once at the end
(through shared memory: 64 x BLOCK_M x 4 bytes a part).

Layout. The MMA is a batched one ([k_warps, rows, K] x [k_warps, K, BLOCK_M], `mma_v2` on a rank-3
NVMMADistributedLayout with the warps over (part, rows)), each batch a part of K. A thread of part q holds
128 / k_warps / 4 consecutive bytes of each of its rows (8 or 16: one scale group, one 8- or 16-byte load) and the
matching presplit x columns of its token; the dot positions inside a part are ordered as in `moe_mxfp4_gluon`
(byte j = per t + 4s + 2h + p is dot position 16s + 8h + 2t + p), so the operands again reach the MMA's registers
with no data movement (`convert_layout(..., assert_trivial=True)`). Row offsets are int32 (with one int64 expert
base): ptxas then forms each load's address from one add; `_check_gluon` refuses weights whose offsets would not
fit. Scope as `moe_mxfp4_gluon`: bf16 x, K and I multiples of 256, 4 warps, BLOCK_M 8 or 16; never interpreted.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from kernels.triton.activation import glu_f32
from kernels.triton.moe_mxfp4_gluon import _QUAD_DECODE, _QUAD_DECODE_FOLDED, STEP_BYTES, _glu_layout, _slice


@gluon.constexpr_function
def _log2(n):
    return n.bit_length() - 1


@gluon.constexpr_function
def _row_regs(k_warps):
    """Row offsets a thread holds in registers: 8 (the MMA's rows g and g + 8), then its warp's further 16-row
    tiles, past the row warps' (the order of the MMA operand layout)."""
    return [8] + [(16 << (2 - _log2(k_warps))) << m for m in range(_log2(k_warps))]


@gluon.constexpr_function
def _row_warps(k_warps):
    return [16 << b for b in range(2 - _log2(k_warps))]


@gluon.constexpr_function
def _mma(k_warps):
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[k_warps, 4 // k_warps, 1], instr_shape=[1, 16, 8])


@gluon.constexpr_function
def _operand(index, k_warps):
    return gl.DotOperandLayout(operand_index=index, parent=_mma(k_warps), k_width=2)


@gluon.constexpr_function
def _bytes_layout(k_warps):
    """[k_warps parts, 64 rows, 128 / k_warps bytes of a part]: thread 4g + t of a warp holds rows g + `_row_regs`
    of its row group, bytes per t .. per t + per - 1 of its part (per = 32 / k_warps)."""
    per = 32 // k_warps
    regs = [[0, 0, 1 << b] for b in range(_log2(per))] + [[0, r, 0] for r in _row_regs(k_warps)]
    lanes = [[0, 0, per], [0, 0, 2 * per], [0, 1, 0], [0, 2, 0], [0, 4, 0]]
    warps = [[0, r, 0] for r in _row_warps(k_warps)] + [[1 << b, 0, 0] for b in range(_log2(k_warps))]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=lanes, warp_bases=warps, block_bases=[],
                                      shape=[k_warps, 64, 128 // k_warps])


@gluon.constexpr_function
def _scale_layout(k_warps):
    """[k_warps, 64, 8 / k_warps scale groups of a part, 16 bytes]: each byte's scale where `_bytes_layout` has it."""
    per = 32 // k_warps
    regs = [[0, 0, 0, 1 << b] for b in range(_log2(per))] + [[0, r, 0, 0] for r in _row_regs(k_warps)]
    lanes = [[0, 0, (per << b) // 16, (per << b) % 16] for b in range(2)] + [[0, 1, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0]]
    warps = [[0, r, 0, 0] for r in _row_warps(k_warps)] + [[1 << b, 0, 0, 0] for b in range(_log2(k_warps))]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=lanes, warp_bases=warps, block_bases=[],
                                      shape=[k_warps, 64, 8 // k_warps, 16])


@gluon.constexpr_function
def _scale_rows_layout(k_warps):
    return gl.SliceLayout(3, _scale_layout(k_warps))


@gluon.constexpr_function
def _x_layout(block_m, k_warps):
    """[k_warps, 64 / k_warps columns of a presplit half, BLOCK_M tokens]: the x (or hidden) columns of
    `_bytes_layout`'s bytes for token g (and g + 8 at 16 tokens); the row warps of a part hold the same."""
    per = 32 // k_warps
    regs = [[0, 1 << b, 0] for b in range(_log2(per))] + ([[0, 0, 8]] if block_m == 16 else [])
    lanes = [[0, per, 0], [0, 2 * per, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]]
    warps = [[0, 0, 0] for _ in _row_warps(k_warps)] + [[1 << b, 0, 0] for b in range(_log2(k_warps))]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=lanes, warp_bases=warps, block_bases=[],
                                      shape=[k_warps, 128 // k_warps, block_m])


@gluon.constexpr_function
def _axis(keep, layout):
    """The 1-D slice of a rank-3 layout along dim `keep`."""
    if keep == 0:
        return gl.SliceLayout(1, gl.SliceLayout(2, layout))
    if keep == 1:
        return gl.SliceLayout(0, gl.SliceLayout(2, layout))
    return gl.SliceLayout(0, gl.SliceLayout(1, layout))


@gluon.jit
def _kappa_rows(tile, K_WARPS: gl.constexpr):
    """[parts, 64, bytes of a part] by byte j = per t + 4s + 2h + p -> by dot position 16s + 8h + 2t + p."""
    SLABS: gl.constexpr = 8 // K_WARPS
    tile = tile.reshape([K_WARPS, 64, 4, SLABS, 2, 2])                  # [part, row, t, s, h, p]
    return tile.permute([0, 1, 3, 4, 2, 5]).reshape([K_WARPS, 64, 128 // K_WARPS])


@gluon.jit
def _kappa_cols(tile, BLOCK_M: gl.constexpr, K_WARPS: gl.constexpr):
    """`_kappa_rows` for the x operand [parts, columns of a part, BLOCK_M]."""
    SLABS: gl.constexpr = 8 // K_WARPS
    tile = tile.reshape([K_WARPS, 4, SLABS, 2, 2, BLOCK_M])             # [part, t, s, h, p, token]
    return tile.permute([0, 2, 3, 1, 4, 5]).reshape([K_WARPS, 128 // K_WARPS, BLOCK_M])


@gluon.jit
def _weight_pointers(packed_ptr, scale_ptr, expert, packed_expert_stride, packed_row_stride, scale_expert_stride,
                     scale_row_stride, w_rows, K_WARPS: gl.constexpr):
    """K step 0's byte pointers [parts, 64, bytes of a part] and scale pointers [parts, 64, groups, 1] of weight
    rows `w_rows` [64] (any 1-D layout), with int32 offsets from the expert's int64 base."""
    part = gl.arange(0, K_WARPS, layout=_axis(0, _bytes_layout(K_WARPS)))
    rows = gl.convert_layout(w_rows, _axis(1, _bytes_layout(K_WARPS)))
    byte = gl.arange(0, 128 // K_WARPS, layout=_axis(2, _bytes_layout(K_WARPS)))
    byte_ptrs = (packed_ptr + expert.to(gl.int64) * packed_expert_stride
                 + ((rows * packed_row_stride)[None, :, None] + (part * (128 // K_WARPS))[:, None, None]
                    + byte[None, None, :]))
    part_s = gl.arange(0, K_WARPS, layout=_axis(0, _scale_rows_layout(K_WARPS)))
    rows_s = gl.convert_layout(w_rows, _axis(1, _scale_rows_layout(K_WARPS)))
    group = gl.arange(0, 8 // K_WARPS, layout=_axis(2, _scale_rows_layout(K_WARPS)))
    scale_ptrs = (scale_ptr + expert.to(gl.int64) * scale_expert_stride
                  + ((rows_s * scale_row_stride)[None, :, None] + (part_s * (8 // K_WARPS))[:, None, None]
                     + group[None, None, :]))
    return byte_ptrs, gl.expand_dims(scale_ptrs, 3)


@gluon.jit
def _weight_halves(byte_ptrs, scale_ptrs, step, SCALE_FOLD: gl.constexpr, K_WARPS: gl.constexpr):
    """K step `step` of the 64 weight rows: (low-nibble, high-nibble) tiles in the A operand layout."""
    byte = gl.load(byte_ptrs + step * STEP_BYTES)
    scale = gl.load(scale_ptrs + step * 8).to(gl.int32)
    if SCALE_FOLD:
        bits = (scale + 126) << 7                                  # bf16 2^(byte - 1): 2^126 x the scale
    else:
        bits = gl.minimum(gl.maximum(scale << 7, 0x40), 0x7F00)    # bf16 2^(byte - 127); 0 subnormal, 255 as 254
    scale = bits.to(gl.int16).to(gl.bfloat16, bitcast=True).broadcast_to([K_WARPS, 64, 8 // K_WARPS, 16])
    scale = gl.convert_layout(scale.reshape([K_WARPS, 64, 128 // K_WARPS]), _bytes_layout(K_WARPS))
    if SCALE_FOLD:
        low, high = gl.inline_asm_elementwise(_QUAD_DECODE_FOLDED, "=r,=r,=r,=r,r,r,r", [byte, scale],
                                              dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4)
    else:
        low, high = gl.inline_asm_elementwise(_QUAD_DECODE, "=r,=r,=r,=r,r,r,r", [byte, scale],
                                              dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4)
    return (gl.convert_layout(_kappa_rows(low, K_WARPS), _operand(0, K_WARPS), assert_trivial=True),
            gl.convert_layout(_kappa_rows(high, K_WARPS), _operand(0, K_WARPS), assert_trivial=True))


@gluon.jit
def _x_pointers(row_starts, BLOCK_M: gl.constexpr, K_WARPS: gl.constexpr):
    """Pointers [parts, columns of a part, BLOCK_M] into the first 128 (presplit even) columns of each of the
    block's rows (`row_starts` [BLOCK_M])."""
    part = gl.arange(0, K_WARPS, layout=_axis(0, _x_layout(BLOCK_M, K_WARPS)))
    col = gl.arange(0, 128 // K_WARPS, layout=_axis(1, _x_layout(BLOCK_M, K_WARPS)))
    starts = gl.convert_layout(row_starts, _axis(2, _x_layout(BLOCK_M, K_WARPS)))
    return starts[None, None, :] + (part * (128 // K_WARPS))[:, None, None] + col[None, :, None]


@gluon.jit
def _x_halves(x_ptrs, row_mask, k_start, BLOCK_M: gl.constexpr, K_WARPS: gl.constexpr):
    """The presplit (even, odd) halves of columns [k_start, k_start + 256) in the B operand layout, padding rows
    zero."""
    even = gl.load(x_ptrs + k_start, mask=row_mask, other=0.0)
    odd = gl.load(x_ptrs + (k_start + 128), mask=row_mask, other=0.0)
    return (gl.convert_layout(_kappa_cols(even, BLOCK_M, K_WARPS), _operand(1, K_WARPS), assert_trivial=True),
            gl.convert_layout(_kappa_cols(odd, BLOCK_M, K_WARPS), _operand(1, K_WARPS), assert_trivial=True))


@gluon.jit
def _k_loop(byte_ptrs, scale_ptrs, x_ptrs, row_mask, steps, BLOCK_M: gl.constexpr, SCALE_FOLD: gl.constexpr,
            K_WARPS: gl.constexpr):
    """The [64, BLOCK_M] float32 product of the program's weight rows and its x (or hidden) rows: each part's sum
    over its columns of every step, then the parts added."""
    acc = gl.zeros([K_WARPS, 64, BLOCK_M], gl.float32, layout=_mma(K_WARPS))
    for step in range(0, steps):
        low, high = _weight_halves(byte_ptrs, scale_ptrs, step, SCALE_FOLD, K_WARPS)
        even, odd = _x_halves(x_ptrs, row_mask, step * 256, BLOCK_M, K_WARPS)
        acc = mma_v2(low, even, acc)
        acc = mma_v2(high, odd, acc)
    return gl.sum(acc, axis=0)


@gluon.jit
def gate_up_k_kernel(x_ptr, w_packed, w_scale, hidden_ptr, sorted_pairs_ptr, block_experts_ptr,
                     x_row_stride, packed_expert_stride, packed_row_stride, scale_expert_stride,
                     scale_row_stride, hidden_row_stride, num_pairs, num_experts, hidden_dim, inter_dim, beta,
                     linear_beta, TOP_K: gl.constexpr, IS_SITU: gl.constexpr, HAS_LINEAR_CLIP: gl.constexpr,
                     BLOCK_M: gl.constexpr, SCALE_FOLD: gl.constexpr, K_WARPS: gl.constexpr):
    """`moe_mxfp4_gluon.gate_up_gluon_kernel` with the warps over (part of K, row group)."""
    block = gl.program_id(0)
    expert = gl.load(block_experts_ptr + block)
    if expert >= num_experts:
        return
    stack = gl.arange(0, 64, layout=_axis(1, _bytes_layout(K_WARPS)))
    cols_of_stack = gl.program_id(1) * 32 + stack % 32
    w_rows = gl.where(stack < 32, cols_of_stack, cols_of_stack + inter_dim)            # [gate rows | up rows]
    byte_ptrs, scale_ptrs = _weight_pointers(w_packed, w_scale, expert, packed_expert_stride, packed_row_stride,
                                             scale_expert_stride, scale_row_stride, w_rows, K_WARPS)
    rows = block * BLOCK_M + gl.arange(0, BLOCK_M, layout=_axis(2, _x_layout(BLOCK_M, K_WARPS)))
    pairs = gl.load(sorted_pairs_ptr + rows)
    row_mask = (pairs < num_pairs)[None, None, :]                  # padding rows hold num_pairs
    x_ptrs = _x_pointers(x_ptr + (pairs // TOP_K).to(gl.int64) * x_row_stride, BLOCK_M, K_WARPS)
    acc = _k_loop(byte_ptrs, scale_ptrs, x_ptrs, row_mask, hidden_dim // 256, BLOCK_M, SCALE_FOLD, K_WARPS)
    pairs_last = gl.convert_layout(acc.reshape([2, 32, BLOCK_M]).permute([1, 2, 0]), _glu_layout())
    gate, up = pairs_last.split()                                  # [32, BLOCK_M] each
    hidden = glu_f32(gate, up, IS_SITU, HAS_LINEAR_CLIP, beta, linear_beta)
    cols = gl.program_id(1) * 32 + gl.arange(0, 32, layout=_slice(1, gate.type.layout))
    places = cols // 256 * 256 + cols % 256 // 2 + cols % 2 * 128                       # presplit order
    out_rows = block * BLOCK_M + gl.arange(0, BLOCK_M, layout=_slice(0, gate.type.layout))
    out_mask = (gl.load(sorted_pairs_ptr + out_rows) < num_pairs)[None, :] & (cols < inter_dim)[:, None]
    gl.store(hidden_ptr + out_rows.to(gl.int64)[None, :] * hidden_row_stride + places[:, None],
             hidden.to(hidden_ptr.dtype.element_ty), mask=out_mask)


@gluon.jit
def down_k_kernel(hidden_ptr, w_packed, w_scale, rows_out_ptr, sorted_pairs_ptr, block_experts_ptr,
                  hidden_row_stride, packed_expert_stride, packed_row_stride, scale_expert_stride,
                  scale_row_stride, rows_out_row_stride, num_pairs, num_experts, hidden_dim, inter_dim,
                  BLOCK_M: gl.constexpr, SCALE_FOLD: gl.constexpr, K_WARPS: gl.constexpr):
    """`moe_mxfp4_gluon.down_gluon_kernel` with the warps over (part of K, row group)."""
    col_blocks = gl.cdiv(hidden_dim, 64)
    block = gl.program_id(0) // col_blocks
    col_block = gl.program_id(0) % col_blocks
    expert = gl.load(block_experts_ptr + block)
    if expert >= num_experts:
        return
    w_rows = col_block * 64 + gl.arange(0, 64, layout=_axis(1, _bytes_layout(K_WARPS)))
    byte_ptrs, scale_ptrs = _weight_pointers(w_packed, w_scale, expert, packed_expert_stride, packed_row_stride,
                                             scale_expert_stride, scale_row_stride, w_rows, K_WARPS)
    rows = block * BLOCK_M + gl.arange(0, BLOCK_M, layout=_axis(2, _x_layout(BLOCK_M, K_WARPS)))
    row_mask = (gl.load(sorted_pairs_ptr + rows) < num_pairs)[None, None, :]
    h_ptrs = _x_pointers(hidden_ptr + rows.to(gl.int64) * hidden_row_stride, BLOCK_M, K_WARPS)
    acc = _k_loop(byte_ptrs, scale_ptrs, h_ptrs, row_mask, inter_dim // 256, BLOCK_M, SCALE_FOLD, K_WARPS)
    cols = col_block * 64 + gl.arange(0, 64, layout=_slice(1, acc.type.layout))
    out_rows = block * BLOCK_M + gl.arange(0, BLOCK_M, layout=_slice(0, acc.type.layout))
    out_mask = (gl.load(sorted_pairs_ptr + out_rows) < num_pairs)[None, :] & (cols < hidden_dim)[:, None]
    gl.store(rows_out_ptr + out_rows.to(gl.int64)[None, :] * rows_out_row_stride + cols[:, None], acc, mask=out_mask)
