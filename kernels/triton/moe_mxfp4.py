"""Grouped expert GEMMs with MXFP4 weights (W4A16): the packed codes and E8M0 scales are read as they are stored and
dequantised in registers, so each weight byte crosses memory once and no dense copy ever exists.

The structure is the bf16 kernels' (`kernels.triton.moe_experts`): the (token, choice) pairs grouped by local
expert into BLOCK_M-row blocks (`kernels.triton.moe_blocks`), a gate/up kernel with the GLU fused, a down kernel
writing float32 rows, and the shared deterministic combine (`combine_expert_rows`).

Dequantisation: byte j of a row holds the codes of columns 2j (low nibble) and 2j + 1 (high nibble), so a K step
is two half-K dots, the even columns of x against the low nibbles and the odd ones against the high; each kernel
module builds the bf16 (or float32) operands its own way (`kernels.triton.moe_mxfp4_xwt` in float32 bits,
`moe_mxfp4_operands` and the Gluon kernels in PTX).

Numerics in bf16: the expert hidden (the GLU output) is stored in x's dtype between the two GEMMs, so a bf16 call
rounds it to bf16 (2^-9 relative) before the down GEMM; the float64 oracle (`kernels.torch.moe_mxfp4`) does not,
and the conformance tolerance covers that rounding for hidden values of O(1).

Variants, chosen per call by `Mxfp4Tile` (`mxfp4_tile`): the x W^T kernels of `kernels.triton.moe_mxfp4_xwt`; the
swap-AB kernels of `kernels.triton.moe_mxfp4_swap` (weight tile as the dot's first operand, which wgmma can take from
registers: `swap`), optionally with x loaded contiguously and split (`split_x`), x reordered [even | odd] per K step
before the kernels read it (`presplit`), gate and up rows stacked in one weight tile (`stacked`), or with
`tl.dot_scaled` on the packed bytes (`scaled`, bf16 / fp16 only; the default on sm_100 and gfx950); the Gluon
kernels of `moe_mxfp4_gluon` (`gluon`: mma.sync, decode sizes) and `moe_mxfp4_wgmma` (`wgmma`: prefill sizes, x in
`kappa_columns` order); and the dot-free
decode kernels of `kernels.triton.moe_mxfp4_gemv` (`gemv`: float32 multiply-adds over 1-16 rows per block, int32 word
loads, one scale multiply per 8 weights). `bench.moe_mxfp4_sweep` checks and times them on the GPU and prints the
winners for `MXFP4_TILES_NVIDIA` (`kernels.triton.moe_mxfp4_tiles`, whose names this module re-exports).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from kernels.torch.moe_mxfp4 import check_mxfp4_experts
from kernels.triton.activation import check_activation
from kernels.triton.moe_blocks import ExpertBlocks, group_pairs_by_expert, one_program, split_tail_pairs
from kernels.triton.moe_experts import combine_expert_rows, combine_operands
from kernels.triton.moe_mxfp4_gemv import _down_gemv_kernel, _gate_up_gemv_kernel
from kernels.triton.moe_mxfp4_prologue import copies_columns, group_pairs_and_columns
from kernels.triton.moe_mxfp4_swap import FOLD_MAX_SCALE, _down_swap_kernel, _gate_up_swap_kernel
from kernels.triton.moe_mxfp4_tiles import (  # noqa: F401  (the tile names are part of this module's API)
    DOT_SCALED_ARCHES, INTERPRETER_TILE, MXFP4_ROW_CLASSES, MXFP4_TAIL_TILES_NVIDIA, MXFP4_TILES_DOT_SCALED,
    MXFP4_TILES_NVIDIA, SCALE_BLOCK, SWAP_DECODE_TILE_NVIDIA, SWAP_TILES_NVIDIA, Mxfp4Tile, check_tile, mxfp4_row_class,
    mxfp4_tail_tile, mxfp4_tile)
from kernels.triton.moe_mxfp4_xwt import _down_kernel, _gate_up_kernel
from kernels.triton.tuning_ops import nvidia_capability, target

PAIR_BUFFER_BYTES = 1 << 30


def _scaled(tile: Mxfp4Tile, scale_fold: bool) -> dict:
    """The swap kernels' decode switches (SCALE_FOLD: the decode's own decodes only, not tl.dot_scaled's)."""
    return ({"SCALED": tile.scaled, "HALF_MATH": tile.half_math, "ASM_DECODE": tile.asm_decode,
             "SCALE_FOLD": scale_fold and not tile.scaled, "NATURAL_K": tile.natural_k,
             "PRESPLIT": tile.presplit} if tile.swap else {})


