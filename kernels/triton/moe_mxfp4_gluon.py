"""MXFP4 decode-sized expert GEMMs written in Gluon (Triton's explicit-layout dialect), NVIDIA only: mma.sync
(m16n8k16) with both operands loaded straight from global memory into the registers that feed it, no shared memory
and no barrier (a staged tile's weight bytes pass through shared memory: `_k_loop_staged`).

Why. The swap kernels (`kernels.triton.moe_mxfp4_swap`) spend a 64-row x 256-column K step of the sm_90 decode tile
in about 480 SASS instructions a warp: the wgmma path stages the weight bytes in shared memory (cp.async, a barrier
a step, 32 two-byte shared loads a thread to gather each A fragment), and each of the 16 m64n16k16 wgmma of a step
brings warpgroup fences and descriptor arithmetic. At 1-64 tokens the GEMMs are memory-bound in bytes but that
instruction stream is what holds them at about half of the copy bandwidth
(bench/results/moe-mxfp4-model-nvidia-h200.md). Here the same step is about 380 instructions (offline sm_90, the
gate/up loop at 8 rows a block; 414 with the two-permute decode it replaced), at about 70 registers and no shared
memory. At one token the kernels issue about 5 bytes of weights an instruction, so 4 instructions a cycle an SM is
close to the H200's DRAM bandwidth a SM: the instruction count is what the decode tiles are bound by.

With STREAM the two kernels run as a streamed pair, down waiting per row block instead of at the kernel boundary
(`kernels.triton.moe_mxfp4_stream`). HALF_BLOCKS (16-row blocks): a block with at most 8 rows runs the 8-row
product, half the MMAs and x loads; at 64 tokens about 45% of K3's experts have 8 or fewer rows. Scope: bf16 x, K
and I multiples of 256, 4 warps over WEIGHT_ROWS = 64 or 128 weight rows (gate/up: WEIGHT_ROWS / 2 columns of I,
gate rows over up rows), BLOCK_M 8 or 16 token rows a block (the MMA's n).

Why 128 rows (a tile's block_n). Every warp loads the whole of its block's x step (x is the MMA's B operand, the
same for all four warps), so at 64 rows a program moves 4 x BLOCK_M x 512 bytes of x through L1 a step against
8 KiB of weight bytes: at 16 rows a block four times the weight bytes, and the 64-token profile had L1 at 84% with
DRAM at 45% (bench/results/moe-mxfp4-model-nvidia-h200.md). At 128 rows each thread holds a second m16 tile's
weights (rows + 64), and each x fragment it loads feeds both: half the x traffic per weight byte, half the
programs, more registers a thread.

The operands (layouts, K order, decode, column order of x and hidden) are in
`kernels.triton.moe_mxfp4_gluon_operands`.

Never run in the interpreter: Gluon has none, so CI compiles these kernels offline and the GPU sweep checks them
against float64 before timing.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from kernels.triton.activation import glu_f32
from kernels.triton.moe_mxfp4_gluon_operands import (STEP_BYTES, _bytes_layout, _decoded_halves, _flat_layout,
                                                     _mma_layout, _piece_rows, _scale_layout, _slice, _stage_layout,
                                                     _stage_smem_layout, _thread_pieces, _weight_halves,
                                                     _weight_pointers, _x_halves, _x_layout, _x_pointers)
from kernels.triton.moe_mxfp4_prologue import stored_column
from kernels.triton.moe_mxfp4_stream import (_asm, _await_count, _combine_when_last, _count_out,
                                             _release_count)


def kernel_shape(tile) -> dict:
    """A gluon tile's layout options as the kernels' constexprs (`moe_mxfp4_tiles.Mxfp4Tile`)."""
    return {"COALESCED_X": tile.coalesced_x, "COALESCED_W": tile.coalesced_w, "HALF_BLOCKS": tile.half_blocks,
            "STAGES": tile.num_stages}


@gluon.constexpr_function
def _glu_layout():
    """[32 columns, BLOCK_M rows, 2 (gate, up)] with each (gate, up) pair in one thread, for the GLU."""
    return gl.BlockedLayout([1, 1, 2], [4, 8, 1], [4, 1, 1], [2, 1, 0])


@gluon.jit
def _k_loop(byte_ptrs, scale_ptrs, x_ptrs, steps, WEIGHT_ROWS: gl.constexpr, BLOCK_M: gl.constexpr,
            SCALE_FOLD: gl.constexpr, COALESCED_X: gl.constexpr, COALESCED_W: gl.constexpr, STAGES: gl.constexpr):
    """The [WEIGHT_ROWS, BLOCK_M] float32 product of the program's weight rows and its x (or hidden) rows over
    `steps` K steps of 256 columns: per step the low nibbles against the presplit even half, the high against the
    odd. A warp's x fragments feed its WEIGHT_ROWS / 64 m16 tiles. Every x pointer is a real row's
    (`_x_rows`): the loads carry no mask. STAGES > 1: `_k_loop_staged`."""
    if STAGES > 1:
        return _k_loop_staged(byte_ptrs, scale_ptrs, x_ptrs, steps, WEIGHT_ROWS, BLOCK_M, SCALE_FOLD,
                              COALESCED_X, COALESCED_W, STAGES)
    acc = gl.zeros([WEIGHT_ROWS, BLOCK_M], gl.float32, layout=_mma_layout())
    for step in range(0, steps):
        low, high = _weight_halves(byte_ptrs, scale_ptrs, step, WEIGHT_ROWS, SCALE_FOLD, COALESCED_W)
        even, odd = _x_halves(x_ptrs, step * 256, BLOCK_M, COALESCED_X, COALESCED_W)
        acc = mma_v2(low, even, acc)
        acc = mma_v2(high, odd, acc)
    return acc


@gluon.jit
def _k_loop_staged(byte_ptrs, scale_ptrs, x_ptrs, steps, WEIGHT_ROWS: gl.constexpr, BLOCK_M: gl.constexpr,
                   SCALE_FOLD: gl.constexpr, COALESCED_X: gl.constexpr, COALESCED_W: gl.constexpr,
                   STAGES: gl.constexpr):
    """`_k_loop` with the weight bytes a software pipeline: each thread copies its own 16-byte pieces of step
    i + STAGES - 1 into shared memory by cp.async (`_thread_pieces`: per piece a warp's copies and reads are 512
    contiguous bytes) while it decodes step i, and loads the scale bytes a step ahead into registers. The plain loop
    loads a step's bytes and waits for them before its decode, so a warp has one step of weights in flight (Nsight
    Compute at 386fccf: long-scoreboard waits were 39% of the one-token gate/up kernel's stall cycles, with DRAM at
    60%); here STAGES - 1 steps more are, in 8 KiB of shared memory a stage at 64 rows. A thread reads back only
    what it copied, so its own wait would order each step; Triton's shared-memory analysis cannot see that and puts
    a barrier after each wait and one before each copy into the stage read a step earlier (two bar.sync a step in
    the offline sm_90 SASS), so a program's four warps go through the steps together. On an H100 at 2365f32 it
    lost to the plain loop (1 token: 2.01x / 1.84x the bf16 experts at 2 / 3 stages against 3.00x), so no default
    tile stages."""
    stages = gl.allocate_shared_memory(gl.uint8, [STAGES, WEIGHT_ROWS // 16, 128, 16], _stage_smem_layout())
    copy_ptrs = gl.convert_layout(_thread_pieces(byte_ptrs, WEIGHT_ROWS, COALESCED_W), _stage_layout(WEIGHT_ROWS),
                                  assert_trivial=True)                      # [pieces, 128 threads, 16]
    # the reshape / permute hides from Triton what `_weight_pointers` made: 16 contiguous bytes a piece, at 16-byte
    # boundaries (row strides and the packed tensors' starts are multiples of 16: Triton's specialisation of them)
    copy_ptrs = gl.max_contiguous(gl.multiple_of(copy_ptrs, [1, 1, 16]), [1, 1, 16])
    for first in gl.static_range(STAGES - 1):
        if first < steps:
            async_copy.async_copy_global_to_shared(stages.index(first), copy_ptrs + first * STEP_BYTES)
        async_copy.commit_group()
    scale = gl.load(scale_ptrs)                                             # [WEIGHT_ROWS, 8, 1]
    acc = gl.zeros([WEIGHT_ROWS, BLOCK_M], gl.float32, layout=_mma_layout())
    for step in range(0, steps):
        ahead = step + STAGES - 1
        if ahead < steps:
            async_copy.async_copy_global_to_shared(stages.index(ahead % STAGES), copy_ptrs + ahead * STEP_BYTES)
        async_copy.commit_group()
        next_scale = gl.load(scale_ptrs + gl.minimum(step + 1, steps - 1) * 8)
        even, odd = _x_halves(x_ptrs, step * 256, BLOCK_M, COALESCED_X, COALESCED_W)
        async_copy.wait_group(STAGES - 1)                                   # this thread's copies of step
        byte = gl.convert_layout(_piece_rows(stages.index(step % STAGES).load(_stage_layout(WEIGHT_ROWS)),
                                             WEIGHT_ROWS, COALESCED_W),
                                 _bytes_layout(WEIGHT_ROWS, COALESCED_W), assert_trivial=True)
        low, high = _decoded_halves(byte, scale, WEIGHT_ROWS, SCALE_FOLD, COALESCED_W)
        acc = mma_v2(low, even, acc)
        acc = mma_v2(high, odd, acc)
        scale = next_scale
    async_copy.wait_group(0)
    return acc


@gluon.jit
def gate_up_gluon_kernel(x_ptr, w_packed, w_scale, hidden_ptr, sorted_pairs_ptr, block_experts_ptr,
                         x_row_stride, packed_expert_stride, packed_row_stride, scale_expert_stride,
                         scale_row_stride, hidden_row_stride, num_pairs, num_experts, hidden_dim, inter_dim, beta,
                         linear_beta, counters_ptr, TOP_K: gl.constexpr, IS_SITU: gl.constexpr,
                         HAS_LINEAR_CLIP: gl.constexpr, BLOCK_M: gl.constexpr, WEIGHT_ROWS: gl.constexpr,
                         SCALE_FOLD: gl.constexpr, STREAM: gl.constexpr, COALESCED_X: gl.constexpr,
                         COALESCED_W: gl.constexpr, HALF_BLOCKS: gl.constexpr, STAGES: gl.constexpr):
    """One (row block, WEIGHT_ROWS / 2 columns of I): gate and up rows stacked in one weight tile, the GLU in
    float32, stored presplit in x's dtype at the sorted rows (`moe_mxfp4_swap._store_hidden`'s order, BLOCK_K 256).
    STREAM (`moe_mxfp4_stream`): the grid is (column, block), so a block's programs run together, the down kernel
    may launch once every program has started, and each program counts itself done in its block's counter.
    HALF_BLOCKS: a block whose rows past BLOCK_M / 2 are all padding runs the BLOCK_M / 2-row product."""
    if STREAM:
        _asm("griddepcontrol.launch_dependents;")
        block = gl.program_id(1)
        col = gl.program_id(0)
    else:
        block = gl.program_id(0)
        col = gl.program_id(1)
    expert = gl.load(block_experts_ptr + block)
    if expert >= num_experts:
        return
    byte_ptrs, scale_ptrs = _weight_pointers(w_packed, w_scale, expert, packed_expert_stride, packed_row_stride,
                                             scale_expert_stride, scale_row_stride,
                                             _stacked_rows(inter_dim, col, WEIGHT_ROWS), 128,
                                             _bytes_layout(WEIGHT_ROWS, COALESCED_W),
                                             _scale_layout(WEIGHT_ROWS, COALESCED_W))
    args = (x_ptr, hidden_ptr, sorted_pairs_ptr, byte_ptrs, scale_ptrs, block * BLOCK_M, col, x_row_stride,
            hidden_row_stride, num_pairs, hidden_dim, inter_dim, beta, linear_beta)
    if HALF_BLOCKS and _half_full(sorted_pairs_ptr, block, num_pairs, BLOCK_M):
        _gate_up_rows(*args, TOP_K, IS_SITU, HAS_LINEAR_CLIP, BLOCK_M // 2, WEIGHT_ROWS, SCALE_FOLD, COALESCED_X,
                      COALESCED_W, STAGES)
    else:
        _gate_up_rows(*args, TOP_K, IS_SITU, HAS_LINEAR_CLIP, BLOCK_M, WEIGHT_ROWS, SCALE_FOLD, COALESCED_X,
                      COALESCED_W, STAGES)
    if STREAM:
        _release_count(counters_ptr + 2 * block)


@gluon.jit
def _half_full(sorted_pairs_ptr, block, num_pairs, BLOCK_M: gl.constexpr):
    """Whether block `block`'s rows past BLOCK_M / 2 are all padding (an expert's real rows come first)."""
    return gl.load(sorted_pairs_ptr + block * BLOCK_M + BLOCK_M // 2) >= num_pairs


@gluon.jit
def _gate_up_rows(x_ptr, hidden_ptr, sorted_pairs_ptr, byte_ptrs, scale_ptrs, row0, col, x_row_stride,
                  hidden_row_stride, num_pairs, hidden_dim, inter_dim, beta, linear_beta, TOP_K: gl.constexpr,
                  IS_SITU: gl.constexpr, HAS_LINEAR_CLIP: gl.constexpr, ROWS: gl.constexpr,
                  WEIGHT_ROWS: gl.constexpr, SCALE_FOLD: gl.constexpr, COALESCED_X: gl.constexpr,
                  COALESCED_W: gl.constexpr, STAGES: gl.constexpr):
    """Gate/up program `col` over the ROWS sorted rows from row0: the product, the GLU and the store."""
    rows = row0 + gl.arange(0, ROWS, layout=_slice(0, _x_layout(ROWS, COALESCED_X, COALESCED_W)))
    pairs = gl.load(sorted_pairs_ptr + rows)
    pairs = _x_rows(pairs, pairs < num_pairs, gl.load(sorted_pairs_ptr + row0))
    x_ptrs = _x_pointers(x_ptr + (pairs // TOP_K).to(gl.int64) * x_row_stride, ROWS, COALESCED_X, COALESCED_W)
    acc = _k_loop(byte_ptrs, scale_ptrs, x_ptrs, hidden_dim // 256, WEIGHT_ROWS, ROWS, SCALE_FOLD,
                  COALESCED_X, COALESCED_W, STAGES)
    hidden, cols, out_rows, out_mask = _glu_rows(acc, sorted_pairs_ptr, row0, col, num_pairs, inter_dim, beta,
                                                 linear_beta, WEIGHT_ROWS, ROWS, IS_SITU, HAS_LINEAR_CLIP)
    places = stored_column(cols, COALESCED_X, COALESCED_W)
    gl.store(hidden_ptr + out_rows.to(gl.int64)[None, :] * hidden_row_stride + places[:, None],
             hidden.to(hidden_ptr.dtype.element_ty), mask=out_mask)


@gluon.jit
def _x_rows(rows, real, first):
    """The rows (gate/up: pairs, down: sorted rows) whose x a block's MMA columns read: a padding one (not `real`) reads
    the block's first, a real one. An MMA's output columns are independent of each other's B columns and a padding
    column is never stored, so the x loads need no mask; without one they take no predicate and their registers no
    zeroing (16 CS2R a K step at 8 rows, offline sm_90: 378 -> 362 instructions a step at 1 token, 352 at 16), and
    padding columns load the addresses column 0 loads, which L1 serves (these are plain loads; the swap kernels'
    cp.async copies bypass L1 and keep their masks: `moe_mxfp4_operands._rows_t`). On an H100 (14ee48c) K3's
    16-token call ran 3.1% shorter (gate/up 435 -> 406 us), 1 and 4 tokens within 0.2%. What gained was likely the
    spill: with the masked loads ptxas gave the 16-token kernels 72 registers and an 8-byte spill reloaded every K
    step, without them 80 and none; a later 4% cut in loop instructions alone changed nothing there (the docstring
    of `moe_mxfp4_gluon_operands`)."""
    return gl.where(real, rows, first)


@gluon.jit
def _stacked_rows(inter_dim, col, WEIGHT_ROWS: gl.constexpr):
    """The WEIGHT_ROWS weight rows of gate/up program `col` (WEIGHT_ROWS / 2 columns of I from col x
    WEIGHT_ROWS / 2): gate rows over up rows."""
    stack = gl.arange(0, WEIGHT_ROWS, layout=_flat_layout())
    cols_of_stack = col * (WEIGHT_ROWS // 2) + stack % (WEIGHT_ROWS // 2)
    return gl.where(stack < WEIGHT_ROWS // 2, cols_of_stack, cols_of_stack + inter_dim)


@gluon.jit
def _glu_rows(acc, sorted_pairs_ptr, row0, col, num_pairs, inter_dim, beta, linear_beta, WEIGHT_ROWS: gl.constexpr,
              BLOCK_M: gl.constexpr, IS_SITU: gl.constexpr, HAS_LINEAR_CLIP: gl.constexpr):
    """Gate/up program `col`'s product [WEIGHT_ROWS, BLOCK_M] (`_stacked_rows`, any layout) over sorted rows
    row0.. -> the GLU in float32 [WEIGHT_ROWS / 2 columns, BLOCK_M rows], its columns of I, its sorted rows and
    the store mask (real rows, columns within I)."""
    pairs_last = gl.convert_layout(acc.reshape([2, WEIGHT_ROWS // 2, BLOCK_M]).permute([1, 2, 0]), _glu_layout())
    gate, up = pairs_last.split()                                  # [WEIGHT_ROWS / 2, BLOCK_M] each, once a program
    hidden = glu_f32(gate, up, IS_SITU, HAS_LINEAR_CLIP, beta, linear_beta)
    cols = col * (WEIGHT_ROWS // 2) + gl.arange(0, WEIGHT_ROWS // 2, layout=_slice(1, gate.type.layout))
    out_rows = row0 + gl.arange(0, BLOCK_M, layout=_slice(0, gate.type.layout))
    out_mask = (gl.load(sorted_pairs_ptr + out_rows) < num_pairs)[None, :] & (cols < inter_dim)[:, None]
    return hidden, cols, out_rows, out_mask


@gluon.jit
def _down_program(block_experts_ptr, hidden_dim, WEIGHT_ROWS: gl.constexpr):
    """A down program's row block, column block (WEIGHT_ROWS columns of D) and expert: one grid axis, column blocks
    fastest (a row block's programs share its hidden in L2)."""
    col_blocks = gl.cdiv(hidden_dim, WEIGHT_ROWS)
    block = gl.program_id(0) // col_blocks
    return block, gl.program_id(0) % col_blocks, gl.load(block_experts_ptr + block)


@gluon.jit
def _down_rows(col_block, WEIGHT_ROWS: gl.constexpr):
    """The WEIGHT_ROWS weight rows (columns of D) of a down program."""
    return col_block * WEIGHT_ROWS + gl.arange(0, WEIGHT_ROWS, layout=_flat_layout())


@gluon.jit
def down_gluon_kernel(hidden_ptr, w_packed, w_scale, rows_out_ptr, sorted_pairs_ptr, block_experts_ptr,
                      hidden_row_stride, packed_expert_stride, packed_row_stride, scale_expert_stride,
                      scale_row_stride, rows_out_row_stride, num_pairs, num_experts, hidden_dim, inter_dim,
                      counters_ptr, column_counters_ptr, out_ptr, out_row_stride, row_of_pair_ptr, weights_ptr,
                      expert_ids_ptr, num_tokens, expert_offset, BLOCK_M: gl.constexpr,
                      WEIGHT_ROWS: gl.constexpr, GATE_UP_COLS: gl.constexpr, SCALE_FOLD: gl.constexpr,
                      STREAM: gl.constexpr, COMBINE: gl.constexpr, TOP_K: gl.constexpr, COALESCED_X: gl.constexpr,
                      COALESCED_W: gl.constexpr, HALF_BLOCKS: gl.constexpr, STAGES: gl.constexpr):
    """One (row block, WEIGHT_ROWS columns of D): (W2 hidden^T) [WEIGHT_ROWS, BLOCK_M] over I, stored in float32
    at the sorted rows; GATE_UP_COLS: the columns of I a gate/up program writes (STREAM's count);
    hidden is gate/up's presplit output. One grid axis, column blocks fastest (`moe_mxfp4_swap._down_swap_kernel`).
    STREAM (`moe_mxfp4_stream`): launched while gate/up still runs, each program waits for its own row block's
    gate/up programs only, and each block's last program zeroes the block's counters for the next call.
    COMBINE (a fold_combine tile, stream only): the column block's last program, busy or idle, also writes out =
    the weighted sum of each token's rows (`moe_mxfp4_stream._combine_when_last`, what `combine_expert_rows`
    launches otherwise).
    HALF_BLOCKS: as gate/up's."""
    block, col_block, expert = _down_program(block_experts_ptr, hidden_dim, WEIGHT_ROWS)
    if expert >= num_experts:
        if COMBINE:
            _combine_columns(column_counters_ptr, rows_out_ptr, rows_out_row_stride, row_of_pair_ptr, weights_ptr,
                             expert_ids_ptr, out_ptr, out_row_stride, num_tokens, expert_offset, num_experts,
                             hidden_dim, TOP_K, WEIGHT_ROWS)
        return
    byte_ptrs, scale_ptrs = _weight_pointers(w_packed, w_scale, expert, packed_expert_stride, packed_row_stride,
                                             scale_expert_stride, scale_row_stride, _down_rows(col_block, WEIGHT_ROWS),
                                             128, _bytes_layout(WEIGHT_ROWS, COALESCED_W),
                                             _scale_layout(WEIGHT_ROWS, COALESCED_W))
    if STREAM:                                                     # wait for this block's hidden
        _await_count(counters_ptr + 2 * block, gl.cdiv(inter_dim, GATE_UP_COLS))
        _count_out(counters_ptr + 2 * block, gl.cdiv(hidden_dim, WEIGHT_ROWS))
    args = (hidden_ptr, rows_out_ptr, sorted_pairs_ptr, byte_ptrs, scale_ptrs, block * BLOCK_M, col_block,
            hidden_row_stride, rows_out_row_stride, num_pairs, hidden_dim, inter_dim)
    if HALF_BLOCKS and _half_full(sorted_pairs_ptr, block, num_pairs, BLOCK_M):
        _down_rows_product(*args, BLOCK_M // 2, WEIGHT_ROWS, SCALE_FOLD, COALESCED_X, COALESCED_W, STAGES)
    else:
        _down_rows_product(*args, BLOCK_M, WEIGHT_ROWS, SCALE_FOLD, COALESCED_X, COALESCED_W, STAGES)
    if COMBINE:
        _combine_columns(column_counters_ptr, rows_out_ptr, rows_out_row_stride, row_of_pair_ptr, weights_ptr,
                         expert_ids_ptr, out_ptr, out_row_stride, num_tokens, expert_offset, num_experts, hidden_dim,
                         TOP_K, WEIGHT_ROWS)


@gluon.jit(noinline=True)
def _combine_columns(column_counters_ptr, rows_out_ptr, rows_out_row_stride, row_of_pair_ptr, weights_ptr,
                     expert_ids_ptr, out_ptr, out_row_stride, num_tokens, expert_offset, num_experts, hidden_dim,
                     TOP_K: gl.constexpr, WEIGHT_ROWS: gl.constexpr):
    """This down program's arrival in its column block; the block's last writes the combine of its columns
    (`moe_mxfp4_stream._combine_when_last`). A call, not inlined, with everything from the program id again: the
    decode_thin cap of 72 registers has none to spare, and inlined (even as a loop) its code made ptxas allocate
    the K loop differently, 6-26 more instructions a step in the offline sm_90 SASS; as a call the loop is
    instruction for instruction the one without the combine (376 a step, 16 bytes of stack)."""
    col_block = gl.program_id(0) % gl.cdiv(hidden_dim, WEIGHT_ROWS)          # as `_down_program` has it
    _combine_when_last(column_counters_ptr + col_block, gl.num_programs(0) // gl.cdiv(hidden_dim, WEIGHT_ROWS),
                       rows_out_ptr, rows_out_row_stride, row_of_pair_ptr, weights_ptr, expert_ids_ptr, out_ptr,
                       out_row_stride, num_tokens, expert_offset, num_experts, col_block * WEIGHT_ROWS, hidden_dim,
                       TOP_K, WEIGHT_ROWS)


@gluon.jit
def _down_rows_product(hidden_ptr, rows_out_ptr, sorted_pairs_ptr, byte_ptrs, scale_ptrs, row0, col_block,
                       hidden_row_stride, rows_out_row_stride, num_pairs, hidden_dim, inter_dim, ROWS: gl.constexpr,
                       WEIGHT_ROWS: gl.constexpr, SCALE_FOLD: gl.constexpr, COALESCED_X: gl.constexpr,
                       COALESCED_W: gl.constexpr, STAGES: gl.constexpr):
    """Down program `col_block` over the ROWS sorted rows from row0: the product and its float32 store."""
    rows = row0 + gl.arange(0, ROWS, layout=_slice(0, _x_layout(ROWS, COALESCED_X, COALESCED_W)))
    rows = _x_rows(rows, gl.load(sorted_pairs_ptr + rows) < num_pairs, row0)
    h_ptrs = _x_pointers(hidden_ptr + rows.to(gl.int64) * hidden_row_stride, ROWS, COALESCED_X, COALESCED_W)
    acc = _k_loop(byte_ptrs, scale_ptrs, h_ptrs, inter_dim // 256, WEIGHT_ROWS, ROWS, SCALE_FOLD,
                  COALESCED_X, COALESCED_W, STAGES)
    cols = col_block * WEIGHT_ROWS + gl.arange(0, WEIGHT_ROWS, layout=_slice(1, _mma_layout()))
    out_rows = row0 + gl.arange(0, ROWS, layout=_slice(0, _mma_layout()))
    out_mask = (gl.load(sorted_pairs_ptr + out_rows) < num_pairs)[None, :] & (cols < hidden_dim)[:, None]
    gl.store(rows_out_ptr + out_rows.to(gl.int64)[None, :] * rows_out_row_stride + cols[:, None], acc, mask=out_mask)


def gate_up_gluon(args: tuple, num_blocks: int, inter_dim: int, top_k: int, activation: str, linear_clip: bool,
                  block_m: int, rows: int, fold: bool, shape: dict, counters: torch.Tensor | None,
                  options: dict) -> None:
    """`moe_mxfp4.gate_up`'s launch for a gluon tile (`args`: `moe_mxfp4._gate_up_args`, x in `gluon_columns`
    order) of `rows` stacked weight rows a program (rows / 2 columns of I); `shape`: `kernel_shape(tile)`;
    `counters`: the streamed pair's (`moe_mxfp4_stream.stream_counters`), None for the plain kernel."""
    col_blocks = inter_dim // (rows // 2)
    grid = (col_blocks, num_blocks) if counters is not None else (num_blocks, col_blocks)
    gate_up_gluon_kernel[grid](*args, counters, TOP_K=top_k, IS_SITU=activation == "situ",
                               HAS_LINEAR_CLIP=linear_clip, BLOCK_M=block_m, WEIGHT_ROWS=rows, SCALE_FOLD=fold,
                               STREAM=counters is not None, num_warps=4, **shape, **options)


def down_gluon(args: tuple, num_blocks: int, hidden_dim: int, block_m: int, rows: int, gate_up_rows: int,
               fold: bool, shape: dict, counters: torch.Tensor | None, options: dict,
               combine: tuple | None = None) -> None:
    """`moe_mxfp4.down`'s launch for a gluon tile (`args`: `moe_mxfp4._down_args`) of `rows` columns of D a
    program, after a gate/up of `gate_up_rows` a program; with `counters` (the same buffer gate/up counted into) a
    programmatic dependent launch that waits per row block. `combine` (with counters only): (out, row_of_pair,
    weights, expert_ids, expert_offset) as `combine_expert_rows` takes them (weights float32 and expert_ids int64,
    both contiguous), summed into out by each column block's last program."""
    stream = {"launch_pdl": True} if counters is not None else {}
    if combine is None:
        combined, top_k = (None, None, 0, None, None, None, 0, 0), 1
    else:
        if counters is None:
            raise ValueError("down_gluon: the combine is folded into the streamed pair's down kernel only")
        from kernels.triton.moe_mxfp4_stream import column_counters  # noqa: PLC0415
        out, row_of_pair, weights, expert_ids, expert_offset = combine
        num_tokens, top_k = expert_ids.shape
        combined = (column_counters(counters), out, out.stride(0), row_of_pair, weights, expert_ids, num_tokens,
                    expert_offset)
    down_gluon_kernel[(hidden_dim // rows * num_blocks,)](
        *args, counters, *combined, BLOCK_M=block_m, WEIGHT_ROWS=rows, GATE_UP_COLS=gate_up_rows // 2,
        SCALE_FOLD=fold, STREAM=counters is not None, COMBINE=combine is not None, TOP_K=top_k, num_warps=4,
        **stream, **shape, **options)
