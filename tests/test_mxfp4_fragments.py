"""MXFP4 weights in fragment order (`kernels.triton.moe_mxfp4_fragments`): the packing against the checkpoint order,
the word decode against `dequantize_mxfp4` on every code in every position, and the interpreted expert GEMMs
against the float64 oracle on awkward shapes."""
from __future__ import annotations

import math

import pytest
import torch

from k3core.model.mxfp4 import dequantize_mxfp4
from kernels.torch.moe import moe_experts

triton = pytest.importorskip("triton")
from kernels.triton import moe_mxfp4_fragments as fragments  # noqa: E402

RTOL, ATOL = 1e-5, 1e-5        # float32 interpreted dots against float64 (tests/test_mxfp4_ops.py's bound)


def _codes(gen: torch.Generator, experts: int, rows: int, cols: int, scale_low: int = 0, scale_high: int = 256):
    packed = torch.randint(0, 256, (experts, rows, cols // 2), generator=gen, dtype=torch.uint8)
    scale = torch.randint(scale_low, scale_high, (experts, rows, cols // 32), generator=gen, dtype=torch.uint8)
    return packed, scale


@pytest.mark.parametrize("rows,cols", [(64, 256), (96, 96), (130, 544), (1, 32)])
def test_pack_then_unpack_gives_the_checkpoint_bytes_back(rows, cols):
    """Every byte and scale of awkward shapes (rows and K padded to 64 / 256) survives the round trip, and the
    padding holds code 0 and scale byte 0."""
    gen = torch.Generator().manual_seed(rows * cols)
    packed, scale = _codes(gen, 3, rows, cols)
    weights = fragments.pack_fragments(packed, scale)
    assert weights.words.dtype == torch.int32 and weights.scales.dtype == torch.uint8
    assert weights.words.shape == (3, -(-rows // 64), -(-cols // 256), 2048)
    back_packed, back_scale = fragments.unpack_fragments(weights)
    assert torch.equal(back_packed, packed) and torch.equal(back_scale, scale)
    full = weights._replace(num_rows=weights.words.shape[1] * 64, num_k=weights.words.shape[2] * 256)
    padded_packed, padded_scale = fragments.unpack_fragments(full)
    assert not padded_packed[:, rows:].any() and not padded_packed[:, :, cols // 2:].any()
    assert not padded_scale[:, rows:].any() and not padded_scale[:, :, cols // 32:].any()


def test_stacked_rows_interleave_gate_and_up_per_32_columns():
    order = fragments.stacked_rows(64)
    assert order.tolist() == list(range(32)) + list(range(64, 96)) + list(range(32, 64)) + list(range(96, 128))


def test_word_bit_plan_uses_every_bit_once():
    """The four pairs' magnitude and sign bits tile the 16 bits of a half word exactly (module docstring)."""
    positions = [p for pair in range(4) for p in (*fragments._MAGNITUDE_BITS[pair], fragments._SIGN_BITS[pair])]
    assert sorted(positions) == list(range(16))


@triton.jit
def _decode_kernel(words_ptr, scales_ptr, out_ptr):
    tile = fragments.fragment_tile(words_ptr, scales_ptr, 0, triton.language.float32, False, False)
    rows = triton.language.arange(0, 64)[:, None]
    cols = triton.language.arange(0, 256)[None, :]
    triton.language.store(out_ptr + rows * 256 + cols, tile)


@pytest.mark.filterwarnings("ignore:overflow encountered in multiply")   # 6 * 2^127 is inf, on both sides
def test_fragment_tile_decodes_every_code_in_every_position_and_every_scale():
    """One 64 x 256 tile whose codes are all 16 codes in every slot of a word (every pair and half) and whose
    scales include the E8M0 extremes 0, 1, 127, 254 and 255: the decoded tile equals `dequantize_mxfp4` in float32,
    bit for bit (inf where 6 * 2^127 overflows on both sides)."""
    gen = torch.Generator().manual_seed(5)
    codes = (torch.arange(64 * 256) % 16).view(64, 256)
    codes = codes[:, torch.randperm(256, generator=gen)]                # codes spread over slots, rows, columns
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)[None]
    scale = torch.randint(100, 140, (1, 64, 8), generator=gen, dtype=torch.uint8)
    scale.view(-1)[:5] = torch.tensor([0, 1, 127, 254, 255], dtype=torch.uint8)
    weights = fragments.pack_fragments(packed, scale)
    out = torch.full((64, 256), float("nan"))
    _decode_kernel[(1,)](weights.words[0, 0], weights.scales[0, 0], out)
    want = dequantize_mxfp4(packed[0], scale[0], torch.float32)
    assert torch.equal(out.isinf(), want.isinf())
    assert torch.equal(out[want.isfinite()], want[want.isfinite()])


def _problem(gen: torch.Generator, tokens: int, width: int, inter: int, experts: int, top_k: int):
    base = 127 - round(math.log2(width) / 2) - 1
    w13 = _codes(gen, experts, 2 * inter, width, base - 1, base + 2)
    w2 = _codes(gen, experts, width, inter, base - 1, base + 2)
    return w13, w2, torch.randn(tokens, width, generator=gen), torch.rand(tokens, top_k, generator=gen)


@pytest.mark.parametrize("tokens,width,inter,experts,top_k,block_m,offset", [
    (7, 96, 96, 5, 2, 16, 0),       # K and rows under one step / tile (padding in both)
    (41, 320, 160, 4, 3, 16, 0),    # two K steps, the second partial; experts of many rows (several blocks)
    (20, 256, 256, 3, 2, 32, 0),    # whole steps (no K mask), taller blocks
    (9, 96, 64, 6, 2, 16, 2),       # expert parallelism: ids outside [2, 8) belong to other ranks
])
@pytest.mark.parametrize("activation", ["silu", "situ"])
def test_fragment_experts_match_the_float64_oracle(tokens, width, inter, experts, top_k, block_m, offset, activation):
    gen = torch.Generator().manual_seed(tokens + width)
    (w13_packed, w13_scale), (w2_packed, w2_scale), x, weights = _problem(gen, tokens, width, inter, experts, top_k)
    low, high = (offset - 2, offset + experts + 2) if offset else (0, experts)
    ids = torch.stack([torch.randperm(high - low, generator=gen)[:top_k] + low for _ in range(tokens)])
    w13, w2 = fragments.pack_expert_weights(w13_packed, w13_scale, w2_packed, w2_scale)
    got = fragments.moe_experts_fragments(x, w13, w2, weights, ids, activation, 4.0, 25.0, offset,
                                          tile=fragments.FragmentTile(block_m=block_m))
    want = moe_experts(x.double(), dequantize_mxfp4(w13_packed, w13_scale, torch.float64),
                       dequantize_mxfp4(w2_packed, w2_scale, torch.float64), weights.double(), ids, activation, 4.0,
                       25.0, offset)
    assert got.shape == want.shape and torch.isfinite(got).all()
    error = (got.double() - want).abs()
    assert (error <= ATOL + RTOL * (want.abs() + want.abs().max())).all(), f"max error {error.max():.3g}"


def test_shape_mismatch_is_refused_by_name():
    gen = torch.Generator().manual_seed(1)
    (w13_packed, w13_scale), (w2_packed, w2_scale), x, weights = _problem(gen, 3, 64, 64, 2, 1)
    w13, w2 = fragments.pack_expert_weights(w13_packed, w13_scale, w2_packed, w2_scale)
    with pytest.raises(ValueError, match="expected 2I x D"):
        fragments.moe_experts_fragments(torch.randn(3, 96), w13, w2, weights, torch.zeros(3, 1, dtype=torch.long),
                                        "silu", None, None)
    with pytest.raises(TypeError, match="uint8"):
        fragments.pack_fragments(w13_packed.int(), w13_scale)