def _tail(tile: Mxfp4Tile) -> dict:
    """The swap kernels' TAIL_M (rows past BLOCK_M in each block; passed only when set)."""
    return {"TAIL_M": tile.tail_m} if tile.tail_m else {}


def _even_n(tile: Mxfp4Tile, columns: int, program_columns: int) -> dict:
    """The swap gate/up kernel's EVEN_N: every program's columns of I are real (`columns` a multiple of the
    program's), so its weight loads carry no row mask (offline sm_90, K3's 64-token loop: 518 -> 492 instructions a
    K step at the same 128 registers; 521 -> 512 us on an H100). Not for the down kernel: without the mask on both
    its byte and scale loads ptxas waits on each of its wgmma alone; on its byte loads alone (8d60a97, reverted) it
    was no faster on an H100 and needed 8 bytes of stack on sm_100 with a tail part. Passed only when true (the
    kernel's default is the masked form)."""
    return {"EVEN_N": True} if tile.swap and columns % program_columns == 0 else {}


def _registers(tile: Mxfp4Tile, device: torch.device, down: bool = False) -> dict:
    """The launch's register cap (`Mxfp4Tile.maxnreg`, or for the `down` kernel `down_maxnreg` where it is set): an
    NVIDIA compile option, refused elsewhere rather than dropped (the interpreter runs the kernels whatever their
    registers, so it takes the tile as it is)."""
    cap = (tile.down_maxnreg or tile.maxnreg) if down else tile.maxnreg
    if not cap:
        return {}
    where = target(device)
    if where == "interpreter":
        return {}
    if where != "nvidia":
        raise ValueError(f"moe_experts_mxfp4: maxnreg is a ptxas option (NVIDIA); this device is {where}: use a tile "
                         f"with maxnreg=0 and down_maxnreg=0, got {tile}")
    return {"maxnreg": cap}


def scale_fold(max_scale: int | None) -> bool:
    """Whether a call's scale bound lets the swap kernels fold their decode constant into the scale."""
    if max_scale is None:
        return False
    if isinstance(max_scale, bool) or not isinstance(max_scale, int) or not 0 <= max_scale <= 255:
        raise ValueError(f"moe_experts_mxfp4: max_scale must be None or a scale byte 0-255, got {max_scale!r}")
    return max_scale <= FOLD_MAX_SCALE


def _check_dtype(tile: Mxfp4Tile, x: torch.Tensor) -> None:
    if tile.half_math and x.dtype != torch.bfloat16:
        raise ValueError(f"moe_experts_mxfp4: half_math decodes to bf16 and needs bf16 activations, got {x.dtype}; "
                         "use a tile with half_math=False")
    if tile.asm_decode and (x.dtype != torch.bfloat16 or target(x.device) != "nvidia"):
        raise ValueError(f"moe_experts_mxfp4: asm_decode is NVIDIA PTX decoding to bf16: it needs bf16 activations "
                         f"on an NVIDIA GPU, got {x.dtype} on {target(x.device)}; use a tile with asm_decode=False")


