"""moe_experts_mxfp4: the torch reference and the interpreted Triton W4A16 kernel against the float64 oracle.

The oracle is the dequantised float64 `moe_experts` (an independent path: `dequantize_mxfp4` then the bf16 op's
reference); the Triton kernel's in-register decode is also checked byte by byte against `dequantize_mxfp4`.
"""
from __future__ import annotations

import math

import pytest
import torch

from k3core.model.mxfp4 import dequantize_mxfp4, max_scale_of
from kernels.torch.moe import moe_experts
from kernels.torch.moe_mxfp4 import moe_experts_mxfp4 as reference

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from kernels.triton import (  # noqa: E402
    moe_blocks, moe_mxfp4, moe_mxfp4_gemv, moe_mxfp4_operands, moe_mxfp4_swap, moe_mxfp4_xwt)

# the weight as the dot's first operand
SWAP_TILE = moe_mxfp4.Mxfp4Tile(block_m=16, block_n=32, block_k=64, num_warps=1, num_stages=1, swap=True)
SPLIT_TILE = SWAP_TILE._replace(split_x=True)         # x rows read contiguously and split into even / odd k
NATURAL_TILE = SWAP_TILE._replace(natural_k=True)     # the decoded halves interleaved back: x in column order
PRESPLIT_TILE = SWAP_TILE._replace(presplit=True)     # x and hidden reordered [even | odd] per K step beforehand
# gate/up's weight tile stacks 64 gate rows over the same columns' up rows: I = 96 leaves a half-empty second block
STACKED_TILE = SWAP_TILE._replace(block_n=128, stacked=True)
# no dot: float32 multiply-adds over 4 and 8 rows per block (blocks with fewer rows, and experts of many rows
# spread over several blocks), K steps of 64 (D = I = 96: the masked tail) and 32 (every step whole, with the next
# step's words prefetched); one row per block in the extremes test (the interpreter runs a program per row there,
# too slow for the larger case)
GEMV_TILE = moe_mxfp4.Mxfp4Tile(block_m=4, block_n=32, block_k=64, num_warps=1, num_stages=1, gemv=True)
GEMV_K32_TILE = GEMV_TILE._replace(block_m=8, block_k=32, prefetch=True)   # the last step's prefetch masked off
GEMV_ROW_TILE = GEMV_TILE._replace(block_m=1, block_k=32, prefetch=True)
# the default (the interpreter's wide tile) and the x W^T kernel at a small one: K steps of 64, masked tails
SMALL_TILE = moe_mxfp4.Mxfp4Tile(block_m=16, block_n=32, block_k=64, num_warps=1, num_stages=1)
TILES = {"triton": None, "triton-small": SMALL_TILE, "triton-swap": SWAP_TILE, "triton-swap-split": SPLIT_TILE,
         "triton-swap-natural": NATURAL_TILE, "triton-swap-presplit": PRESPLIT_TILE,
         "triton-swap-stacked": STACKED_TILE, "triton-gemv": GEMV_TILE,
         "triton-gemv-k32": GEMV_K32_TILE}

# float32 interpreted dots against float64: a few float32 ulps per product, summed over K <= 256; the rounding of
# a sum scales with its terms, not with a result that cancels, so the bound also takes 1e-5 of the largest output
RTOL, ATOL = 1e-5, 1e-5


