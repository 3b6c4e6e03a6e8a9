"""The streamed gate/up -> down pair of the Gluon MXFP4 decode kernels (a gluon tile's `stream` option; STREAM in
`kernels.triton.moe_mxfp4_gluon`): the counters and the synchronisation the two kernels share.

Why. At one token K3's gate/up grid is 1536 programs over 924 slots (1.66 waves) and the down kernel waits for
all of it, so the last partial wave of gate/up and the first of down each run the SMs part-empty
(bench/results/ncu-moe_mxfp4-gluon-386fccf.txt: gate/up at 60% of DRAM peak, down at 47.5%). Launching down
with programmatic dependent launch alone (waiting for the whole of gate/up with griddepcontrol.wait) bought at
most 2%. Here each down program waits only for its own row block's gate/up programs, so down's work fills the
slots gate/up's tail leaves.

Order. gate/up's grid is (column, block): CUDA starts programs x-fastest (the usual order; the protocol does not
rely on it), so each block's programs (96 at 64 rows a program) run together and blocks finish one after another.
Each gate/up program stores its hidden, meets the CTA barrier, and one thread adds 1 to its block's counter with
release semantics at GPU scope; a down program's thread polls its block's counter with acquire semantics until it
reaches the block's gate/up program count (I / (ROWS / 2)), and the barrier that hands the value to the CTA orders
every thread's hidden loads after it (the PTX memory model's release / acquire through a barrier, as CUTLASS's
split-K semaphore uses).

No deadlock. The down kernel is launched with programmatic dependent launch, so none of its programs starts
before every gate/up program has started (each signals launch_dependents first): every program a down program
can wait for is already running and waits for nothing. Without PDL the launch is an ordinary stream-ordered
one and every count is complete before down starts. A poll that outlives `SPIN_LIMIT` naps (about a second)
traps, so a broken invariant fails the launch loudly rather than hanging or reading a half-written hidden.

Reset. A block has two counters: its finished gate/up programs and its counted-out down programs. Each down
program of a busy block counts itself out after its wait (acquire-release), and the block's last one zeroes
both: every down program of the block had seen the full gate/up count before counting out, and no gate/up
program of this call is left to count. Idle blocks are never counted. The next call's gate/up is an ordinary
launch after this kernel, so it sees the zeros. The counters (`stream_counters`) are one buffer per device and
stream, zeroed once when made. No counter is shared by the whole grid: an address takes one block's gate/up
increments or down count-outs and the polls of that block's down programs, or (below) the arrivals of one column
block's down programs.

Combine. With a fold_combine tile the down kernel also does the pair's weighted sum over each token's choices (what
`moe_experts.combine_expert_rows` does as its own launch after down, 4.8 us of K3's 102.8 us one-token call on the
H200 at 85fe60b: a launch gap and a grid of four programs, with nothing else running). Every down program of a
column block, busy or idle, stores its rows, meets the CTA barrier and makes one acquire-release increment of the
column block's counter; the one that brings it to the grid's row-block count is the last, sees every other
program's rows, zeroes the counter for the next call and sums the column block's columns for every token, choice
by choice in the order j = 0..k-1 in float32 as the combine kernel does. The column counters sit past the row
blocks' pairs in the same buffer, so `check_invariants` covers them.

First run on the H200 at 8eaf6f9 (bench/results/moe-mxfp4-stream-nvidia-h200.*): checked against float64, the
extreme scales, a repeated call and the zeroed counters, then 2.51x the bf16 experts at one token against 2.42x
unstreamed in the same run; both Gluon decode classes use it since.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

SPIN_LIMIT: gl.constexpr = gl.constexpr(1 << 22)  # polls of ~0.25 us naps: about a second, far past gate/up's life


@gluon.jit
def _asm(ASM: gl.constexpr):
    """One PTX statement with no operands (griddepcontrol, nanosleep, trap), kept in place (not pure)."""
    gl.inline_asm_elementwise(ASM + " // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _release_count(counter_ptr):
    """Add 1 to the counter once for the CTA, after every thread's stores (release at GPU scope)."""
    gl.thread_barrier()
    gl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")


@gluon.jit
def _await_count(counter_ptr, need):
    """Wait until the counter reaches `need` (acquire at GPU scope: what each increment released is visible)."""
    seen = gl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    polls = 0
    while seen < need:
        _asm("nanosleep.u32 256;")
        polls += 1
        if polls > SPIN_LIMIT:
            _asm("trap;")
        seen = gl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")


COMBINE_TOKENS: gl.constexpr = gl.constexpr(8)  # tokens a combine round holds: [8, columns] over 128 threads