class Combine(NamedTuple):
    """What a streamed pair's down kernel needs to write the op's output itself (`combine_expert_rows`'
    arguments but the rows)."""
    out: torch.Tensor              # [T, D], x's dtype: the call's (chunk's) output
    weights: torch.Tensor          # [T, k] routing weights
    expert_ids: torch.Tensor       # [T, k] global expert ids
    expert_offset: int

    def flat(self) -> tuple:
        """(weights, expert_ids, expert_offset) as the combine reads them (`combine_operands`)."""
        return (*combine_operands(self.weights, self.expert_ids), self.expert_offset)


def _gate_up_args(x, packed, scale, hidden, blocks: ExpertBlocks, num_experts: int, hidden_dim: int, inter_dim: int,
                  situ_beta, situ_linear_beta) -> tuple:
    """The leading arguments every gate/up kernel takes (swap, x W^T, gemv with `packed` as words, gluon)."""
    return (x, packed, scale, hidden, blocks.sorted_pairs, blocks.block_experts, x.stride(0), packed.stride(0),
            packed.stride(1), scale.stride(0), scale.stride(1), hidden.stride(0), blocks.row_of_pair.numel(),
            num_experts, hidden_dim, inter_dim, float(situ_beta if situ_beta is not None else 1.0),
            float(situ_linear_beta) if situ_linear_beta is not None else 1.0)


def _down_args(hidden, packed, scale, rows_out, blocks: ExpertBlocks, num_experts: int, hidden_dim: int,
               inter_dim: int) -> tuple:
    """The leading arguments every down kernel takes."""
    return (hidden, packed, scale, rows_out, blocks.sorted_pairs, blocks.block_experts, hidden.stride(0),
            packed.stride(0), packed.stride(1), scale.stride(0), scale.stride(1), rows_out.stride(0),
            blocks.row_of_pair.numel(), num_experts, hidden_dim, inter_dim)


def _check_gluon(tile: Mxfp4Tile, hidden_dim: int, inter_dim: int) -> None:
    """A gluon or wgmma tile runs compiled on an NVIDIA GPU only, with whole K steps (256 or 128 columns) in both
    GEMMs."""
    if hidden_dim % tile.block_k or inter_dim % tile.block_k:
        raise ValueError(f"moe_experts_mxfp4: a {'wgmma' if tile.wgmma else 'gluon'} tile needs D and I multiples of "
                         f"{tile.block_k}, got D={hidden_dim}, I={inter_dim}; use a swap tile")


def _check_staged(tile: Mxfp4Tile, packed: torch.Tensor) -> None:
    """A staged gluon tile (num_stages > 1) copies the packed bytes 16 at a time by cp.async, which needs each
    row's start on a 16-byte boundary."""
    if tile.gluon and tile.num_stages > 1 and (packed.data_ptr() % 16 or packed.stride(0) % 16
                                               or packed.stride(1) % 16):
        raise ValueError(f"moe_experts_mxfp4: a gluon tile with {tile.num_stages} stages copies the packed weights in "
                         f"16-byte pieces; pass weights whose rows start at 16-byte boundaries (e.g. .contiguous()), "
                         f"got strides {packed.stride()} at address {packed.data_ptr()}")


def _check_stream(tile: Mxfp4Tile, counters: torch.Tensor | None) -> None:
    """A stream tile's gate_up and down run as a pair over one counter buffer; other tiles take none."""
    if tile.stream and counters is None:
        raise ValueError("moe_experts_mxfp4: a stream tile runs gate_up and down as a pair over one counter buffer "
                         "(`_stream_counters`); call moe_experts_mxfp4, or pass the same counters to both")
    if counters is not None and not tile.stream:
        raise ValueError(f"moe_experts_mxfp4: counters are a stream tile's, got {tile}")