def _random_experts(gen: torch.Generator, experts: int, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every byte value (so every code, -0 included), scales giving rows of about 1/sqrt(cols)."""
    base = 127 - round(math.log2(cols) / 2) - 1
    packed = torch.randint(0, 256, (experts, rows, cols // 2), generator=gen, dtype=torch.uint8)
    scale = torch.randint(base - 1, base + 2, (experts, rows, cols // 32), generator=gen, dtype=torch.uint8)
    return packed, scale


def _problem(gen: torch.Generator, tokens: int, width: int, inter: int, experts: int, top_k: int) -> tuple:
    """(w13_packed, w13_scale, w2_packed, w2_scale, x, weights): random experts and inputs of these sizes."""
    w13_packed, w13_scale = _random_experts(gen, experts, 2 * inter, width)
    w2_packed, w2_scale = _random_experts(gen, experts, width, inter)
    return (w13_packed, w13_scale, w2_packed, w2_scale, torch.randn(tokens, width, generator=gen),
            torch.rand(tokens, top_k, generator=gen))


def _oracle(x, w13_packed, w13_scale, w2_packed, w2_scale, weights, expert_ids, activation, offset=0):
    w13 = dequantize_mxfp4(w13_packed, w13_scale, torch.float64)
    w2 = dequantize_mxfp4(w2_packed, w2_scale, torch.float64)
    return moe_experts(x.double(), w13, w2, weights.double(), expert_ids, activation, 4.0, 25.0, offset)


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    assert torch.isfinite(got).all()
    error = (got.double() - want).abs()
    bound = ATOL + RTOL * (want.abs() + want.abs().max())
    assert (error <= bound).all(), f"max error {error.max():.3g}, worst {(error / bound).max():.3g} x bound"


def _uneven_ids(gen: torch.Generator, tokens: int, experts: int, top_k: int) -> torch.Tensor:
    """Expert 0 gets no rows, expert 1 exactly one, the others many (more than a 16-row block)."""
    ids = 2 + torch.rand(tokens, experts - 2, generator=gen).topk(top_k, dim=-1).indices
    ids[tokens // 2, -1] = 1
    return ids


# every dot provider under both activations; the gemv tiles (slow in the interpreter) under one each
CASES = [(p, a) for p in ("reference", "triton", "triton-small", "triton-swap", "triton-swap-split",
                          "triton-swap-natural", "triton-swap-presplit", "triton-swap-stacked")
         for a in ("silu", "situ")] + [
    ("triton-gemv", "silu"), ("triton-gemv-k32", "situ")]


def test_the_tests_run_the_swap_gate_up_kernel_with_and_without_its_row_mask():
    """EVEN_N (no weight row mask in gate/up) only where I is a multiple of a program's columns: with I = 96 the
    32-column swap tiles below take it and the stacked tile's 64-column programs (half of the second one past I)
    keep the mask, so the oracle tests run both forms; the x W^T kernel has no such option."""
    assert moe_mxfp4._even_n(SWAP_TILE, 96, SWAP_TILE.block_n) == {"EVEN_N": True}
    assert moe_mxfp4._even_n(STACKED_TILE, 96, STACKED_TILE.block_n // 2) == {}
    assert moe_mxfp4._even_n(SMALL_TILE, 96, SMALL_TILE.block_n) == {}


@pytest.mark.parametrize(("provider", "activation"), CASES)
def test_uneven_experts_and_k_not_a_multiple_of_the_block(provider, activation):
    # D = 96 and I = 96 are multiples of the 32-column scale group but not of the kernel's 64-column K step
    gen = torch.Generator().manual_seed(11)
    tokens, experts, top_k = 41, 5, 2
    w13_packed, w13_scale, w2_packed, w2_scale, x, weights = _problem(gen, tokens, 96, 96, experts, top_k)
    ids = _uneven_ids(gen, tokens, experts, top_k)
    fn = reference if provider == "reference" else moe_mxfp4.moe_experts_mxfp4
    tile = {"tile": TILES[provider]} if TILES.get(provider) else {}
    got = fn(x, w13_packed, w13_scale, w2_packed, w2_scale, weights, ids, activation, 4.0, 25.0, **tile)
    _assert_close(got, _oracle(x, w13_packed, w13_scale, w2_packed, w2_scale, weights, ids, activation))


def test_expert_parallel_offset_drops_other_ranks_pairs():
    gen = torch.Generator().manual_seed(12)
    tokens, width, inter, experts, top_k, offset = 19, 64, 32, 3, 3, 3
    w13_packed, w13_scale = _random_experts(gen, experts, 2 * inter, width)
    w2_packed, w2_scale = _random_experts(gen, experts, width, inter)
    x = torch.randn(tokens, width, generator=gen)
    weights = torch.rand(tokens, top_k, generator=gen)
    ids = torch.rand(tokens, 9, generator=gen).topk(top_k, dim=-1).indices     # 0..8: a third are this rank's
    want = _oracle(x, w13_packed, w13_scale, w2_packed, w2_scale, weights, ids, "situ", offset)
    got = moe_mxfp4.moe_experts_mxfp4(x, w13_packed, w13_scale, w2_packed, w2_scale, weights, ids, "situ", 4.0,
                                      25.0, offset)
    _assert_close(got, want)
    assert (got[(ids - offset).ge(0).logical_and((ids - offset).lt(experts)).sum(1) == 0] == 0).all()


def test_scale_extremes_and_byte_255():
    """Scale 254 (and 255, read as 254) on the first 32 columns with x of 2^-126 there, scale 0 (2^-127) on
    scattered blocks of W2 (a decode that does not make those vanish, e.g. byte 0 read as 2^0, shows); the 254
    block carries weight: read as 253 it moves the output far outside the bound."""
    gen = torch.Generator().manual_seed(13)
    tokens, width, inter, experts, top_k = 9, 64, 64, 2, 1
    w13_packed, w13_scale = _random_experts(gen, experts, 2 * inter, width)
    w2_packed, w2_scale = _random_experts(gen, experts, width, inter)
    w13_packed[:, :, :16] &= 0xBB                                               # |code| <= 1.5: 1.5 * 2^127 is finite
    w13_scale[:, :, 0] = torch.where(torch.rand(experts, 2 * inter, generator=gen) < 0.5, 254, 255).to(torch.uint8)
    w2_scale[:, ::3, 1] = 0
    x = torch.randn(tokens, width, generator=gen)
    x[:, :32] = x[:, :32].sign() * (1 + x[:, :32].abs()) * 2.0 ** -126
    weights = torch.rand(tokens, top_k, generator=gen)
    ids = torch.randint(0, experts, (tokens, top_k), generator=gen)
    want = _oracle(x, w13_packed, w13_scale, w2_packed, w2_scale, weights, ids, "silu")
    for fn in (reference, moe_mxfp4.moe_experts_mxfp4):
        _assert_close(fn(x, w13_packed, w13_scale, w2_packed, w2_scale, weights, ids, "silu", 4.0, 25.0), want)
    for tile in (SMALL_TILE, SWAP_TILE, SPLIT_TILE, PRESPLIT_TILE, PRESPLIT_TILE._replace(stacked=True), GEMV_TILE,
                 GEMV_ROW_TILE):
        _assert_close(moe_mxfp4.moe_experts_mxfp4(x, w13_packed, w13_scale, w2_packed, w2_scale, weights, ids,
                                                  "silu", 4.0, 25.0, tile=tile), want)
    # the extreme block carries weight: halving its scale changes the answer well beyond the tolerance
    halved = w13_scale.clone()
    halved[:, :, 0] = 253
    moved = _oracle(x, w13_packed, halved, w2_packed, w2_scale, weights, ids, "silu")
    assert ((moved - want).abs() > 100 * (ATOL + RTOL * (want.abs() + want.abs().max()))).any()


@pytest.mark.parametrize("tile", [STACKED_TILE._replace(down_block_n=16, maxnreg=128),
                                  PRESPLIT_TILE._replace(down_block_n=64), GEMV_TILE._replace(down_block_n=16)])
def test_down_kernel_columns_of_their_own_match_the_oracle(tile):
    """down_block_n sets the down kernel's column blocks apart from gate/up's (the 96 output columns split into 6
    blocks of 16, or 2 of 64 with a masked half): the same result; maxnreg is a compile option the interpreter
    runs without."""
    gen = torch.Generator().manual_seed(16)
    w13_packed, w13_scale, w2_packed, w2_scale, x, weights = _problem(gen, 23, 96, 96, 5, 2)
    ids = _uneven_ids(gen, 23, 5, 2)
    got = moe_mxfp4.moe_experts_mxfp4(x, w13_packed, w13_scale, w2_packed, w2_scale, weights, ids, "situ", 4.0, 25.0,
                                      tile=tile)
    _assert_close(got, _oracle(x, w13_packed, w13_scale, w2_packed, w2_scale, weights, ids, "situ"))


def test_empty_batch_and_shape_errors():
    gen = torch.Generator().manual_seed(14)
    w13_packed, w13_scale = _random_experts(gen, 2, 64, 64)
    w2_packed, w2_scale = _random_experts(gen, 2, 64, 32)
    empty = torch.zeros(0, 64)
    ids, weights = torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2)
    for fn in (reference, moe_mxfp4.moe_experts_mxfp4):
        assert fn(empty, w13_packed, w13_scale, w2_packed, w2_scale, weights, ids, "silu", 4.0, 25.0).shape == (0, 64)
        with pytest.raises(ValueError, match="uint8"):
            fn(empty, w13_packed.float(), w13_scale, w2_packed, w2_scale, weights, ids, "silu", 4.0, 25.0)
        with pytest.raises(ValueError, match=r"\[E, D, I/2\]"):
            fn(empty, w13_packed, w13_scale, w2_packed[:, :, :8], w2_scale, weights, ids, "silu", 4.0, 25.0)


def test_reference_float64_is_exact_where_float32_overflows():
    """6 * 2^127 is inf in float32; the float64 oracle must keep it finite (no silent inf in the reference)."""
    packed = torch.full((1, 1, 16), 0x77, dtype=torch.uint8)                   # every code 6
    scale = torch.full((1, 1, 1), 254, dtype=torch.uint8)
    assert torch.isinf(dequantize_mxfp4(packed, scale)).all()
    assert (dequantize_mxfp4(packed, scale, torch.float64) == 6 * 2.0 ** 127).all()


@triton.jit
def _decode_kernel(packed_ptr, scale_ptr, low_ptr, high_ptr, num_rows, num_k, HALF_K: tl.constexpr,
                   BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr):
    rows = tl.arange(0, BLOCK_N)
    expert = tl.program_id(0) * 0                                                # one expert, as a tensor
    low, high = moe_mxfp4_xwt._mxfp4_tile(packed_ptr, scale_ptr, expert, 0, num_k // 2, 0, num_k // 32, rows,
                                      rows < num_rows, tl.program_id(0) * 2 * HALF_K, num_k, HALF_K, BLOCK_N,
                                      tl.float32, EVEN_K)
    j = tl.program_id(0) * HALF_K + tl.arange(0, HALF_K)
    offsets = rows[None, :] * (num_k // 2) + j[:, None]                          # [HALF_K, BLOCK_N] of [N, K/2]
    mask = (rows < num_rows)[None, :] & (j < num_k // 2)[:, None]
    tl.store(low_ptr + offsets, low, mask=mask)
    tl.store(high_ptr + offsets, high, mask=mask)


@pytest.mark.filterwarnings("ignore:overflow encountered in multiply")   # 6 * 2^127 is inf, on both sides
@pytest.mark.parametrize("even_k", [False, True])                       # with and without the K mask
def test_in_register_decode_matches_dequantize_for_every_byte_and_scale(even_k):
    scales = [0, 1, 2, 100, 126, 127, 128, 200, 253, 254, 255]
    num_k = 512                                                                  # 256 bytes: one of each value
    packed = torch.arange(256, dtype=torch.uint8).repeat(len(scales), 1)        # [N, K/2]
    scale = torch.tensor(scales, dtype=torch.uint8)[:, None].repeat(1, num_k // 32)
    scale[:, 1::2] = 127                                                         # neighbouring groups differ
    low = torch.full((len(scales), num_k // 2), float("nan"))
    high = torch.full_like(low, float("nan"))
    _decode_kernel[(triton.cdiv(num_k, 64),)](packed, scale, low, high, len(scales), num_k, HALF_K=32, BLOCK_N=16,
                                              EVEN_K=even_k)
    want = dequantize_mxfp4(packed, scale)                                       # [N, K] float32
    assert torch.equal(low, want[:, 0::2]) and torch.equal(high, want[:, 1::2])


@triton.jit
def _decode_rows_kernel(packed_ptr, scale_ptr, low_ptr, high_ptr, num_rows, num_k, HALF_K: tl.constexpr,
                        BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr, SCALE_FOLD: tl.constexpr = False):
    rows = tl.arange(0, BLOCK_N)
    expert = tl.program_id(0) * 0
    low, high = moe_mxfp4_operands._weight_rows(packed_ptr, scale_ptr, expert, 0, num_k // 2, 0, num_k // 32, rows,
                                            rows < num_rows, tl.program_id(0) * 2 * HALF_K, num_k, HALF_K,
                                            BLOCK_N, tl.float32, EVEN_K, SCALE_FOLD=SCALE_FOLD)
    j = tl.program_id(0) * HALF_K + tl.arange(0, HALF_K)
    offsets = rows[:, None] * (num_k // 2) + j[None, :]                          # [BLOCK_N, HALF_K] of [N, K/2]
    mask = (rows < num_rows)[:, None] & (j < num_k // 2)[None, :]
    tl.store(low_ptr + offsets, low, mask=mask)
    tl.store(high_ptr + offsets, high, mask=mask)


def _decode_every_byte(scales: list[int], even_k: bool, fold: bool) -> None:
    """All 256 bytes under each scale byte (every other 32-column block at 127), decoded by the swap kernel's
    float16-bit path, against `dequantize_mxfp4`: bit-exact."""
    num_k = 512
    packed = torch.arange(256, dtype=torch.uint8).repeat(len(scales), 1)
    scale = torch.tensor(scales, dtype=torch.uint8)[:, None].repeat(1, num_k // 32)
    scale[:, 1::2] = 127
    low = torch.full((len(scales), num_k // 2), float("nan"))
    high = torch.full_like(low, float("nan"))
    _decode_rows_kernel[(triton.cdiv(num_k, 64),)](packed, scale, low, high, len(scales), num_k, HALF_K=32,
                                                   BLOCK_N=16, EVEN_K=even_k, SCALE_FOLD=fold)
    want = dequantize_mxfp4(packed, scale)
    assert torch.equal(low, want[:, 0::2]) and torch.equal(high, want[:, 1::2])


@pytest.mark.filterwarnings("ignore:overflow encountered in multiply")   # 6 * 2^127 is inf, on both sides
@pytest.mark.parametrize("even_k", [False, True])
def test_float16_bit_decode_of_the_swap_kernel_matches_dequantize_for_every_byte_and_scale(even_k):
    """The swap kernel's float16-bit decode (code 0.5 passes through a float16 subnormal) is bit-exact against
    `dequantize_mxfp4` for all 256 bytes under every scale class, 0 (2^-127) and 255 (read as 254) included."""
    _decode_every_byte([0, 1, 2, 100, 113, 126, 127, 128, 200, 240, 241, 253, 254, 255], even_k, fold=False)


@pytest.mark.parametrize("even_k", [False, True])
def test_folded_float16_bit_decode_matches_dequantize_for_every_byte_and_scale_up_to_the_bound(even_k):
    """SCALE_FOLD (the op's max_scale <= 128): 2^14 folded into the scale, one multiply fewer, the same exact
    values for all 256 bytes at every scale class the bound admits."""
    _decode_every_byte([0, 1, 2, 64, 100, 113, 119, 126, 127, moe_mxfp4_swap.FOLD_MAX_SCALE], even_k, fold=True)


def test_a_scale_bound_folds_the_decode_and_changes_no_result():
    """max_scale (measured at load, `max_scale_of`) at most 128: the swap kernels fold their decode constant and
    give the same bits as without the bound; above 128, or None, nothing is folded; the reference refuses a bound
    the scales break, and a bound that is not a byte is refused by name."""
    gen = torch.Generator().manual_seed(21)
    tokens, width, inter, experts, top_k = 23, 96, 64, 4, 2
    w13_packed, w13_scale = _random_experts(gen, experts, 2 * inter, width)
    w2_packed, w2_scale = _random_experts(gen, experts, width, inter)
    w13_scale[0, :3, 0] = 0                                             # 2^-127 and the bound itself
    w2_scale[1, 5, 1] = moe_mxfp4_swap.FOLD_MAX_SCALE
    bound = max_scale_of(w13_scale, w2_scale)
    assert bound == moe_mxfp4_swap.FOLD_MAX_SCALE and moe_mxfp4.scale_fold(bound)
    assert not moe_mxfp4.scale_fold(None) and not moe_mxfp4.scale_fold(bound + 1)
    x = torch.randn(tokens, width, generator=gen)
    weights = torch.rand(tokens, top_k, generator=gen)
    ids = _uneven_ids(gen, tokens, experts, top_k)
    args = (x, w13_packed, w13_scale, w2_packed, w2_scale, weights, ids, "situ", 4.0, 25.0)
    want = _oracle(*args[:8])
    for tile in (SWAP_TILE, SPLIT_TILE):
        plain = moe_mxfp4.moe_experts_mxfp4(*args, tile=tile)
        folded = moe_mxfp4.moe_experts_mxfp4(*args, tile=tile, max_scale=bound)
        _assert_close(folded, want)
        assert torch.equal(folded, plain)
    assert torch.equal(reference(*args, max_scale=bound), reference(*args))
    with pytest.raises(ValueError, match="max_scale=127 but a scale byte is 128"):
        reference(*args, max_scale=127)
    for bad in (256, -1, True, 12.0):
        with pytest.raises(ValueError, match="max_scale must be None or a scale byte"):
            moe_mxfp4.moe_experts_mxfp4(*args, max_scale=bad)


def test_the_model_measures_the_bound_once_and_passes_it():
    """RoutedExperts (MXFP4) measures max_scale at load and every call passes it to the op."""
    import dataclasses

    from k3core.config import ModelConfig
    from k3core.model.ffn import RoutedExperts
    gen = torch.Generator().manual_seed(22)
    config = dataclasses.replace(ModelConfig.preset("k3-tiny"), expert_format="mxfp4")
    w13_packed, w13_scale = _random_experts(gen, 3, 64, 64)
    w2_packed, w2_scale = _random_experts(gen, 3, 64, 32)
    w2_scale[2, 0, 0] = 131
    weights = {"e.w13_packed": w13_packed, "e.w13_scale": w13_scale, "e.w2_packed": w2_packed,
               "e.w2_scale": w2_scale}
    experts = RoutedExperts(config, weights, "e.")
    assert experts.max_scale == 131

    class Ops:
        def moe_experts_mxfp4(self, *args, **kwargs):
            self.kwargs = kwargs
            return reference(*args, **kwargs)

    ops = Ops()
    experts.forward(ops, torch.randn(2, 64), torch.rand(2, 1), torch.zeros(2, 1, dtype=torch.long), 0)
    assert ops.kwargs == {"max_scale": 131}


@triton.jit
def _decode_words_kernel(words_ptr, scale_ptr, out_ptr, num_rows, num_k, WORDS: tl.constexpr,
                         BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr):
    rows = tl.arange(0, BLOCK_N)
    expert = tl.program_id(0) * 0
    k_start = tl.program_id(0) * 8 * WORDS
    words, scale = moe_mxfp4_gemv._weight_words(words_ptr, scale_ptr, expert, 0, num_k // 8, 0, num_k // 32, rows,
                                                rows < num_rows, k_start, num_k, WORDS, EVEN_K)
    cols = k_start + 8 * tl.arange(0, WORDS)                                              # word j's first column
    offsets = rows[:, None] * num_k + cols[None, :]                                       # [BLOCK_N, WORDS]
    mask = (rows < num_rows)[:, None] & (cols < num_k)[None, :]
    for c in tl.static_range(4):                                                          # nibbles c and c + 4
        low, high = moe_mxfp4_gemv._pair_codes(words, 4 * c)
        tl.store(out_ptr + offsets + c, low * scale, mask=mask)
        tl.store(out_ptr + offsets + c + 4, high * scale, mask=mask)


@pytest.mark.filterwarnings("ignore:overflow encountered in multiply")   # 6 * 2^127 is inf, on both sides
@pytest.mark.parametrize("even_k", [False, True])
def test_word_decode_of_the_gemv_kernel_matches_dequantize_for_every_byte_and_scale(even_k):
    """The gemv kernel's int32-word decode (nibbles c and c + 4 of a word, columns 8j + c and 8j + c + 4, in one
    operation) and its per-word scale, applied as the kernel applies it (a product after the codes), are bit-exact
    against
    `dequantize_mxfp4` for all 256 bytes under every scale class, 0 (2^-127) and 255 (read as 254) included."""
    scales = [0, 1, 2, 100, 113, 126, 127, 128, 200, 240, 241, 253, 254, 255]
    num_k = 512
    packed = torch.arange(256, dtype=torch.uint8).repeat(len(scales), 1)
    scale = torch.tensor(scales, dtype=torch.uint8)[:, None].repeat(1, num_k // 32)
    scale[:, 1::2] = 127
    out = torch.full((len(scales), num_k), float("nan"))
    _decode_words_kernel[(triton.cdiv(num_k, 64),)](packed.view(torch.int32), scale, out, len(scales), num_k,
                                                    WORDS=8, BLOCK_N=16, EVEN_K=even_k)
    assert torch.equal(out, dequantize_mxfp4(packed, scale))


def test_gemv_tiles_refuse_packed_rows_off_word_boundaries():
    gen = torch.Generator().manual_seed(16)
    w13_packed, w13_scale = _random_experts(gen, 2, 64, 64)
    w2_packed, w2_scale = _random_experts(gen, 2, 64, 32)
    shifted = torch.empty(2 * 64 * 32 + 1, dtype=torch.uint8)[1:].view(2, 64, 32)
    shifted.copy_(w13_packed)
    x, ids, weights = torch.randn(3, 64, generator=gen), torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1)
    with pytest.raises(ValueError, match="4-byte boundaries"):
        moe_mxfp4.moe_experts_mxfp4(x, shifted, w13_scale, w2_packed, w2_scale, weights, ids, "silu", 4.0, 25.0,
                                    tile=GEMV_TILE)
    got = moe_mxfp4.moe_experts_mxfp4(x, shifted.clone(), w13_scale, w2_packed, w2_scale, weights, ids, "silu",
                                      4.0, 25.0, tile=GEMV_TILE)
    _assert_close(got, _oracle(x, w13_packed, w13_scale, w2_packed, w2_scale, weights, ids, "silu"))


def test_presplit_order_and_the_padded_hidden_columns_are_zero():
    """presplit_columns puts each K step's even columns before its odd ones and pads with zero columns; gate/up
    of a presplit tile stores hidden in that order, and its columns past I (read by down against masked-off, zero
    weights) must be finite zeros, not whatever the buffer held: 0 x NaN would poison every row."""
    t = torch.arange(2 * 96, dtype=torch.float32).reshape(2, 96)
    split = moe_mxfp4.presplit_columns(t, 64)
    assert split.shape == (2, 128)
    assert torch.equal(split[:, :32], t[:, 0:64:2]) and torch.equal(split[:, 32:64], t[:, 1:64:2])
    assert torch.equal(split[:, 64:80], t[:, 64::2]) and torch.equal(split[:, 96:112], t[:, 65::2])
    assert (split[:, 80:96] == 0).all() and (split[:, 112:] == 0).all()
    gen = torch.Generator().manual_seed(17)
    w13_packed, w13_scale, w2_packed, w2_scale, x, _ = _problem(gen, 7, 64, 96, 3, 2)
    ids = torch.randint(0, 3, (7, 2), generator=gen)
    blocks = moe_blocks.group_pairs_by_expert(ids, 0, 3, PRESPLIT_TILE.block_m)
    hidden = moe_mxfp4.gate_up(x, w13_packed, w13_scale, blocks, 2, "silu", 4.0, 25.0, PRESPLIT_TILE)
    plain = moe_mxfp4.gate_up(x, w13_packed, w13_scale, blocks, 2, "silu", 4.0, 25.0, SWAP_TILE)
    rows = blocks.row_of_pair
    assert hidden.shape[1] == 128 and (hidden[:, 80:96] == 0).all() and (hidden[:, 112:] == 0).all()
    torch.testing.assert_close(hidden[rows], moe_mxfp4.presplit_columns(plain[rows], 64), rtol=1e-6, atol=1e-6)


def test_split_tail_pairs_keeps_whole_blocks_and_cuts_only_what_is_past_them():
    """Expert 0 has 9 pairs (one whole 4-row block... twice, and 1 past), expert 1 has 4 (exactly one block), expert 2
    has 3 (under one block: kept whole, padded), expert 3 belongs to another rank; block_m 4."""
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [0, 5], [0, 2], [0, 1], [0, 2], [0, 1], [0, 5]])
    whole, tail = moe_blocks.split_tail_pairs(ids, 0, 4, 4)
    elsewhere = 4
    assert torch.equal(tail[:, 0], torch.tensor([elsewhere] * 8 + [0]))          # the 9th pair of expert 0
    assert (tail[:, 1] == elsewhere).all()
    assert torch.equal(whole[:, 0], torch.tensor([0] * 8 + [elsewhere]))
    assert torch.equal(whole[:, 1], ids[:, 1])                                  # expert 5 is past the rank: stays
    with_offset = moe_blocks.split_tail_pairs(ids + 10, 10, 4, 4)
    assert torch.equal(with_offset[0], whole + 10) and torch.equal(with_offset[1], tail + 10)


@pytest.mark.parametrize("offset", [0, 2])
def test_two_block_heights_give_the_one_height_result(offset):
    """Prefill's mixed heights (whole 32-row blocks plus 16-row tail blocks: the gate/up and down kernels at two
    tiles into one row buffer) against the float64 oracle, and within float32 rounding of one height (the
    interpreter's dot is numpy's matmul, whose summation order follows the block's row count, so bit equality is
    not a property of the kernels here). Experts of 14-15 rows (one padded block), exactly 32, and 51 (one whole
    block and a 19-row tail over two tail blocks); with an expert offset, another rank's pairs dropped."""
    gen = torch.Generator().manual_seed(33)
    tokens, experts, top_k = 44, 5, 3
    w13_packed, w13_scale, w2_packed, w2_scale, x, weights = _problem(gen, tokens, 96, 64, experts, top_k)
    ids = torch.full((tokens, top_k), offset + 4)
    ids[:, 0] = offset + torch.arange(tokens) % 3                               # experts 0-2: 14-15 rows
    ids[:32, 1] = offset + 3                                                    # expert 3: exactly one block
    ids[:5, 2] = offset + 7                                                     # another rank's expert
    args = (x, w13_packed, w13_scale, w2_packed, w2_scale, weights, ids, "situ", 4.0, 25.0, offset)
    tile = SPLIT_TILE._replace(block_m=32)
    one = moe_mxfp4.moe_experts_mxfp4(*args, tile=tile)
    two = moe_mxfp4.moe_experts_mxfp4(*args, tile=tile, tail_tile=SPLIT_TILE)
    want = _oracle(*args[:8], offset=offset)
    _assert_close(two, want)
    assert (two - one).abs().max() <= 1e-5 * want.abs().max()                  # float32 rounding, not a lost row
    _, cut = moe_blocks.split_tail_pairs(ids, offset, experts, tile.block_m)
    assert (cut == offset + 4).sum() == 51 - 32 and ((cut == offset + 4) | (cut == offset + experts)).all()


