"""The MXFP4 decode's prologue as one launch (the Gluon tiles' and decode_batch's swap tile's): program 0 groups
the (token, choice) pairs into expert blocks (`moe_blocks.group_pairs_program`) while the other programs copy x
into the column order the Gluon kernels read (`stored_column`; the torch form is
`moe_mxfp4_gluon_operands.gluon_columns`).

Why. Neither needs the other, yet as two launches they ran one after the other: in K3's one-token MXFP4 step on
the H200 (2d1109e, bench/results/moe-mxfp4-nvidia-h200.md) the grouping program took 11 us and the torch copy of x
2 us more, before gate/up could start, in a 113 us step. Here the copy runs on other SMs during the grouping, and
the step has one launch fewer. Only for the one-program grouping (at most `moe_blocks.SMALL_BATCH_PAIRS` pairs);
larger batches keep the torch grouping and the torch copy. A tile asks for it with `Mxfp4Tile.prologue`: the Gluon
decode tiles, and the presplit swap tile at block_k 256 (K3 at 36-64 tokens), whose presplit order is the Gluon
kernels' plain one. The launch takes the grouping's warps (`moe_blocks.grouping_warps`: 16 at 1024 pairs).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.moe_blocks import ExpertBlocks, group_pairs_program, grouping_warps, small_grouping

COPY_ROWS = 4                      # x rows a copy program moves
COPY_COLUMNS = 512                 # x columns a copy program moves (whole 256-column steps: a step stays in place)


@triton.jit
def stored_column(c, COALESCED_X: tl.constexpr, COALESCED_W: tl.constexpr):
    """Where column c of x (or of the expert hidden) lies in the Gluon kernels' order: each 256 columns as [the even
    ones | the odd ones], and column j of a half at j (plain), at 32c' + 8t + r for j = 32t + 8c' + r (COALESCED_X),
    or at 64q + 32h + 8t + r for j = 64q + 16t + 8h + r (with COALESCED_W as well); `moe_mxfp4_gluon_operands._x_layout`
    says why. Plain arithmetic only, so that a CPU test can run it on a torch tensor (`.fn`)."""
    j = c % 256 // 2
    place = j
    if COALESCED_X and COALESCED_W:
        place = j // 64 * 64 + j % 16 // 8 * 32 + j % 64 // 16 * 8 + j % 8
    elif COALESCED_X:
        place = j % 32 // 8 * 32 + j // 32 * 8 + j % 8
    return c // 256 * 256 + c % 2 * 128 + place


@triton.jit
def _group_pairs_and_columns_kernel(expert_ids_ptr, sorted_pairs_ptr, block_experts_ptr, row_of_pair_ptr,
                                    num_pairs, expert_offset, num_experts, num_blocks, x_ptr, ordered_ptr, num_rows,
                                    num_cols, x_row_stride, ordered_row_stride, BLOCK_M: tl.constexpr,
                                    E_BLOCK: tl.constexpr, P_BLOCK: tl.constexpr, FILL: tl.constexpr,
                                    COALESCED_X: tl.constexpr, COALESCED_W: tl.constexpr, ROWS: tl.constexpr,
                                    COLUMNS: tl.constexpr):
    """Program 0: the grouping. Program 1 + i: ROWS x COLUMNS tile i of x (column tiles fastest), each value
    stored at its `stored_column`."""
    pid = tl.program_id(0)
    if pid == 0:
        group_pairs_program(expert_ids_ptr, sorted_pairs_ptr, block_experts_ptr, row_of_pair_ptr, num_pairs,
                            expert_offset, num_experts, num_blocks, BLOCK_M, E_BLOCK, P_BLOCK, FILL)
    else:
        col_tiles = tl.cdiv(num_cols, COLUMNS)
        rows = (pid - 1) // col_tiles * ROWS + tl.arange(0, ROWS)
        cols = (pid - 1) % col_tiles * COLUMNS + tl.arange(0, COLUMNS)
        mask = (rows < num_rows)[:, None] & (cols < num_cols)[None, :]
        rows = rows.to(tl.int64)[:, None]
        values = tl.load(x_ptr + rows * x_row_stride + cols[None, :], mask=mask)
        places = stored_column(cols, COALESCED_X, COALESCED_W)
        tl.store(ordered_ptr + rows * ordered_row_stride + places[None, :], values, mask=mask)


def copies_columns(x: torch.Tensor) -> bool:
    """Whether the prologue's copy takes x [T, K] as it is: K whole 256-column steps, columns contiguous
    (`group_pairs_and_columns` refuses anything else; a swap tile's call falls back to gate/up's own copy)."""
    return x.shape[1] % 256 == 0 and x.stride(1) == 1


def group_pairs_and_columns(expert_ids: torch.Tensor, expert_offset: int, num_experts: int, block_m: int,
                            x: torch.Tensor, coalesced_x: bool, coalesced_w: bool) -> tuple[ExpertBlocks, torch.Tensor]:
    """(`moe_blocks.group_pairs_small`'s blocks, `moe_mxfp4_gluon_operands.gluon_columns(x, coalesced_x, coalesced_w)`),
    bit for bit, from one launch (x [T, K], K a multiple of 256, rows with unit column stride)."""
    num_rows, num_cols = x.shape
    if coalesced_w and not coalesced_x:
        raise ValueError("group_pairs_and_columns: coalesced_w comes only with coalesced_x (`moe_mxfp4_tiles`)")
    if not copies_columns(x):
        raise ValueError(f"group_pairs_and_columns: K must be a multiple of 256 and x's columns must be contiguous, "
                         f"got shape {tuple(x.shape)}, strides {x.stride()}")
    grouping = small_grouping(expert_ids, expert_offset, num_experts, block_m)
    ordered = torch.empty(num_rows, num_cols, dtype=x.dtype, device=x.device)
    copies = triton.cdiv(num_rows, COPY_ROWS) * triton.cdiv(num_cols, COPY_COLUMNS)
    _group_pairs_and_columns_kernel[(1 + copies,)](*grouping.args, x, ordered, num_rows, num_cols, x.stride(0),
                                                   ordered.stride(0), **grouping.constexprs, COALESCED_X=coalesced_x,
                                                   COALESCED_W=coalesced_w, ROWS=COPY_ROWS, COLUMNS=COPY_COLUMNS,
                                                   num_warps=grouping_warps(grouping.constexprs["P_BLOCK"]))
    return grouping.blocks, ordered