def _stream_counters(tile: Mxfp4Tile, device: torch.device, num_blocks: int,
                     hidden_dim: int = 0) -> torch.Tensor | None:
    """The streamed pair's counters (`moe_mxfp4_stream.stream_counters`) for a stream tile, else None; `hidden_dim`
    sizes down's column blocks. The pair's down kernel is a programmatic dependent launch: NVIDIA sm_90+."""
    if not tile.stream:
        return None
    if target(device) != "nvidia" or nvidia_capability(device)[0] < 9:
        raise ValueError(f"moe_experts_mxfp4: a stream tile needs programmatic dependent launch (NVIDIA sm_90+), "
                         f"this device is {target(device)}; use a tile with stream=False")
    from kernels.triton.moe_mxfp4_stream import stream_counters  # noqa: PLC0415 (Gluon: NVIDIA only)
    return stream_counters(device, num_blocks, triton.cdiv(hidden_dim, tile.down_block_n or tile.block_n))


def _words(packed: torch.Tensor) -> torch.Tensor:
    """The packed codes [E, N, K/2] as int32 words [E, N, K/8] (the gemv kernels' loads), without a copy."""
    if packed.storage_offset() % 4 or any(stride % 4 for stride in packed.stride()[:-1]):
        raise ValueError(f"moe_experts_mxfp4: a gemv tile reads the packed codes as int32 words; pass packed "
                         f"weights whose rows start at 4-byte boundaries (e.g. .contiguous()), got strides "
                         f"{packed.stride()} at offset {packed.storage_offset()}")
    return packed.view(torch.int32)