# one program over a 32-row part and a 16-row tail (`Mxfp4Tile.tail_m`): split x, presplit + stacked, plain halves
TAIL_TILES = {"split": SPLIT_TILE._replace(block_m=32, tail_m=16),
              "presplit-stacked": STACKED_TILE._replace(block_m=32, tail_m=16, presplit=True),
              "plain": SWAP_TILE._replace(block_m=32, tail_m=16)}


@pytest.mark.parametrize("activation", ["silu", "situ"])
@pytest.mark.parametrize("name", list(TAIL_TILES))
def test_tail_blocks_take_every_path_and_match_the_oracle(name, activation):
    """48-row blocks (32 + a 16-row tail), every path of the kernels against the float64 oracle: expert 1 has one
    row and expert 4's second block 16 (the tail-sized dot alone), expert 2 has 20 (the 32-row dot alone), expert 3
    has 43 and expert 4's first block 48 (both dots on one decode, the tail partly and wholly real); expert 0 has
    none. A path that dropped rows or wrote the wrong ones moves those rows' outputs far outside the bound. D = I =
    96 (K not a multiple of the 64-column step); the rows come in shuffled token order."""
    gen = torch.Generator().manual_seed(41)
    tokens, experts, top_k = 64, 5, 2
    w13_packed, w13_scale, w2_packed, w2_scale, x, weights = _problem(gen, tokens, 96, 96, experts, top_k)
    second = torch.tensor([3] * 43 + [2] * 20 + [1])
    ids = torch.stack([torch.full((tokens,), 4), second], 1)[torch.randperm(tokens, generator=gen)]
    counts = torch.bincount(ids.reshape(-1), minlength=experts)
    assert counts.tolist() == [0, 1, 20, 43, 64]
    tile = TAIL_TILES[name]
    assert tile.height == 48
    got = moe_mxfp4.moe_experts_mxfp4(x, w13_packed, w13_scale, w2_packed, w2_scale, weights, ids, activation, 4.0,
                                      25.0, tile=tile)
    _assert_close(got, _oracle(x, w13_packed, w13_scale, w2_packed, w2_scale, weights, ids, activation))


def test_tail_blocks_group_pairs_at_the_whole_height():
    """The host side of a tail tile: pairs grouped into block_m + tail_m rows, hidden sized by it."""
    tile = TAIL_TILES["split"]
    gen = torch.Generator().manual_seed(42)
    ids = torch.randint(0, 3, (30, 2), generator=gen)
    blocks = moe_blocks.group_pairs_by_expert(ids, 0, 3, tile.height)
    assert blocks.block_experts.numel() == moe_blocks.num_expert_blocks(60, 3, 48)
    w13_packed, w13_scale = _random_experts(gen, 3, 2 * 64, 64)
    hidden = moe_mxfp4.gate_up(torch.randn(30, 64, generator=gen), w13_packed, w13_scale, blocks, 2, "silu", None,
                               None, tile)
    assert hidden.shape == (blocks.block_experts.numel() * 48, 64)
