"""MXFP4 prefill-sized expert GEMMs written in Gluon for sm_90 (NVIDIA only): wgmma with the decoded weight tile
as its register operand and the block's x (or hidden) rows in shared memory, the next K step decoded while the
tensor cores run this one.

Why. At prefill the swap kernels (`kernels.triton.moe_mxfp4_swap`) decode each expert's weights once per row block
of at most 96 rows (64 + 32) and Triton's pipeline waits for each step's MMA before the next decode (0.81x the bf16
experts at 16K routed rows, bench/results/moe-mxfp4-nvidia-h200.md). Here a block is up to 256 rows (the wgmma's
n), so K3's ~146 rows an expert at 16K routed rows can decode each weight once, and each step's wgmma is issued
asynchronously with the next step's decode after it.

Operands. The weight tile is 64 rows (gate/up: 32 columns of I, gate rows over up rows; down: 64 columns of D), one
warpgroup (4 warps, 16 rows each), a K step 128 columns = 64 bytes a row. A thread of a m64nNk16 wgmma holds, of
each 16-column slab of its register operand, columns 2t, 2t+1, 2t+8, 2t+9 of rows g and g+8 of its warp's 16 rows
(lane = 4g + t), as mma.sync does (`kernels.triton.moe_mxfp4_gluon`). The K order is the kernel's own: dot position
kappa = 16s + 8h + 2t + p (slab s of 4, half h, pair element p) is byte j = 16t + 4s + 2h + p of the step's 64
bytes, so each thread reads 16 consecutive bytes (one scale group) of each of its two rows, and x is stored in the
same order: per 128 columns, [the even columns | the odd ones], each half in kappa order (`kappa_columns`;
gate/up's store writes hidden so). A step's packed bytes and x rows reach shared memory by cp.async (16 bytes a
copy), STAGES - 1 steps ahead; the bytes are read back with one 16-byte shared load a row (loading them from
global memory a step ahead instead kept 32 single bytes a thread live across the loop, repacked by about 100
instructions a step in the offline SASS).

Decode: `moe_mxfp4_gluon`'s four-bytes-per-PTX-call decode (bf16 code * 2^-126, exact, then x 2^126 x the scale).
Block heights. Gluon's tensors are powers of two, so a block of 96 or 160 rows is BLOCK_M + TAIL_M: the tail rows
get their own shared-memory stages and accumulator and a second pair of wgmma a step from the same decoded
registers, so one decode serves both (K3's ~146 rows an expert at 16K routed rows: two 64 + 32 blocks decode each
weight twice where 64-row blocks decode it three times; 73 at 8K: one block). A block with no rows past BLOCK_M
skips the tail's wgmma (a runtime branch around them; in the offline SASS the main and tail HGMMA still share one
wait a step).

Scope: bf16 x, K and I multiples of 128, block_m a power of two in [16, 256], tail_m 0 or a power of two in [16,
block_m]. Never run in the interpreter (Gluon has none): CI compiles these kernels offline for sm_90, and the GPU
sweep checks them against float64 first. First run on the H200 at 8eaf6f9
(bench/results/moe-mxfp4-wgmma-prefill-nvidia-h200.*, moe-mxfp4-mid-wgmma-nvidia-h200.*): 64 + 32 rows at 4 stages
0.90x the bf16 experts at 16K routed rows (the swap tile 0.82x), 32 + 16 at 4 stages 1.59x at 256 tokens (1.42x):
the prefill and mid classes' tiles since.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma, warpgroup_mma_init,
                                                               warpgroup_mma_wait)

from kernels.triton.moe_mxfp4_gluon import _down_program, _down_rows, _glu_rows, _stacked_rows
from kernels.triton.moe_mxfp4_gluon_operands import _flat_layout, _quad_decode, _slice, _weight_pointers

STEP_COLUMNS = 128                                # K columns a step: 64 bytes of a weight row
STEP_BYTES: gl.constexpr = gl.constexpr(64)


def kappa_order(device: torch.device | None = None) -> torch.Tensor:
    """[128] int64: position q of a 128-column step holds column kappa_order()[q] of the step (x's order here)."""
    q = torch.arange(128, device=device)
    odd, kappa = q // 64, q % 64
    s, h, t, p = kappa // 16, kappa // 8 % 2, kappa // 2 % 4, kappa % 2
    return 2 * (16 * t + 4 * s + 2 * h + p) + odd


def kappa_columns(t: torch.Tensor) -> torch.Tensor:
    """[R, K] -> [R, K] with each 128 columns in the kernels' order (`kappa_order`); K a multiple of 128. One copy
    through a permuted view (no index tensor: the decode-sized calls run inside CUDA graphs)."""
    rows, num_k = t.shape
    if num_k % STEP_COLUMNS:
        raise ValueError(f"kappa_columns: K must be a multiple of {STEP_COLUMNS}, got {num_k}")
    # column 2j + odd of a step, j = 16t + 4s + 2h + p -> position 64 odd + 16s + 8h + 2t + p
    split = t.reshape(rows, num_k // STEP_COLUMNS, 4, 4, 2, 2, 2)              # [R, step, t, s, h, p, odd]
    return split.permute(0, 1, 6, 3, 4, 2, 5).reshape(rows, num_k)            # [R, step, odd, s, h, t, p]


@gluon.constexpr_function
def _acc_layout(block_m):
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, block_m, 16])