def presplit_columns(t: torch.Tensor, block_k: int) -> torch.Tensor:
    """[R, K] -> [R, Kp], Kp = K rounded up to block_k (zero columns past K): each block_k columns reordered as
    [the even ones | the odd ones], the order a presplit tile's kernels read x and hidden in."""
    rows, num_k = t.shape
    padded = triton.cdiv(num_k, block_k) * block_k
    if padded != num_k:
        t = torch.nn.functional.pad(t, (0, padded - num_k))
    return t.reshape(rows, padded // block_k, block_k // 2, 2).transpose(2, 3).reshape(rows, padded)


def _hidden_width(inter_dim: int, tile: Mxfp4Tile) -> int:
    """Columns of gate_up's hidden: I, or I rounded up to block_k in presplit order (a wgmma tile's I is a
    multiple of block_k, in `moe_mxfp4_wgmma.kappa_columns` order)."""
    return triton.cdiv(inter_dim, tile.block_k) * tile.block_k if tile.presplit else inter_dim


def gate_up(x: torch.Tensor, w13_packed: torch.Tensor, w13_scale: torch.Tensor, blocks: ExpertBlocks, top_k: int,
            activation: str, situ_beta: float | None, situ_linear_beta: float | None,
            tile: Mxfp4Tile, fold: bool = False, counters: torch.Tensor | None = None,
            ordered: bool = False) -> torch.Tensor:
    """act(x W13^T) for every sorted row -> [num_blocks * block_m, I] in x.dtype (padding rows left unwritten).
    `fold`: every scale byte is <= FOLD_MAX_SCALE (`scale_fold`). `counters`: a stream tile's, shared with the
    `down` call that must follow (`_stream_counters`). `ordered`: x is already in a prologue tile's column order
    (`group_pairs_and_columns`: a gluon tile's, or a presplit swap tile's at block_k 256)."""
    check_tile(tile)
    if ordered and not tile.prologue:
        raise ValueError(f"moe_experts_mxfp4: x in the Gluon kernels' column order is for a prologue tile, got {tile}")
    _check_stream(tile, counters)
    if tile.scaled and x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"moe_experts_mxfp4: tl.dot_scaled takes bf16 or fp16 activations, got {x.dtype}; use a "
                         "tile with scaled=False")
    _check_dtype(tile, x)
    num_experts, two_inter, _ = w13_packed.shape
    inter_dim, hidden_dim = two_inter // 2, x.shape[1]
    num_blocks = blocks.block_experts.numel()
    width = _hidden_width(inter_dim, tile)
    # presplit with I not a multiple of block_k: the columns past I are read by down (against zero weights), so
    # they must be finite
    alloc = torch.zeros if width != inter_dim else torch.empty
    hidden = alloc(num_blocks * tile.height, width, dtype=x.dtype, device=x.device)     # [P_pad, I] (or padded)
    if tile.wgmma:
        _check_gluon(tile, hidden_dim, inter_dim)
        from kernels.triton.moe_mxfp4_wgmma import gate_up_wgmma, kappa_columns  # noqa: PLC0415 (NVIDIA only)
        gate_up_wgmma(_gate_up_args(kappa_columns(x), w13_packed, w13_scale, hidden, blocks, num_experts, hidden_dim,
                                    inter_dim, situ_beta, situ_linear_beta),
                      (num_blocks, inter_dim // 32), top_k, activation, situ_linear_beta is not None, tile.block_m,
                      tile.tail_m, tile.num_stages, fold, _registers(tile, x.device))
        return hidden
    if tile.gluon:
        _check_gluon(tile, hidden_dim, inter_dim)
        _check_staged(tile, w13_packed)
        from kernels.triton.moe_mxfp4_gluon import gate_up_gluon, kernel_shape  # noqa: PLC0415 (NVIDIA only)
        from kernels.triton.moe_mxfp4_gluon_operands import gluon_columns  # noqa: PLC0415
        x = x if ordered else gluon_columns(x, tile.coalesced_x, tile.coalesced_w)
        gate_up_gluon(_gate_up_args(x, w13_packed, w13_scale, hidden, blocks, num_experts, hidden_dim, inter_dim,
                                    situ_beta, situ_linear_beta),
                      num_blocks, inter_dim, top_k, activation, situ_linear_beta is not None, tile.block_m,
                      tile.block_n, fold, kernel_shape(tile), counters, _registers(tile, x.device))
        return hidden
    if tile.presplit and not ordered:
        x = presplit_columns(x, tile.block_k)
    if tile.gemv:
        _gate_up_gemv_kernel[(num_blocks, triton.cdiv(inter_dim, tile.block_n))](
            *_gate_up_args(x, _words(w13_packed), w13_scale, hidden, blocks, num_experts, hidden_dim, inter_dim,
                           situ_beta, situ_linear_beta),
            TOP_K=top_k, IS_SITU=activation == "situ", HAS_LINEAR_CLIP=situ_linear_beta is not None,
            BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
            EVEN_K=hidden_dim % tile.block_k == 0, PREFETCH=tile.prefetch, num_warps=tile.num_warps,
            num_stages=tile.num_stages, **_registers(tile, x.device))
        return hidden
    kernel = _gate_up_swap_kernel if tile.swap else _gate_up_kernel
    stacked = {"STACKED": True} if tile.stacked else {}
    kernel[(num_blocks, triton.cdiv(inter_dim, tile.block_n // 2 if tile.stacked else tile.block_n))](
        *_gate_up_args(x, w13_packed, w13_scale, hidden, blocks, num_experts, hidden_dim, inter_dim, situ_beta,
                       situ_linear_beta),
        TOP_K=top_k, IS_SITU=activation == "situ", HAS_LINEAR_CLIP=situ_linear_beta is not None,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, EVEN_K=hidden_dim % tile.block_k == 0,
        SPLIT_X=tile.split_x, num_warps=tile.num_warps, num_stages=tile.num_stages, **_scaled(tile, fold), **stacked,
        **_tail(tile), **_even_n(tile, inter_dim, tile.block_n // 2 if tile.stacked else tile.block_n),
        **_registers(tile, x.device))
    return hidden


def down(hidden: torch.Tensor, w2_packed: torch.Tensor, w2_scale: torch.Tensor, blocks: ExpertBlocks,
         tile: Mxfp4Tile, fold: bool = False, rows_out: torch.Tensor | None = None,
         counters: torch.Tensor | None = None, combine: Combine | None = None) -> torch.Tensor:
    """hidden W2^T for every sorted row -> [num_blocks * block_m, D] float32 (padding rows left unwritten), into
    `rows_out` when given (a contiguous float32 view of that shape). `counters`: a stream tile's, the ones the
    `gate_up` call just before counted into. `combine` (a fold_combine tile's only): the down kernel also writes
    `combine.out`, what `combine_expert_rows` would from the rows."""
    check_tile(tile)
    _check_stream(tile, counters)
    if combine is not None and not tile.fold_combine:
        raise ValueError(f"moe_experts_mxfp4: only a fold_combine tile's down kernel combines the rows, got {tile}")
    _check_dtype(tile, hidden)
    num_experts, hidden_dim, half_inter = w2_packed.shape
    inter_dim = 2 * half_inter
    width = _hidden_width(inter_dim, tile)
    if hidden.shape[1] != width:
        raise ValueError(f"moe_experts_mxfp4: hidden must be gate_up's output for this tile: {width} columns for "
                         f"I={inter_dim}, got {hidden.shape[1]}")
    num_blocks = blocks.block_experts.numel()
    if rows_out is None:
        rows_out = torch.empty(num_blocks * tile.height, hidden_dim, dtype=torch.float32, device=hidden.device)
    elif rows_out.shape != (num_blocks * tile.height, hidden_dim) or rows_out.dtype != torch.float32:
        raise ValueError(f"moe_experts_mxfp4: rows_out must be float32 {(num_blocks * tile.height, hidden_dim)}, "
                         f"got {rows_out.dtype} {tuple(rows_out.shape)}")
    block_n = tile.down_block_n or tile.block_n                        # output columns (of D) per program
    if tile.wgmma:
        _check_gluon(tile, hidden_dim, inter_dim)
        from kernels.triton.moe_mxfp4_wgmma import down_wgmma  # noqa: PLC0415 (Gluon: NVIDIA only)
        down_wgmma(_down_args(hidden, w2_packed, w2_scale, rows_out, blocks, num_experts, hidden_dim, inter_dim),
                   (triton.cdiv(hidden_dim, 64) * num_blocks,), tile.block_m, tile.tail_m, tile.num_stages, fold,
                   _registers(tile, hidden.device, down=True))
        return rows_out
    if tile.gluon:
        _check_gluon(tile, hidden_dim, inter_dim)
        _check_staged(tile, w2_packed)
        from kernels.triton.moe_mxfp4_gluon import down_gluon, kernel_shape  # noqa: PLC0415 (Gluon: NVIDIA only)
        down_gluon(_down_args(hidden, w2_packed, w2_scale, rows_out, blocks, num_experts, hidden_dim, inter_dim),
                   num_blocks, hidden_dim, tile.block_m, block_n, tile.block_n, fold, kernel_shape(tile), counters,
                   _registers(tile, hidden.device, down=True),
                   None if combine is None else (combine.out, blocks.row_of_pair, *combine.flat()))
        return rows_out
    if tile.gemv:
        _down_gemv_kernel[(num_blocks, triton.cdiv(hidden_dim, block_n))](
            *_down_args(hidden, _words(w2_packed), w2_scale, rows_out, blocks, num_experts, hidden_dim, inter_dim),
            BLOCK_M=tile.block_m, BLOCK_N=block_n, BLOCK_K=tile.block_k,
            EVEN_K=inter_dim % tile.block_k == 0, PREFETCH=tile.prefetch, num_warps=tile.num_warps,
            num_stages=tile.num_stages, **_registers(tile, hidden.device, down=True))
        return rows_out
    col_blocks = triton.cdiv(hidden_dim, block_n)
    # the swap kernel's grid: one axis, column blocks fastest (`_down_swap_kernel`: a row block's programs share its
    # hidden in L2)
    grid = (col_blocks * num_blocks,) if tile.swap else (num_blocks, col_blocks)
    kernel = _down_swap_kernel if tile.swap else _down_kernel
    kernel[grid](
        *_down_args(hidden, w2_packed, w2_scale, rows_out, blocks, num_experts, hidden_dim, inter_dim),
        BLOCK_M=tile.block_m, BLOCK_N=block_n, BLOCK_K=tile.block_k, EVEN_K=inter_dim % tile.block_k == 0,
        SPLIT_X=tile.split_x, num_warps=tile.num_warps, num_stages=tile.num_stages, **_scaled(tile, fold),
        **_tail(tile), **_registers(tile, hidden.device, down=True))
    return rows_out


def moe_experts_mxfp4(x: torch.Tensor, w13_packed: torch.Tensor, w13_scale: torch.Tensor, w2_packed: torch.Tensor,
                      w2_scale: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, activation: str,
                      situ_beta: float | None, situ_linear_beta: float | None,
                      expert_offset: int = 0, *, max_scale: int | None = None,
                      tile: Mxfp4Tile | None = None, tail_tile: Mxfp4Tile | None = None) -> torch.Tensor:
    """The op (see `kernels.torch.moe_mxfp4`); `tile` (and `tail_tile`) fix the launch shapes (sweeps and tests),
    else `mxfp4_tile` and `mxfp4_tail_tile` pick them per token chunk. With a tail tile each expert's rows past its
    whole `tile` blocks run in `tail_tile` blocks (`split_tail_pairs`). `max_scale` (a bound on every scale byte,
    trusted: checking it here would cost a host sync per call) at most FOLD_MAX_SCALE lets the swap kernels fold
    their decode constant."""
    check_activation(activation, situ_beta)
    fold = scale_fold(max_scale)
    hidden_dim, _ = check_mxfp4_experts(x, w13_packed, w13_scale, w2_packed, w2_scale, weights, expert_ids)
    x, w13_packed, w13_scale, w2_packed, w2_scale = (
        t if t.stride(-1) == 1 else t.contiguous() for t in (x, w13_packed, w13_scale, w2_packed, w2_scale))
    expert_ids = expert_ids.long().contiguous()
    num_tokens, num_experts = x.shape[0], w13_packed.shape[0]
    out = torch.empty(num_tokens, hidden_dim, dtype=x.dtype, device=x.device)            # [T, D]
    if num_tokens == 0 or expert_ids.shape[1] == 0:
        return out.zero_()
    top_k = expert_ids.shape[1]
    chunk = max(1, PAIR_BUFFER_BYTES // (top_k * hidden_dim * 4))
    for start in range(0, num_tokens, chunk):
        end = min(num_tokens, start + chunk)
        ids = expert_ids[start:end]
        chunk_tile = tile or mxfp4_tile(x.device, ids.numel(), num_experts, x.element_size(), x.dtype,
                                        (hidden_dim, 2 * w2_packed.shape[2]))
        chunk_tail = tail_tile if tile is not None else mxfp4_tail_tile(x.device, chunk_tile, ids.numel(),
                                                                         num_experts, x.dtype)
        args = (x[start:end], w13_packed, w13_scale, w2_packed, w2_scale, top_k, activation, situ_beta,
                situ_linear_beta, fold)
        if chunk_tail is None and chunk_tile.fold_combine:   # the streamed pair's down kernel combines
            _one_height_rows(*args, ids, expert_offset, num_experts, chunk_tile,
                             Combine(out[start:end], weights[start:end], ids, expert_offset))
            continue
        if chunk_tail is None:
            rows_out, row_of_pair = _one_height_rows(*args, ids, expert_offset, num_experts, chunk_tile)
        else:
            rows_out, row_of_pair = _two_height_rows(*args, ids, expert_offset, num_experts, chunk_tile, chunk_tail)
        combine_expert_rows(rows_out, row_of_pair, weights[start:end], ids, expert_offset, num_experts,
                            out[start:end])
    return out


def _one_height_rows(x, w13_packed, w13_scale, w2_packed, w2_scale, top_k, activation, situ_beta,
                     situ_linear_beta, fold, expert_ids, expert_offset: int, num_experts: int,
                     tile: Mxfp4Tile, combine: Combine | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Both GEMMs over blocks of `tile`'s height: the rows and each pair's row in them (and with `combine`, a
    fold_combine tile's, their weighted sum in `combine.out`). A prologue tile groups the pairs and orders x in one
    launch where the grouping is the one-program kernel (and for a swap tile, x's columns are whole 256-column steps
    and contiguous: otherwise gate_up pads and orders x itself); gate_up orders x otherwise."""
    ordered = tile.prologue and one_program(expert_ids.numel(), num_experts) and (tile.gluon or copies_columns(x))
    if ordered and tile.gluon:
        _check_gluon(tile, x.shape[1], 2 * w2_packed.shape[2])
    if ordered:
        blocks, x = group_pairs_and_columns(expert_ids, expert_offset, num_experts, tile.height, x, tile.coalesced_x,
                                            tile.coalesced_w)
    else:
        blocks = group_pairs_by_expert(expert_ids, expert_offset, num_experts, tile.height)
    rows_out = _expert_rows(x, w13_packed, w13_scale, w2_packed, w2_scale, top_k, activation, situ_beta,
                            situ_linear_beta, fold, blocks, tile, ordered=ordered, combine=combine)
    return rows_out, blocks.row_of_pair


def _expert_rows(x, w13_packed, w13_scale, w2_packed, w2_scale, top_k, activation, situ_beta, situ_linear_beta,
                 fold, blocks: ExpertBlocks, tile: Mxfp4Tile, rows_out: torch.Tensor | None = None,
                 ordered: bool = False, combine: Combine | None = None) -> torch.Tensor:
    counters = _stream_counters(tile, x.device, blocks.block_experts.numel(), w2_packed.shape[1])
    hidden = gate_up(x, w13_packed, w13_scale, blocks, top_k, activation, situ_beta, situ_linear_beta, tile, fold,
                     counters, ordered)
    return down(hidden, w2_packed, w2_scale, blocks, tile, fold, rows_out, counters, combine)


def _two_height_rows(x, w13_packed, w13_scale, w2_packed, w2_scale, top_k, activation, situ_beta,
                     situ_linear_beta, fold, expert_ids, expert_offset: int, num_experts: int, tile: Mxfp4Tile,
                     tail_tile: Mxfp4Tile) -> tuple[torch.Tensor, torch.Tensor]:
    """Both GEMMs over the whole blocks in `tile` and the tails in `tail_tile`, into one row buffer (whole rows
    first): the rows and each pair's row in it."""
    whole_ids, tail_ids = split_tail_pairs(expert_ids, expert_offset, num_experts, tile.height)
    whole = group_pairs_by_expert(whole_ids, expert_offset, num_experts, tile.height)
    tail = group_pairs_by_expert(tail_ids, expert_offset, num_experts, tail_tile.height)
    whole_rows = whole.block_experts.numel() * tile.height
    rows_out = torch.empty(whole_rows + tail.block_experts.numel() * tail_tile.height, w2_packed.shape[1],
                           dtype=torch.float32, device=x.device)
    args = (x, w13_packed, w13_scale, w2_packed, w2_scale, top_k, activation, situ_beta, situ_linear_beta, fold)
    _expert_rows(*args, whole, tile, rows_out[:whole_rows])
    _expert_rows(*args, tail, tail_tile, rows_out[whole_rows:])
    # a pair is in exactly one side; the other side marks it with its own capacity (past its rows)
    row_of_pair = torch.where(whole.row_of_pair < whole_rows, whole.row_of_pair, whole_rows + tail.row_of_pair)
    return rows_out, row_of_pair
