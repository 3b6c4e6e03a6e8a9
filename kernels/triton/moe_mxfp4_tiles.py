"""The MXFP4 expert GEMMs' launch shapes: `Mxfp4Tile` (block sizes and kernel variant), the per-device tables by
row class (the H200 sweep winners for sm_90, `tl.dot_scaled` tiles for sm_100 / gfx950, the interpreter's wide
tile), the choice per call (`mxfp4_tile`, `mxfp4_tail_tile`) and the checks that refuse a tile whose options cannot
apply (`check_tile`). The kernels are in `kernels.triton.moe_mxfp4` and its swap / gemv modules.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from kernels.triton.tuning_ops import current_arch, target

SCALE_BLOCK = 32                   # columns per E8M0 scale


class Mxfp4Tile(NamedTuple):
    """Launch shape of both GEMMs: rows per block (one expert each), output columns and K columns per step."""
    block_m: int
    block_n: int
    block_k: int                   # a multiple of 2 * SCALE_BLOCK: each half-step covers whole scale groups
    num_warps: int
    num_stages: int
    swap: bool = False             # the weight as the dot's first operand (`kernels.triton.moe_mxfp4_swap`)
    split_x: bool = False          # swap only: x / hidden read as contiguous rows and split into even / odd k
    scaled: bool = False           # swap only: `tl.dot_scaled` on the packed bytes (bf16 / fp16 activations)
    half_math: bool = False        # swap only, bf16 only: the decode's multiplies in float16 / bf16 pairs
    gemv: bool = False             # no tl.dot: float32 multiply-adds over block_m (1-16) rows, int32 word loads
    #                                and one scale multiply per 8 weights (`kernels.triton.moe_mxfp4_gemv`)
    prefetch: bool = False         # gemv only: the next K step's weight words loaded before this step's math
    asm_decode: bool = False       # swap only, bf16 on NVIDIA only: the decode in PTX, two codes per bf16x2 multiply
    #                                (`kernels.triton.moe_mxfp4_swap._ASM_PAIR_DECODE`); every sm_90 default since
    #                                the H200 sweeps at a9a24dd and a0961ce
    natural_k: bool = False        # swap only: the decoded halves interleaved back into column order, so x / hidden
    #                                are read as they lie (no even / odd split) and each product is one dot
    presplit: bool = False         # swap only: x and hidden laid out per block_k columns as [even | odd] before the
    #                                kernels read them (x by one gather per call, hidden by gate/up's store), so
    #                                each half-K operand is a contiguous run (cp.async) and no split is needed
    stacked: bool = False          # swap only: a gate/up program covers block_n / 2 columns of I, its weight tile
    #                                their gate rows over their up rows: one dot per half-K step (half the decoded
    #                                tiles held at once); the down kernel ignores it
    tail_m: int = 0                # swap and wgmma: each block is block_m + tail_m rows of one expert and one program
    #                                runs the K loop over both parts, each decoded weight tile feeding a block_m-row
    #                                and a tail_m-row dot (an expert of 90 rows in a 64 + 32 block: one decode, not
    #                                a 64-row block's and a 32-row one's); a block whose tail rows are all padding
    #                                runs the block_m dot alone, one of at most tail_m rows the tail_m dot alone
    #                                (the wgmma kernels skip only an all-padding tail)
    maxnreg: int = 0               # NVIDIA only: ptxas' register cap per thread for both kernels (0: its own
    #                                choice). The sm_90 decode tiles compile to 167 registers, 3 programs of 4
    #                                warps an SM; at 128 they fit 4 with no spill (offline sm_90 SASS)
    gluon: bool = False            # NVIDIA, bf16: both GEMMs as the Gluon mma.sync kernels of
    #                                `kernels.triton.moe_mxfp4_gluon` (operands loaded straight into the MMA's
    #                                registers); needs swap, asm_decode, presplit and stacked, block_m 8 or 16,
    #                                block_n (and down_block_n) 64 or 128 weight rows a program (at 128 each x
    #                                fragment a warp loads feeds two m16 tiles), block_k 256, 4 warps, K and I
    #                                multiples of 256; num_stages 1 (each step's weight bytes loaded when decoded,
    #                                no shared memory) or 2-4 (each thread's weight bytes copied by cp.async
    #                                num_stages - 1 steps ahead through shared memory, no barrier: not yet timed)
    wgmma: bool = False            # NVIDIA sm_90, bf16: both GEMMs as the Gluon wgmma kernels of
    #                                `kernels.triton.moe_mxfp4_wgmma` (the decoded weights as the register operand,
    #                                x rows in shared memory, the next step decoded under this step's MMA); needs
    #                                swap, asm_decode, presplit and stacked, block_m 16-256 (the wgmma's n; with
    #                                tail_m a second wgmma takes the tail rows from the same decoded registers),
    #                                block_n 64, block_k 128, 4 warps, num_stages 3-5 (stages of weight bytes and x
    #                                rows in shared memory, within 224 KiB), K and I multiples of 128; x and hidden
    #                                in `moe_mxfp4_wgmma.kappa_columns` order (sm_90's mid and prefill tiles)
    stream: bool = False           # gluon only, NVIDIA sm_90+: gate/up and down as a streamed pair (gate/up's
    #                                programs block-major, down launched by programmatic dependent launch and each
    #                                program waiting on its own row block's counter, not the whole gate/up grid:
    #                                `kernels.triton.moe_mxfp4_stream`; sm_90's decode tiles)
    down_block_n: int = 0          # the down kernel's output columns per program (0: block_n). At one token K3's
    #                                down GEMM is 16 experts x 56 column blocks of 64 = 896 programs over 396
    #                                slots (3 an SM): 2.26 waves, the last a quarter full
    coalesced_x: bool = False      # gluon only: x and hidden stored so that a quarter warp's 16-byte loads of a token
    #                                are 64 contiguous bytes, not four pieces 64 bytes apart
    #                                (`moe_mxfp4_gluon_operands.gluon_columns`); bit for bit the same products
    coalesced_w: bool = False      # gluon only: each thread's two 16-byte pieces of a weight row 64 bytes apart, so a
    #                                quarter warp's load of a row is 64 contiguous bytes, not four pieces 32 bytes
    #                                apart (x and hidden follow: `moe_mxfp4_gluon_operands._x_layout`)
    half_blocks: bool = False      # gluon, block_m 16 only: a block whose rows 8-15 are all padding runs the 8-row
    #                                product (half the MMAs and x loads); K3 at 64 tokens has 9.1 rows an expert
    #                                on average and about 45% of its experts at 8 or fewer
    prologue: bool = False         # gluon, or swap presplit at block_k 256: the pairs' grouping and x's copy into the
    #                                kernels' column order in one launch, side by side
    #                                (`kernels.triton.moe_mxfp4_prologue`), where the grouping is the one-program
    #                                kernel (<= moe_blocks.SMALL_BATCH_PAIRS pairs) and K is whole 256-column steps;
    #                                bit for bit the same blocks and x (the Gluon kernels' plain order is the presplit
    #                                order at block_k 256)
    fold_combine: bool = False     # stream only: the down kernel writes the op's output itself (each column block's
    #                                last program sums its columns, `kernels.triton.moe_mxfp4_stream`), no combine
    #                                launch after it; bit for bit the combine kernel's sums
    down_maxnreg: int = 0          # NVIDIA only: the down kernel's register cap (0: maxnreg's). On an H100
    #                                (bench/results/moe-mxfp4-x-rows-*) decode_thin's gate/up ran 8% shorter at 80
    #                                registers than at 72 (no spill), its one-token down 20% longer (896 programs:
    #                                one wave at 7 programs an SM, not at 6)

    @property
    def height(self) -> int:
        """Rows per block: block_m, or block_m + tail_m."""
        return self.block_m + self.tail_m


# Tiles by mean rows per expert (the routed rows over the local experts), upper bounds inclusive; None: the rest.
# decode_thin: up to 1 row per expert (K3 at 1-7 tokens), where the down GEMM's grid is at most about one wave;
# decode: up to 5 rows per expert (K3 at 8-35 tokens), where 8-row blocks hold nearly every expert's rows;
# decode_batch: 5-16 (36-112 tokens), where the dot kernels' 16-row blocks are mostly full; mid: 17-64 (K3 at 256
# tokens has 37 per expert); prefill: more
# (K3 at 512 tokens has 73 per expert).
MXFP4_ROW_CLASSES = ((1, "decode_thin"), (5, "decode"), (16, "decode_batch"), (64, "mid"), (None, "prefill"))
# NVIDIA (sm_90) tiles: the winners of `python -m bench.moe_mxfp4_sweep` on the H200 (geometric mean over the
# class's cases, every tile checked against the float64 reference and the extreme scales first), all swap-AB with
# the PTX decode (asm_decode), x presplit and gate/up rows stacked. decode / decode_batch at c4e0f57
# (bench/results/moe-mxfp4-stacked-*.json): 1.77x the bf16 experts at 1 token, 2.06x at 4, 2.14x at 16, 1.94x at
# 64; in the same run the tiles before them (block_k 256 presplit, b4dbadc) gave 1.49x, 1.65x, 1.74x, 1.60x.
# Stacking halves the decoded tiles gate/up holds at once (offline sm_90: 255 registers and 64 B of stack -> 167
# and none, 2 -> 3 programs an SM). mid and prefill at f567062 (moe-mxfp4-tail-m-nvidia-h200.json): blocks with a
# tail part (tail_m), one decode of each weight tile for an expert's block_m + tail_m rows. mid 32+16 rows: 1.12x
# at 256 tokens (37 rows an expert) at K step 128, the 64-row tile before it 1.06x; at K step 256, 2 stages, 2.5%
# faster again in two runs (b0bd8ce, acc5f3c: moe-mxfp4-tail-m-neighbours-nvidia-h200.txt), 1.17-1.19x. prefill
# 64+32 rows, K step 256, 2 stages: 1.01x at 512 tokens (73 rows an expert: nearly every expert one program),
# 0.70x at 1024 (146: two programs); the tiles before it (128-row blocks plus 32-row tail blocks,
# `MXFP4_TAIL_TILES_NVIDIA`) gave 0.69x and 0.63x in the same run. With the down kernel's grid column blocks first
# (acc5f3c) the op bench has it at 1.03x and 0.79x. Lost: 128 + 32 at K step 128 needs 254 registers and, at 3
# stages, 131 KiB of shared memory (one program an SM: 0.44x at 512 tokens); at K step 256, or 128 + 64, the
# offline sm_90 compile spills; 8 warps over 128 stacked rows 0.87x / 0.67x. A rerun prints a `paste:` line per
# class: a swap winner replaces the class's `SWAP_TILES_NVIDIA` entry, a gluon or wgmma winner its
# `MXFP4_TILES_NVIDIA` entry (the swap entry stays as its fallback).
# Register caps (maxnreg) at 752d497 / b3efdb0 (moe-mxfp4-registers*-nvidia-h200.*): the decode tiles at 128
# registers (4 programs an SM instead of 3, no spill) were 1-2% faster in all 8 decode cases of two runs; mid at 168
# (3 programs instead of 2; 40 bytes of stack) 1.30x and 1.33x the bf16 experts at 256 tokens against 1.14x and 1.17x
# uncapped in the same runs. Lost: 96 registers (5 programs, spills) 0.70-0.75x of the uncapped decode tile; 4
# stages; the prefill tiles under a cap (0.85-0.92x of the uncapped one at 512 tokens: shared memory holds them to
# two programs an SM anyway); a 32-column down kernel (down_block_n, mma.sync: 0.70x).
# decode at 12058ee (moe-mxfp4-gluon-nvidia-h200.*): the Gluon mma.sync kernels over 8-row blocks
# (`kernels.triton.moe_mxfp4_gluon`) against the swap tile below, same run: 2.17x / 1.86x the bf16 experts at 1
# token, 2.58x / 2.03x at 4, 2.70x / 2.06x at 8, 2.67x / 2.09x at 16, 2.43x / 1.99x at 32 (4.6 rows an expert), and
# 1.65x / 1.94x at 64 (9.1 rows: two 8-row blocks for most experts, each reading the expert's weights), so the
# decode class ends at 5 rows an expert; at 6.9 (48 tokens, cecbdcd and ee75b11) the two tied within 2%. 16-row
# gluon blocks: 1.75-2.15x.
# decode_thin at 386fccf / cecbdcd (moe-mxfp4-gluon-k-warps-nvidia-h200.*, and unmasked at ee75b11): the decode
# tile capped at 72 registers. Its gate/up kernel compiles to 72 anyway; the down kernel goes from 80 to 72 (16
# bytes of stack), 6 -> 7 programs an SM, and K3's one-token down grid (16 experts x 56 column blocks = 896
# programs) fits one wave of 924. 6% less time at 1 token in both runs (2.37x / 2.23x the bf16 experts), +-1% at 4
# and 8, 1-2.5% more at 16 and 32 (the spill), hence a class of its own.
# wgmma tiles (`kernels.triton.moe_mxfp4_wgmma`, 3f0f6e4..76e2fb7): blocks of up to 256 rows, one decode of each
# weight tile for all of them, the next step decoded under this step's wgmma; first run and adopted for mid and
# prefill at 8eaf6f9 / 7d819a0 (below).
# stream (`kernels.triton.moe_mxfp4_stream`): the decode classes' Gluon pair with down waiting per row block instead
# of at the kernel boundary (the one-token lever the last PDL run left), 72 registers and 7 programs an SM as
# decode_thin's; adopted at 8eaf6f9 (below). Sweep it in a process of its own: a broken protocol traps, which ends
# the process's CUDA context.
# The Gluon (and wgmma) decode after 02b848b: a mask, one multiply and a mask a code pair instead of two shift pairs
# (`moe_mxfp4_gluon_operands._quad_decode_ptx`; bit for bit the same values, checked on every byte, position and extreme
# scale by the PTX interpreter test): offline sm_90 the 8-row gate/up loop is 378 instructions a step against 414,
# at the same registers. The GPU numbers above were taken with the decode it replaced; those below with it.
# 128-row Gluon programs (block_n 128; down_block_n 64 or 128 for the down kernel): each x fragment a warp loads
# feeds two m16 weight tiles, for the L1 pressure the 32-64-token profile showed (x is every warp's B operand).
# Offline sm_90: 128 registers (4 programs an SM) for 8-row blocks, 168 for 16 (128 under a cap, with 24-56 bytes
# of stack); 7% fewer loop instructions per weight row, and x loads per weight byte halved. Run at 8eaf6f9: not
# adopted (below).
# Gluon runs only whole 256-column steps in bf16 (wgmma: 128): other shapes and dtypes take the class's swap tile
# (`SWAP_TILES_NVIDIA`, `mxfp4_tile`).
# half_math and asm_decode decode to bf16: an fp16 call drops both (`mxfp4_tile`) and takes the swap kernel's
# float32 decode.
SWAP_DECODE_TILE_NVIDIA = Mxfp4Tile(block_m=16, block_n=64, block_k=256, num_warps=4, num_stages=3, swap=True,
                                    split_x=False, scaled=False, half_math=False, gemv=False, prefetch=False,
                                    asm_decode=True, natural_k=False, presplit=True, stacked=True, maxnreg=128)
GLUON_DECODE_TILE_NVIDIA = Mxfp4Tile(block_m=8, block_n=64, block_k=256, num_warps=4, num_stages=1, swap=True,
                                     split_x=False, scaled=False, half_math=False, gemv=False, prefetch=False,
                                     asm_decode=True, natural_k=False, presplit=True, stacked=True, gluon=True)
# The swap tile of each class: the class's tile where that is a swap tile, and what a gluon or wgmma entry gives way
# to for a call it cannot take (not bf16, or D / I not whole K steps of its block_k).
SWAP_TILES_NVIDIA: dict[str, Mxfp4Tile] = {
    "decode_thin": SWAP_DECODE_TILE_NVIDIA,
    "decode": SWAP_DECODE_TILE_NVIDIA,
    "decode_batch": SWAP_DECODE_TILE_NVIDIA,
    "mid": Mxfp4Tile(block_m=32, block_n=64, block_k=256, num_warps=4, num_stages=2, swap=True, split_x=False,
                     scaled=False, half_math=False, gemv=False, prefetch=False, asm_decode=True, natural_k=False,
                     presplit=True, stacked=True, tail_m=16, maxnreg=168),
    "prefill": Mxfp4Tile(block_m=64, block_n=64, block_k=256, num_warps=4, num_stages=2, swap=True, split_x=False,
                         scaled=False, half_math=False, gemv=False, prefetch=False, asm_decode=True, natural_k=False,
                         presplit=True, stacked=True, tail_m=32),
}
# The adopted 2026-12-05 sweeps at 8eaf6f9 (bench/results/moe-mxfp4-{wgmma-prefill,rows128,stream}-nvidia-h200.*):
# stream for both Gluon decode classes (1 token 2.51x the bf16 experts against 2.42x unstreamed in the same run, 4
# tokens 2.86x / 2.77x, 16 tokens 2.89x / 2.83x), the wgmma 64 + 32 tile at 4 stages for prefill (16K routed rows
# 0.90x against the swap tile's 0.82x, 8K 1.27x against 1.08x) and 32 + 16 at 4 stages for mid (256 tokens 1.59x
# against 1.42x; bench/results/moe-mxfp4-mid-wgmma-nvidia-h200.*). Not adopted: 128-row Gluon programs (1 token
# 2.13-2.24x against 2.45x, 32 tokens 2.46x against 2.49x, 64 tokens 2.04x with 16-row blocks against the swap
# tile's 2.02x: a tie), and for decode_batch the wgmma 16-row tile (2.04x, the same tie); 128 + 32 and 128 + 64
# prefill blocks (one program an SM: 0.69-0.71x at 16K), 256-row blocks (0.56x).
WGMMA_PREFILL_TILE_NVIDIA = Mxfp4Tile(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=4, swap=True,
                                      asm_decode=True, presplit=True, stacked=True, tail_m=32, wgmma=True)
# The coalesced and staged sweeps at 2365f32 on an H100 (bench/results/moe-mxfp4-{sweep,winners}-nvidia-h100-*;
# `gpu.sh mxfp4-adopt --tiles bench/sweeps/coalesced.json,bench/sweeps/staged.json --tokens 64,1,4,16`): prologue
# (the grouping and x's copy in one launch) adopted for both Gluon decode classes, the best at 1, 4 and 16 tokens
# (3.06x / 3.40x / 3.41x the bf16 experts against 3.00x / 3.38x / 3.40x without it, same run: a small, consistent
# gain). Not adopted: at 64 tokens the incumbent swap tile (3.03x) beat every coalesced_x / coalesced_w /
# half_blocks Gluon tile (2.13-2.74x, 80-register caps worst, 1.88-2.32x) and the 16 x 128 one (2.54x), against
# the L1-wavefront prediction; the staged Gluon K loop (num_stages 2, 3) lost at 1 and 4 tokens (2.01x / 1.84x at
# 1 token, 2.19x / 2.01x at 4). Conformance with the winners: bf16 10/10, fp32 10/10. The H100 reads at 3.0 TB/s
# (copy) against the H200's 4.25, so the same MXFP4 kernel times give it larger ratios over the bf16 experts.
# fold_combine at ec980f8 on an H100 against 1a29702 in the same call (bench/results/moe-mxfp4-fold-*): 1 token
# 0.1211 ms against 0.1243 (-2.6%, the same in a second run), 4 tokens -0.8%, 16 tokens +1.5% (the call to the
# combine gives the 80-register down kernel a stack frame and 5 more instructions a K step; decode_thin's capped
# loop is instruction for instruction unchanged), so decode_thin only.
# The swap gate/up kernel drops its weight row mask wherever I is a multiple of a program's columns (`EVEN_N`, every
# sm_90 swap tile at K3's widths; bench/results/moe-mxfp4-even-n-*, on an H100): at 64 tokens gate/up 521 -> 512 us
# in three calls. The down kernel keeps its mask (`moe_mxfp4._even_n` says why). decode_batch's swap tile takes the
# one-launch prologue (763dabf against 75cdd00: a launch and 3-4 us of kernels fewer a call; the calls moved -1.4% /
# +0.4% at 64 tokens and +1.2% / -0.5% at 48 in two calls each, within the card's spread). Neither measured on an
# H200.
# decode_thin's cap on an H100 at 47ed2c2 (bench/results/moe-mxfp4-x-rows-*, two runs in one call): at 80 registers
# instead of 72 its gate/up kernel is 8% shorter at 1 token and 6% at 4 (no spill), its down kernel 20% longer at 1
# token (896 programs: one wave at 7 programs an SM, two at 6) and 6% shorter at 4; the call +0.3% at 1 token,
# -2.6% at 4. Pending: gate/up at 80 with down at 72 (`down_maxnreg`, bench/sweeps/registers-thin.json).
MXFP4_TILES_NVIDIA: dict[str, Mxfp4Tile] = {
    "decode_thin": GLUON_DECODE_TILE_NVIDIA._replace(maxnreg=72, stream=True, prologue=True, fold_combine=True),
    "decode": GLUON_DECODE_TILE_NVIDIA._replace(stream=True, prologue=True),
    "decode_batch": SWAP_TILES_NVIDIA["decode_batch"]._replace(prologue=True),
    "mid": WGMMA_PREFILL_TILE_NVIDIA._replace(block_m=32, tail_m=16),
    "prefill": WGMMA_PREFILL_TILE_NVIDIA,
}


# Mixed block heights: with more rows an expert on average than a block holds, each expert's rows past its last
# whole block can go to shorter blocks of another tile (`mxfp4_tail_tile`, `moe_blocks.split_tail_pairs`) instead
# of a second block. H200 at 92cbc45, 16K routed rows, 128-row blocks: one height 0.54x the bf16 experts, 32-row
# tail blocks 0.65x. No sm_90 class uses it since the tail_m tiles (f567062), which beat it at both prefill sizes;
# the mechanism stays for sweeps (`--tiles` entries with "tail").
MXFP4_TAIL_TILES_NVIDIA: dict[str, Mxfp4Tile] = {}

# sm_100 and gfx950 (bf16 / fp16 activations): `tl.dot_scaled` on the packed bytes, the brief's "native MXFP4"
# targets. With bf16 activations Triton 3.6 lowers it there by upcasting the e2m1 operand in its own decode
# (fp4_to_fp on sm_100, amdg.scaled_upcast_fp on gfx950, in the offline TTGIR): both MMA operands must be MX
# formats for the native MXFP4 MMA. Compiled offline for both (tests/test_offline_compile.py), never run there;
# its numerics are Triton's on every target and are checked on sm_90 by bench.moe_mxfp4_sweep (scaled tiles).
DOT_SCALED_ARCHES = ("sm_100", "gfx950")
_DOT_SCALED_DECODE = Mxfp4Tile(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3, swap=True, scaled=True)
MXFP4_TILES_DOT_SCALED: dict[str, Mxfp4Tile] = {
    "decode_thin": _DOT_SCALED_DECODE,
    "decode": _DOT_SCALED_DECODE,
    "decode_batch": _DOT_SCALED_DECODE,
    "mid": Mxfp4Tile(block_m=128, block_n=64, block_k=64, num_warps=8, num_stages=3, swap=True, scaled=True),
    "prefill": Mxfp4Tile(block_m=128, block_n=64, block_k=64, num_warps=8, num_stages=3, swap=True, scaled=True),
}


# The CPU interpreter runs each program in Python, so its cost is per program and per op, not per element: wide
# tiles are what make it fast (k3-demo-sized experts, 1-16 tokens: 256 x 256 ran 9-11x faster than 32 x 64).
# Multi-step K loops and masked tails at small tiles are tested with explicit tiles (tests/test_mxfp4_ops.py).
INTERPRETER_TILE = Mxfp4Tile(block_m=16, block_n=256, block_k=256, num_warps=1, num_stages=1)


def mxfp4_row_class(num_pairs: int, num_experts: int) -> str:
    rows_per_expert = num_pairs / max(1, num_experts)
    return next(name for bound, name in MXFP4_ROW_CLASSES if bound is None or rows_per_expert <= bound)


def mxfp4_tile(device: torch.device, num_pairs: int, num_experts: int, element_size: int = 2,
               dtype: torch.dtype | None = None, dims: tuple[int, int] | None = None) -> Mxfp4Tile:
    """The launch shape for a call: bf16 on sm_100 / gfx950 from `MXFP4_TILES_DOT_SCALED`, other NVIDIA bf16 from
    `MXFP4_TILES_NVIDIA` (a tiles file's classes in its place when K3CORE_MXFP4_TILES names one:
    `kernels.triton.moe_mxfp4_tuned`), by mean rows per expert (bf16-only options dropped for another `dtype`, and
    the class's swap tile, `SWAP_TILES_NVIDIA`, for a gluon or wgmma one where `dims` = (D, I) are not whole K
    steps or the dtype is not bf16); elsewhere rows per block from the mean rows per expert (decode: one or two
    rows, so the dot's smallest 16; prefill: taller blocks so that each weight tile is dequantised for more rows),
    not yet tuned on a GPU. float32 activations stop at 64-row blocks: 128-row tiles asked for 256 KiB of shared
    memory on sm_90 (limit 227) and 96 KiB of LDS on gfx942 (limit 64) in the offline compile
    (bench.kernel_resources)."""
    from kernels.triton.moe_mxfp4_tuned import nvidia_tables, refuse_where_unread  # (it imports this module)
    rows_per_expert = num_pairs / max(1, num_experts)
    if target(device) != "nvidia" or current_arch() in DOT_SCALED_ARCHES:
        arch = current_arch()
        refuse_where_unread(arch if arch == target(device) else f"{target(device)} ({arch})")
    if target(device) == "interpreter":
        return INTERPRETER_TILE
    if element_size <= 2 and current_arch() in DOT_SCALED_ARCHES:
        return MXFP4_TILES_DOT_SCALED[mxfp4_row_class(num_pairs, num_experts)]
    if target(device) == "nvidia" and element_size <= 2:
        row_class = mxfp4_row_class(num_pairs, num_experts)
        tile = nvidia_tables()[0][row_class]
        if (tile.gluon or tile.wgmma) and (dtype not in (None, torch.bfloat16) or (
                dims is not None and any(d % tile.block_k for d in dims))):
            tile = SWAP_TILES_NVIDIA[row_class]            # gluon / wgmma: bf16 and whole K steps only
        return tile if dtype in (None, torch.bfloat16) else tile._replace(half_math=False, asm_decode=False)
    block_m = 16 if rows_per_expert <= 16 else 32 if rows_per_expert <= 32 else 64 if rows_per_expert <= 96 else 128
    if element_size > 2:
        block_m = min(block_m, 64)
    return Mxfp4Tile(block_m=block_m, block_n=64 if block_m <= 64 else 128, block_k=128,
                     num_warps=4 if block_m <= 64 else 8, num_stages=3 if target(device) == "nvidia" else 2)


def mxfp4_tail_tile(device: torch.device, tile: Mxfp4Tile, num_pairs: int, num_experts: int,
                    dtype: torch.dtype | None = None) -> Mxfp4Tile | None:
    """The shorter block for each expert's rows past its whole `tile` blocks (`MXFP4_TAIL_TILES_NVIDIA`), or None
    (one height): NVIDIA bf16 prefill only, and only when the mean rows an expert exceed one block (knowing that
    some expert does would cost a host sync)."""
    if target(device) != "nvidia" or dtype not in (None, torch.bfloat16) or current_arch() in DOT_SCALED_ARCHES:
        return None
    from kernels.triton.moe_mxfp4_tuned import nvidia_tables  # (it imports this module)
    tail = nvidia_tables()[1].get(mxfp4_row_class(num_pairs, num_experts))
    if tail is None or num_pairs <= tile.height * max(1, num_experts):
        return None
    return tail


def check_tile(tile: Mxfp4Tile) -> None:
    """Refuse, by name, a tile whose options cannot apply together."""
    for cap in ("maxnreg", "down_maxnreg"):
        if getattr(tile, cap) and not 24 <= getattr(tile, cap) <= 255:
            raise ValueError(f"moe_experts_mxfp4: {cap} is ptxas' register cap per thread, 24-255 (0: none), got "
                             f"{tile}")
    if tile.down_block_n and (tile.down_block_n < 16 or tile.down_block_n & (tile.down_block_n - 1)):
        raise ValueError(f"moe_experts_mxfp4: down_block_n must be 0 (block_n) or a power of two >= 16, got {tile}")
    if tile.tail_m and (not tile.swap or tile.scaled or tile.natural_k or tile.gemv or tile.tail_m < 16
                        or tile.tail_m & (tile.tail_m - 1) or tile.tail_m > tile.block_m):
        raise ValueError(f"moe_experts_mxfp4: tail_m is an option of the swap kernel's own decode (not scaled or "
                         f"natural_k) and must be a power of two in [16, block_m], got {tile}")
    if (tile.coalesced_x or tile.coalesced_w) and not tile.gluon:
        raise ValueError(f"moe_experts_mxfp4: coalesced_x and coalesced_w are options of the Gluon mma.sync decode "
                         f"kernels; set gluon=True, got {tile}")
    if tile.coalesced_w and not tile.coalesced_x:
        raise ValueError(f"moe_experts_mxfp4: coalesced_w reorders x as coalesced_x stores it; set coalesced_x=True "
                         f"too, got {tile}")
    if tile.half_blocks and not (tile.gluon and tile.block_m == 16):
        raise ValueError(f"moe_experts_mxfp4: half_blocks is an option of the Gluon mma.sync decode kernels with "
                         f"16-row blocks; set gluon=True and block_m=16, got {tile}")
    if tile.stream and not tile.gluon:
        raise ValueError(f"moe_experts_mxfp4: stream is an option of the Gluon mma.sync decode kernels; set "
                         f"gluon=True, got {tile}")
    if tile.fold_combine and not tile.stream:
        raise ValueError(f"moe_experts_mxfp4: fold_combine counts the streamed pair's down programs; set stream=True, "
                         f"got {tile}")
    if tile.prologue and not (tile.gluon or (tile.swap and tile.presplit and tile.block_k == 256)):
        raise ValueError(f"moe_experts_mxfp4: prologue copies x into the Gluon mma.sync kernels' column order, which "
                         f"is a presplit swap tile's at block_k 256; set gluon=True, or swap and presplit with "
                         f"block_k=256, got {tile}")
    if tile.wgmma:
        if (tile.gluon or not (tile.swap and tile.asm_decode and tile.presplit and tile.stacked)
                or tile.block_m not in (16, 32, 64, 128, 256) or tile.block_n != 64 or tile.block_k != 128
                or tile.num_warps != 4 or not 3 <= tile.num_stages <= 5
                or tile.num_stages * (4096 + 256 * tile.height) > 224 * 1024
                or tile.down_block_n not in (0, 64) or tile.split_x or tile.scaled or tile.half_math
                or tile.natural_k or tile.gemv or tile.prefetch):
            raise ValueError(f"moe_experts_mxfp4: a wgmma tile is the 4-warp Gluon wgmma kernel: swap, asm_decode, "
                             f"presplit and stacked, block_m 16-256 (a power of two; tail_m 0 or as the swap "
                             f"kernel's), block_n 64, block_k 128, 3-5 stages within 224 KiB of shared memory (a "
                             f"stage: 4 KiB of weight bytes and (block_m + tail_m) x 256 bytes of x), not gluon, no "
                             f"other option, got {tile}")
        return
    if tile.gluon:
        if (not (tile.swap and tile.asm_decode and tile.presplit and tile.stacked) or tile.block_m not in (8, 16)
                or tile.block_n not in (64, 128) or tile.block_k != 256 or tile.num_warps != 4
                or not 1 <= tile.num_stages <= 4 or tile.tail_m
                or tile.down_block_n not in (0, 64, 128) or tile.split_x or tile.scaled or tile.half_math
                or tile.natural_k or tile.gemv or tile.prefetch):
            raise ValueError(f"moe_experts_mxfp4: a gluon tile is the 4-warp mma.sync decode kernel: swap, "
                             f"asm_decode, presplit and stacked, block_m 8 or 16, block_n (and down_block_n) 64 or "
                             f"128 weight rows a program, block_k 256, 1-4 stages (1: each step's weight bytes "
                             f"loaded when decoded; 2-4: a cp.async pipeline), no other option, got {tile}")
        return
    if tile.prefetch and not tile.gemv:
        raise ValueError(f"moe_experts_mxfp4: prefetch is an option of the gemv kernels; set gemv=True, got {tile}")
    if tile.gemv:
        if (tile.swap or tile.split_x or tile.scaled or tile.half_math or tile.asm_decode or tile.natural_k
                or tile.presplit or tile.stacked):
            raise ValueError(f"moe_experts_mxfp4: a gemv tile has no dot, so swap, split_x, scaled, half_math, "
                             f"asm_decode, natural_k, presplit and stacked do not apply; set them False, got {tile}")
        if not 1 <= tile.block_m <= 16 or tile.block_m & (tile.block_m - 1) or tile.block_k < SCALE_BLOCK or (
                tile.block_k & (tile.block_k - 1)):
            raise ValueError(f"moe_experts_mxfp4: a gemv tile needs block_m a power of two in [1, 16] and block_k "
                             f"a power of two >= {SCALE_BLOCK}, got {tile}")
        return
    if tile.block_k % (2 * SCALE_BLOCK) or tile.block_m < 16 or tile.block_m & (tile.block_m - 1):
        raise ValueError(f"moe_experts_mxfp4: block_k must be a multiple of {2 * SCALE_BLOCK} and block_m a power "
                         f"of two >= 16, got {tile}")
    if (tile.split_x or tile.scaled or tile.half_math or tile.asm_decode) and not tile.swap:
        raise ValueError(f"moe_experts_mxfp4: split_x, scaled, half_math and asm_decode are options of the swap "
                         f"kernel; set swap=True, got {tile}")
    if tile.natural_k and (not tile.swap or tile.split_x or tile.scaled):
        raise ValueError(f"moe_experts_mxfp4: natural_k is an option of the swap kernel's own decode that reads x "
                         f"in column order; set swap=True, split_x and scaled False, got {tile}")
    if tile.stacked and (not tile.swap or tile.scaled or tile.natural_k or tile.block_n < 32):
        raise ValueError(f"moe_experts_mxfp4: stacked is an option of the swap kernel's own decode (two dots a K "
                         f"step); set swap=True, scaled and natural_k False and block_n >= 32, got {tile}")
    if tile.presplit and (not tile.swap or tile.split_x or tile.scaled or tile.natural_k):
        raise ValueError(f"moe_experts_mxfp4: presplit is an option of the swap kernel's own decode that reads x "
                         f"already split into even / odd columns; set swap=True, split_x, scaled and natural_k "
                         f"False, got {tile}")
    if tile.asm_decode and (tile.scaled or tile.half_math):
        raise ValueError(f"moe_experts_mxfp4: asm_decode is a decode of its own; set scaled and half_math False, "
                         f"got {tile}")