@gluon.constexpr_function
def _operand_layout(block_m):
    return gl.DotOperandLayout(operand_index=0, parent=_acc_layout(block_m), k_width=2)


@gluon.constexpr_function
def _bytes_layout():
    """[64 rows, 64 bytes]: thread 4g + t of warp w holds rows 16w + g and + 8, bytes 16t..16t+15."""
    return gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [8, 0]],
                                      lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 64])


@gluon.constexpr_function
def _scale_layout():
    """[64 rows, 4 groups, 16 bytes]: the scale of each byte of `_bytes_layout`, held where that byte is."""
    return gl.DistributedLinearLayout(reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [8, 0, 0]],
                                      lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
                                      warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[64, 4, 16])


@gluon.constexpr_function
def _copy_layout():
    """[rows, 64 columns] of x for cp.async: 8 consecutive bf16 (16 bytes) a thread, 8 threads a row."""
    return gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])


@gluon.constexpr_function
def _byte_copy_layout():
    """[64 rows, 64 bytes] of packed weights for cp.async: 16 consecutive bytes a thread, 4 threads a row."""
    return gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])


@gluon.constexpr_function
def _byte_smem_layout():
    """Unswizzled: a warp's 16-byte reads in `_bytes_layout` (rows g and g + 8, bytes 16t..) cover 512 contiguous
    bytes, so they are conflict-free as they are."""
    return gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])


@gluon.constexpr_function
def _x_smem_layout():
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)


@gluon.constexpr_function
def _out_layout():
    """[64 columns of D, BLOCK_M rows] for the float32 store: 4 consecutive columns (16 bytes) a thread."""
    return gl.BlockedLayout([4, 1], [16, 2], [1, 4], [0, 1])


@gluon.jit
def _kappa(tile):
    """[64, 64] indexed by byte j = 16t + 4s + 2h + p -> indexed by dot position kappa = 16s + 8h + 2t + p."""
    tile = tile.reshape([64, 4, 4, 2, 2])                          # [row, t, s, h, p]
    return tile.permute([0, 2, 3, 1, 4]).reshape([64, 64])         # [row, s, h, t, p]


@gluon.jit
def _decode(byte, scale, BLOCK_M: gl.constexpr, SCALE_FOLD: gl.constexpr):
    """A step's packed bytes [64, 64] and scale bytes [64, 4, 1] -> (low-nibble, high-nibble) bf16 tiles [64, 64]
    in the wgmma register operand's layout."""
    low, high = _quad_decode(byte, scale, 64, 64, _bytes_layout(), SCALE_FOLD)
    return (gl.convert_layout(_kappa(low), _operand_layout(BLOCK_M), assert_trivial=True),
            gl.convert_layout(_kappa(high), _operand_layout(BLOCK_M), assert_trivial=True))


@gluon.jit
def _issue(byte_ptrs, x_ptrs, x_mask, t_ptrs, t_mask, step, stage, byte_smem, even_smem, odd_smem, even_t, odd_t,
           TAIL_M: gl.constexpr):
    """cp.async of step `step`'s packed weight bytes and the even and odd halves of the block's rows (and of its
    tail rows) into stage `stage`, as one commit group."""
    async_copy.async_copy_global_to_shared(byte_smem.index(stage), byte_ptrs + step * STEP_BYTES)
    async_copy.async_copy_global_to_shared(even_smem.index(stage), x_ptrs + step * 128, mask=x_mask)
    async_copy.async_copy_global_to_shared(odd_smem.index(stage), x_ptrs + (step * 128 + 64), mask=x_mask)
    if TAIL_M > 0:
        async_copy.async_copy_global_to_shared(even_t.index(stage), t_ptrs + step * 128, mask=t_mask)
        async_copy.async_copy_global_to_shared(odd_t.index(stage), t_ptrs + (step * 128 + 64), mask=t_mask)