@gluon.constexpr_function
def _combine_layout(columns):
    """[COMBINE_TOKENS tokens, columns (64 or 128)] over 4 warps, each thread a run of one token's columns."""
    return gl.BlockedLayout([1, columns // 16], [2, 16], [4, 1], [1, 0])


@gluon.jit
def _combine_when_last(counter_ptr, row_blocks, rows_ptr, rows_row_stride, row_of_pair_ptr, weights_ptr,
                       expert_ids_ptr, out_ptr, out_row_stride, num_tokens, expert_offset, num_experts, col_start,
                       hidden_dim, TOP_K: gl.constexpr, COLUMNS: gl.constexpr):
    """Count this down program into its column block (`counter_ptr`); the block's last of `row_blocks` programs
    zeroes the counter and writes out[t, cols] = sum_j weights[t, j] * rows[row_of_pair[t * k + j], cols] for
    every token, over the pairs whose expert is local, in float32 in the order j = 0..k-1 (this module's notes),
    COMBINE_TOKENS tokens a round with every choice's loads in flight at once (a loop over the choices, one
    token at a time, put one L2 round trip a choice on the call's tail: 8% more time at 16 tokens on an H100)."""
    gl.thread_barrier()                                                # every thread's rows stored before the add
    arrived = gl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == row_blocks - 1:
        gl.store(counter_ptr, 0)
        layout: gl.constexpr = _combine_layout(COLUMNS)
        cols = col_start + gl.arange(0, COLUMNS, layout=gl.SliceLayout(0, layout))
        col_mask = (cols < hidden_dim)[None, :]
        for first in range(0, num_tokens, COMBINE_TOKENS):
            tokens = first + gl.arange(0, COMBINE_TOKENS, layout=gl.SliceLayout(1, layout))
            real = tokens < num_tokens
            acc = gl.zeros([COMBINE_TOKENS, COLUMNS], gl.float32, layout=layout)
            for choice in gl.static_range(TOP_K):
                pair = tokens * TOP_K + choice
                local = gl.load(expert_ids_ptr + pair, mask=real, other=-1) - expert_offset
                mine = real & (local >= 0) & (local < num_experts)
                # a foreign pair's row and weight are never used: its row may be a dump slot
                row = gl.load(row_of_pair_ptr + pair, mask=mine, other=0)
                weight = gl.load(weights_ptr + pair, mask=mine, other=0.0)
                values = gl.load(rows_ptr + row[:, None] * rows_row_stride + cols[None, :],
                                 mask=mine[:, None] & col_mask, other=0.0)
                acc += values * weight[:, None]
            gl.store(out_ptr + tokens[:, None] * out_row_stride + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=real[:, None] & col_mask)


@gluon.jit
def _count_out(block_counters_ptr, col_blocks):
    """Count this down program out of its block (the second counter of the pair); the block's last one zeroes
    both."""
    finished = gl.atomic_add(block_counters_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if finished == col_blocks - 1:
        gl.store(block_counters_ptr, 0)
        gl.store(block_counters_ptr + 1, 0)


_COUNTERS: dict[tuple, torch.Tensor] = {}
MAX_BLOCKS = 65535                                # CUDA's grid y limit
MAX_COLUMN_BLOCKS = 4096                          # down's column blocks (D / its rows a program), counted for combine


def check_invariants(device: torch.device) -> None:
    """Every counter buffer of `device` is zero (the state each streamed pair must leave; syncs with the device).
    The sweep calls it after a stream tile's calls, so a reset that misses fails there rather than in a later
    call's wait."""
    for (where, stream), counters in _COUNTERS.items():
        if where == str(device) and bool(counters.any()):
            left = counters.nonzero().flatten()[:8].tolist()
            raise AssertionError(f"moe_mxfp4_stream: counters of stream {stream:#x} on {where} left non-zero after a "
                                 f"streamed pair, at {left} (below {2 * MAX_BLOCKS}, even: gate/up counts, odd: down "
                                 f"count-outs; from {2 * MAX_BLOCKS}: down's column blocks)")


def stream_counters(device: torch.device, num_blocks: int, column_blocks: int) -> torch.Tensor:
    """int32 [2 MAX_BLOCKS + MAX_COLUMN_BLOCKS]: per row block, its finished gate/up programs and its counted-out
    down programs, then per column block of down its arrived programs (`column_counters`); one buffer per device
    and stream, zero between streamed pairs (this module's notes). A graph capture's stream gets its own, which
    every graph captured on that stream bakes in: two such graphs must not replay at once (the engine replays one
    graph a step on one stream)."""
    if num_blocks > MAX_BLOCKS:
        raise ValueError(f"moe_experts_mxfp4: a stream tile's gate/up grid has the row blocks on its y axis (at most "
                         f"{MAX_BLOCKS}); this call has {num_blocks}: use a tile with stream=False")
    if column_blocks > MAX_COLUMN_BLOCKS:
        raise ValueError(f"moe_experts_mxfp4: a stream tile's down kernel counts at most {MAX_COLUMN_BLOCKS} column "
                         f"blocks; this call has {column_blocks} (D over the tile's rows a program): use wider "
                         f"programs or a tile with stream=False")
    if device.type != "cuda":                     # an offline capture (backends.offline): recorded, never run
        return torch.zeros(2 * num_blocks + MAX_COLUMN_BLOCKS, dtype=torch.int32, device=device)
    key = (str(device), torch.cuda.current_stream(device).cuda_stream)
    counters = _COUNTERS.get(key)
    if counters is None:    # sized once for the largest grid (528 KiB), never replaced: captured graphs keep it
        counters = torch.zeros(2 * MAX_BLOCKS + MAX_COLUMN_BLOCKS, dtype=torch.int32, device=device)
        _COUNTERS[key] = counters
    return counters


def column_counters(counters: torch.Tensor) -> torch.Tensor:
    """The column blocks' counters of a `stream_counters` buffer (its last MAX_COLUMN_BLOCKS)."""
    return counters[-MAX_COLUMN_BLOCKS:]