@gluon.jit
def _step(acc, acc_t, low, high, scale, step, steps, byte_ptrs, scale_ptrs, x_ptrs, x_mask, t_ptrs, t_mask, has_tail,
          byte_smem, even_smem, odd_smem, even_t, odd_t, BLOCK_M: gl.constexpr, TAIL_M: gl.constexpr,
          STAGES: gl.constexpr, SCALE_FOLD: gl.constexpr):
    """K step `step` (its decoded halves `low`, `high`; `scale`: step + 1's scale bytes) -> the accumulators (the
    tail's: the same decoded halves against the tail rows), step + 1's decoded halves and step + 2's scale bytes
    (the last step decodes itself again, unused)."""
    async_copy.wait_group(STAGES - 3)                              # step + 1: this thread's copies
    gl.thread_barrier()                                            # ... and everyone's; step - 1's MMA is done
    ahead = step + STAGES - 1
    if ahead < steps:
        _issue(byte_ptrs, x_ptrs, x_mask, t_ptrs, t_mask, ahead, ahead % STAGES, byte_smem, even_smem, odd_smem,
               even_t, odd_t, TAIL_M)
    async_copy.commit_group()
    fence_async_shared()
    stage = step % STAGES
    acc = warpgroup_mma(low, even_smem.index(stage).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma(high, odd_smem.index(stage).permute((1, 0)), acc, is_async=True)
    if TAIL_M > 0:
        acc_t = warpgroup_mma_init(acc_t)                          # the same type in both branches
        if has_tail:                                               # the block has rows past BLOCK_M
            acc_t = warpgroup_mma(gl.convert_layout(low, _operand_layout(TAIL_M), assert_trivial=True),
                                  even_t.index(stage).permute((1, 0)), acc_t, is_async=True)
            acc_t = warpgroup_mma(gl.convert_layout(high, _operand_layout(TAIL_M), assert_trivial=True),
                                  odd_t.index(stage).permute((1, 0)), acc_t, is_async=True)
    following = gl.minimum(step + 1, steps - 1)
    next_low, next_high = _decode(byte_smem.index(following % STAGES).load(_bytes_layout()), scale, BLOCK_M,
                                  SCALE_FOLD)
    next_scale = gl.load(scale_ptrs + gl.minimum(step + 2, steps - 1) * 4)
    if TAIL_M > 0:
        acc, acc_t, low, high = warpgroup_mma_wait(0, deps=[acc, acc_t, low, high])
    else:
        acc, low, high = warpgroup_mma_wait(0, deps=[acc, low, high])
    return acc, acc_t, next_low, next_high, next_scale


@gluon.jit
def _k_loop(byte_ptrs, scale_ptrs, x_ptrs, x_mask, t_ptrs, t_mask, has_tail, steps, BLOCK_M: gl.constexpr,
            TAIL_M: gl.constexpr, STAGES: gl.constexpr, SCALE_FOLD: gl.constexpr):
    """The [64, BLOCK_M] float32 product of the program's 64 weight rows and its x (or hidden) rows over `steps` K
    steps of 128 columns (`x_ptrs` [BLOCK_M, 64]: step 0's even half of each row), and with TAIL_M the [64,
    TAIL_M] product with its tail rows (`t_ptrs`; skipped when not `has_tail`, the tail all padding; without
    TAIL_M the second result is 0 and `t_ptrs` unused).

    Step i's packed bytes and x rows land in shared memory by cp.async, STAGES - 1 steps ahead of its MMA; its
    scale bytes come from global memory (two a thread, loaded a step ahead). Each step (`_step`) issues its two
    wgmma (low nibbles against the even half, high against the odd; two more against the tail rows, from the same
    registers: one decode for block_m + tail_m rows) without waiting, decodes the next step from shared memory
    while they run, then waits for them. The loop runs two steps an iteration, so that the decoded operands
    alternate between two sets of registers: with one set a step, ptxas put the wait before the decode (the decode
    writes the registers the running wgmma reads), so nothing overlapped; with two, part of the decode overlaps in
    the offline sm_90 SASS (how much is ptxas' choice, step by step), and the loop is 265-295 instructions a step
    against 290-340. The barrier at the top of step i makes step i + 1's stage visible to every warp and frees the
    stage of step i - 1, whose MMA every warp waited for, for step i + STAGES - 1's copies (so STAGES >= 3: a stage
    each for steps i - 1, i and i + 1)."""
    byte_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, 64, 64], _byte_smem_layout())
    even_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, 64], _x_smem_layout())
    odd_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, 64], _x_smem_layout())
    if TAIL_M > 0:
        even_t = gl.allocate_shared_memory(gl.bfloat16, [STAGES, TAIL_M, 64], _x_smem_layout())
        odd_t = gl.allocate_shared_memory(gl.bfloat16, [STAGES, TAIL_M, 64], _x_smem_layout())
        acc_t = gl.zeros([64, TAIL_M], gl.float32, layout=_acc_layout(TAIL_M))
    else:
        even_t = even_smem                                         # unused
        odd_t = odd_smem
        acc_t = 0
    for s in gl.static_range(STAGES - 1):
        if s < steps:
            _issue(byte_ptrs, x_ptrs, x_mask, t_ptrs, t_mask, s, s, byte_smem, even_smem, odd_smem, even_t, odd_t,
                   TAIL_M)
        async_copy.commit_group()
    async_copy.wait_group(STAGES - 2)                              # step 0
    gl.thread_barrier()
    low, high = _decode(byte_smem.index(0).load(_bytes_layout()), gl.load(scale_ptrs), BLOCK_M, SCALE_FOLD)
    scale = gl.load(scale_ptrs + gl.minimum(1, steps - 1) * 4)
    acc = gl.zeros([64, BLOCK_M], gl.float32, layout=_acc_layout(BLOCK_M))
    for pair in range(steps // 2):
        for u in gl.static_range(2):
            acc, acc_t, low, high, scale = _step(acc, acc_t, low, high, scale, 2 * pair + u, steps, byte_ptrs,
                                                 scale_ptrs, x_ptrs, x_mask, t_ptrs, t_mask, has_tail, byte_smem,
                                                 even_smem, odd_smem, even_t, odd_t, BLOCK_M, TAIL_M, STAGES,
                                                 SCALE_FOLD)
    if steps % 2:
        acc, acc_t, low, high, scale = _step(acc, acc_t, low, high, scale, steps - 1, steps, byte_ptrs, scale_ptrs,
                                             x_ptrs, x_mask, t_ptrs, t_mask, has_tail, byte_smem, even_smem,
                                             odd_smem, even_t, odd_t, BLOCK_M, TAIL_M, STAGES, SCALE_FOLD)
    async_copy.wait_group(0)
    return acc, acc_t


@gluon.jit
def _x_pointers(row_starts, row_ok, BLOCK_M: gl.constexpr):
    """Pointers [BLOCK_M, 64] to the first 64 columns of each of the block's rows and the copy mask."""
    starts = gl.convert_layout(row_starts, _slice(1, _copy_layout()))
    ok = gl.convert_layout(row_ok, _slice(1, _copy_layout()))
    cols = gl.arange(0, 64, layout=_slice(0, _copy_layout()))
    return starts[:, None] + cols[None, :], ok[:, None]


@gluon.jit
def _token_rows(x_ptr, sorted_pairs_ptr, row0, num_pairs, x_row_stride, ROWS: gl.constexpr, TOP_K: gl.constexpr):
    """x pointers [ROWS, 64] and copy mask of sorted rows row0.. (each row's token: its pair // TOP_K; padding
    rows hold num_pairs)."""
    pairs = gl.load(sorted_pairs_ptr + row0 + gl.arange(0, ROWS, layout=_flat_layout()))
    return _x_pointers(x_ptr + (pairs // TOP_K).to(gl.int64) * x_row_stride, pairs < num_pairs, ROWS)


@gluon.jit
def _sorted_rows(hidden_ptr, sorted_pairs_ptr, row0, num_pairs, hidden_row_stride, ROWS: gl.constexpr):
    """hidden pointers [ROWS, 64] and copy mask of sorted rows row0.. (hidden is stored by sorted row)."""
    rows = row0 + gl.arange(0, ROWS, layout=_flat_layout())
    row_ok = gl.load(sorted_pairs_ptr + rows) < num_pairs
    return _x_pointers(hidden_ptr + rows.to(gl.int64) * hidden_row_stride, row_ok, ROWS)


@gluon.jit
def _store_hidden(acc, hidden_ptr, sorted_pairs_ptr, row0, col, num_pairs, inter_dim, hidden_row_stride, beta,
                  linear_beta, ROWS: gl.constexpr, IS_SITU: gl.constexpr, HAS_LINEAR_CLIP: gl.constexpr):
    """The GLU of gate/up program `col`'s product [64, ROWS] over sorted rows row0.., stored in hidden's dtype in
    `kappa_columns` order (what the down kernel reads)."""
    hidden, cols, out_rows, out_mask = _glu_rows(acc, sorted_pairs_ptr, row0, col, num_pairs, inter_dim, beta,
                                                 linear_beta, 64, ROWS, IS_SITU, HAS_LINEAR_CLIP)
    j = cols % 128 // 2                                            # kappa_order's inverse: column -> position
    kappa = (j // 4 % 4) * 16 + (j // 2 % 2) * 8 + (j // 16) * 2 + j % 2
    places = cols // 128 * 128 + cols % 2 * 64 + kappa
    gl.store(hidden_ptr + out_rows.to(gl.int64)[None, :] * hidden_row_stride + places[:, None],
             hidden.to(hidden_ptr.dtype.element_ty), mask=out_mask)


@gluon.jit
def _store_rows(acc, rows_out_ptr, sorted_pairs_ptr, row0, col_block, num_pairs, hidden_dim, rows_out_row_stride,
                ROWS: gl.constexpr):
    """A down program's product [64 columns of D, ROWS] over sorted rows row0.., stored in float32."""
    acc = gl.convert_layout(acc, _out_layout())
    cols = col_block * 64 + gl.arange(0, 64, layout=_slice(1, _out_layout()))
    out_rows = row0 + gl.arange(0, ROWS, layout=_slice(0, _out_layout()))
    out_mask = (gl.load(sorted_pairs_ptr + out_rows) < num_pairs)[None, :] & (cols < hidden_dim)[:, None]
    gl.store(rows_out_ptr + out_rows.to(gl.int64)[None, :] * rows_out_row_stride + cols[:, None], acc, mask=out_mask)


@gluon.jit
def gate_up_wgmma_kernel(x_ptr, w_packed, w_scale, hidden_ptr, sorted_pairs_ptr, block_experts_ptr,
                         x_row_stride, packed_expert_stride, packed_row_stride, scale_expert_stride,
                         scale_row_stride, hidden_row_stride, num_pairs, num_experts, hidden_dim, inter_dim, beta,
                         linear_beta, TOP_K: gl.constexpr, IS_SITU: gl.constexpr, HAS_LINEAR_CLIP: gl.constexpr,
                         BLOCK_M: gl.constexpr, TAIL_M: gl.constexpr, STAGES: gl.constexpr,
                         SCALE_FOLD: gl.constexpr):
    """One (row block of BLOCK_M + TAIL_M rows, 32 columns of I): gate and up rows stacked in one 64-row weight
    tile, the GLU in float32, stored in x's dtype at the sorted rows, in `kappa_columns` order."""
    block = gl.program_id(0)
    col = gl.program_id(1)
    expert = gl.load(block_experts_ptr + block)
    if expert >= num_experts:
        return
    byte_ptrs, scale_ptrs = _weight_pointers(w_packed, w_scale, expert, packed_expert_stride, packed_row_stride,
                                             scale_expert_stride, scale_row_stride, _stacked_rows(inter_dim, col, 64),
                                             64, _byte_copy_layout(), _scale_layout())
    row0 = block * (BLOCK_M + TAIL_M)
    x_ptrs, x_mask = _token_rows(x_ptr, sorted_pairs_ptr, row0, num_pairs, x_row_stride, BLOCK_M, TOP_K)
    if TAIL_M > 0:
        t_ptrs, t_mask = _token_rows(x_ptr, sorted_pairs_ptr, row0 + BLOCK_M, num_pairs, x_row_stride, TAIL_M, TOP_K)
    else:
        t_ptrs, t_mask = x_ptrs, x_mask                            # unused
    has_tail = gl.load(sorted_pairs_ptr + row0 + BLOCK_M) < num_pairs if TAIL_M > 0 else False
    acc, acc_t = _k_loop(byte_ptrs, scale_ptrs, x_ptrs, x_mask, t_ptrs, t_mask, has_tail, hidden_dim // 128, BLOCK_M,
                         TAIL_M, STAGES, SCALE_FOLD)
    _store_hidden(acc, hidden_ptr, sorted_pairs_ptr, row0, col, num_pairs, inter_dim, hidden_row_stride, beta,
                  linear_beta, BLOCK_M, IS_SITU, HAS_LINEAR_CLIP)
    if TAIL_M > 0:
        _store_hidden(acc_t, hidden_ptr, sorted_pairs_ptr, row0 + BLOCK_M, col, num_pairs, inter_dim,
                      hidden_row_stride, beta, linear_beta, TAIL_M, IS_SITU, HAS_LINEAR_CLIP)


@gluon.jit
def down_wgmma_kernel(hidden_ptr, w_packed, w_scale, rows_out_ptr, sorted_pairs_ptr, block_experts_ptr,
                      hidden_row_stride, packed_expert_stride, packed_row_stride, scale_expert_stride,
                      scale_row_stride, rows_out_row_stride, num_pairs, num_experts, hidden_dim, inter_dim,
                      BLOCK_M: gl.constexpr, TAIL_M: gl.constexpr, STAGES: gl.constexpr, SCALE_FOLD: gl.constexpr):
    """One (row block of BLOCK_M + TAIL_M rows, 64 columns of D): (W2 hidden^T) over I, stored in float32 at the
    sorted rows. One grid axis, column blocks fastest (a row block's programs share its hidden in L2)."""
    block, col_block, expert = _down_program(block_experts_ptr, hidden_dim, 64)
    if expert >= num_experts:
        return
    byte_ptrs, scale_ptrs = _weight_pointers(w_packed, w_scale, expert, packed_expert_stride, packed_row_stride,
                                             scale_expert_stride, scale_row_stride, _down_rows(col_block, 64), 64,
                                             _byte_copy_layout(), _scale_layout())
    row0 = block * (BLOCK_M + TAIL_M)
    h_ptrs, h_mask = _sorted_rows(hidden_ptr, sorted_pairs_ptr, row0, num_pairs, hidden_row_stride, BLOCK_M)
    if TAIL_M > 0:
        t_ptrs, t_mask = _sorted_rows(hidden_ptr, sorted_pairs_ptr, row0 + BLOCK_M, num_pairs, hidden_row_stride,
                                      TAIL_M)
    else:
        t_ptrs, t_mask = h_ptrs, h_mask                            # unused
    has_tail = gl.load(sorted_pairs_ptr + row0 + BLOCK_M) < num_pairs if TAIL_M > 0 else False
    acc, acc_t = _k_loop(byte_ptrs, scale_ptrs, h_ptrs, h_mask, t_ptrs, t_mask, has_tail, inter_dim // 128, BLOCK_M,
                         TAIL_M, STAGES, SCALE_FOLD)
    _store_rows(acc, rows_out_ptr, sorted_pairs_ptr, row0, col_block, num_pairs, hidden_dim, rows_out_row_stride,
                BLOCK_M)
    if TAIL_M > 0:
        _store_rows(acc_t, rows_out_ptr, sorted_pairs_ptr, row0 + BLOCK_M, col_block, num_pairs, hidden_dim,
                    rows_out_row_stride, TAIL_M)


def gate_up_wgmma(args: tuple, grid: tuple, top_k: int, activation: str, linear_clip: bool, block_m: int,
                  tail_m: int, stages: int, fold: bool, options: dict) -> None:
    """`moe_mxfp4.gate_up`'s launch for a wgmma tile (`args`: `moe_mxfp4._gate_up_args`)."""
    gate_up_wgmma_kernel[grid](*args, TOP_K=top_k, IS_SITU=activation == "situ", HAS_LINEAR_CLIP=linear_clip,
                               BLOCK_M=block_m, TAIL_M=tail_m, STAGES=stages, SCALE_FOLD=fold, num_warps=4,
                               **options)


def down_wgmma(args: tuple, grid: tuple, block_m: int, tail_m: int, stages: int, fold: bool, options: dict) -> None:
    """`moe_mxfp4.down`'s launch for a wgmma tile (`args`: `moe_mxfp4._down_args`)."""
    down_wgmma_kernel[grid](*args, BLOCK_M=block_m, TAIL_M=tail_m, STAGES=stages, SCALE_FOLD=fold, num_warps=4,
                            **options)
