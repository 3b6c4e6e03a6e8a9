"""Every launch variant the decode tuning sweep can pick (MLA "page"/"gather" tiles, split counts, LSE merge steps;
KDA value blocks) against the float64 references, so that any row of kernels/triton/tuning_ops.py is safe to paste.

Runs under TRITON_INTERPRET=1 on the CPU (float32, small shapes) or compiled on a GPU. Kernel outputs are
NaN-poisoned, cache entries past a request's length are NaN, the page table is shuffled and padded with garbage.
"""
from __future__ import annotations

import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from test_triton_ops import paged_cache  # noqa: E402  (NaN-filled pages, shuffled table)

from k3core.ops import KdaGateParams
from kernels.torch import kda as ref_kda
from kernels.torch import mla as ref_mla
from kernels.triton import mla_decode
from kernels.triton.kda_decode import kda_decode
from kernels.triton.tuning_ops import (
    KdaDecodeConfig,
    MlaDecodeConfig,
    mla_decode_config,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") == "0"
                      else "cpu")
# float32 scores over <= 48 dims, online softmax over <= 96 entries, split partials merged by LSE (as in
# test_triton_ops); the LSE is ~log(96) + max score, so its float32 error is ~1e-6 absolute.
OUT_TOL = {"atol": 2e-5, "rtol": 1e-5}
LSE_TOL = {"atol": 1e-5, "rtol": 1e-6}
# KDA: one float32 step on O(1) inputs, state entries ~1 (same bounds as test_triton_kda)
KDA_OUT_TOL = {"atol": 2e-5, "rtol": 2e-5}
KDA_STATE_TOL = {"atol": 5e-5, "rtol": 2e-5}


def _generator(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _randn(*shape, generator):
    return torch.randn(*shape, dtype=torch.float64, generator=generator).to(torch.float32).to(DEVICE)


def _mla_case(seq_lens, page_size, v_dim=32, rope_dim=16, heads=3):
    generator = _generator(seq_lens, page_size, v_dim, rope_dim)
    latent = v_dim + rope_dim
    kv_cache, page_table = paged_cache(seq_lens, page_size, latent, generator)
    q = _randn(len(seq_lens), heads, latent, generator=generator)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    table = page_table.cpu().clamp(max=kv_cache.shape[0] - 1)      # the reference gathers before it masks
    expected = ref_mla.mla_decode(q.double().cpu(), kv_cache.double().cpu(), table, seq_lens_t.cpu(),
                                  latent ** -0.5, v_dim)
    return q, kv_cache, page_table, seq_lens_t, latent ** -0.5, v_dim, expected


def _poisoned(fn):
    """Run fn with torch.empty returning NaN-filled floats, so an unwritten output element fails the check."""
    original = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = original(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = poisoned_empty
    try:
        return fn()
    finally:
        torch.empty = original


def _check_mla(result, expected):
    assert not torch.isnan(result.output).any() and not torch.isnan(result.lse).any(), "an output was not written"
    torch.testing.assert_close(result.output.double().cpu(), expected.output, **OUT_TOL)
    torch.testing.assert_close(result.lse.double().cpu(), expected.lse, **LSE_TOL)


# page 16: whole pages, partial last pages, a 1-entry request; page 32 with block_n 16: two tiles per page (the
# prefetched page id is the same page half the time, and tiles start mid-page)
@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("seq_lens", [[1], [16, 32, 48], [17, 1, 95], [33, 64]])
@pytest.mark.parametrize("tiles", ["page", "gather"])
@pytest.mark.parametrize("num_splits", [1, 3, 16])             # 16: most splits lie past every request's end
def test_mla_decode_tiles_match_reference(page_size, seq_lens, tiles, num_splits):
    q, kv_cache, page_table, seq_lens_t, scale, v_dim, expected = _mla_case(seq_lens, page_size)
    config = MlaDecodeConfig(block_h=16, block_n=16, num_warps=1, num_stages=1, programs_per_unit=2, tiles=tiles)
    result = _poisoned(lambda: mla_decode.mla_decode_with_splits(q, kv_cache, page_table, seq_lens_t, scale, v_dim,
                                                                 num_splits, config))
    _check_mla(result, expected)


@pytest.mark.parametrize("merge_splits,merge_block_v", [(1, 0), (2, 16), (4, 0), (16, 32)])
# 48: the second value half partly past v_dim (masked); 16: all of it past v_dim
@pytest.mark.parametrize("v_dim,rope_dim", [(32, 16), (48, 8), (16, 16)])
def test_mla_decode_merge_steps_match_reference(merge_splits, merge_block_v, v_dim, rope_dim):
    q, kv_cache, page_table, seq_lens_t, scale, v_dim, expected = _mla_case([70, 1, 33], 16, v_dim, rope_dim)
    config = MlaDecodeConfig(block_h=16, block_n=16, num_warps=1, num_stages=1, programs_per_unit=2, tiles="page",
                             merge_splits=merge_splits, merge_block_v=merge_block_v)
    result = _poisoned(lambda: mla_decode.mla_decode_with_splits(q, kv_cache, page_table, seq_lens_t, scale, v_dim,
                                                                 5, config))
    _check_mla(result, expected)


def test_mla_decode_waves_policy_fills_whole_waves():
    cpu = torch.device("cpu")                              # 4 compute units under the interpreter
    # 3 requests, 8 slots: "cover" takes 3 splits (9 programs: a second wave of one), "waves" 2 (one full wave)
    assert mla_decode.choose_num_splits(cpu, 3, 1, 4096, 16, 2, "cover") == 3
    assert mla_decode.choose_num_splits(cpu, 3, 1, 4096, 16, 2, "waves") == 2
    assert mla_decode.choose_num_splits(cpu, 1, 1, 4096, 16, 2, "waves") == 8
    assert mla_decode.choose_num_splits(cpu, 1, 1, 100, 16, 2, "waves") == 2       # never a split under 4 tiles
    assert mla_decode.choose_num_splits(cpu, 20, 1, 4096, 16, 2, "waves") == 1
    with pytest.raises(ValueError, match="split_policy"):
        mla_decode.choose_num_splits(cpu, 3, 1, 4096, 16, 2, "even")


@pytest.mark.parametrize("split_policy", ["cover", "waves"])
@pytest.mark.parametrize("programs_per_unit", [1, 3])
def test_mla_decode_split_policies_match_reference(split_policy, programs_per_unit):
    q, kv_cache, page_table, seq_lens_t, scale, v_dim, expected = _mla_case([70, 7, 33], 16)
    config = mla_decode_config(q.device, q.shape[1], q.shape[0], 16)._replace(
        programs_per_unit=programs_per_unit, split_policy=split_policy)
    _check_mla(_poisoned(lambda: mla_decode.mla_decode(q, kv_cache, page_table, seq_lens_t, scale, v_dim, config)),
               expected)


@pytest.mark.parametrize("programs_per_unit", [1, 8])
def test_mla_decode_programs_per_unit_match_reference(programs_per_unit):
    q, kv_cache, page_table, seq_lens_t, scale, v_dim, expected = _mla_case([40, 7], 16)
    config = mla_decode_config(q.device, q.shape[1], q.shape[0], 16)._replace(programs_per_unit=programs_per_unit)
    _check_mla(_poisoned(lambda: mla_decode.mla_decode(q, kv_cache, page_table, seq_lens_t, scale, v_dim, config)),
               expected)


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_mla_decode_nvidia_tables_fit_float32_caches_in_shared_memory(monkeypatch, batch):
    """The tuned bf16 tiles (64 entries x 3 stages) asked for 335936 bytes in float32 on an H200 (limit 232448):
    (stages - 1) buffers of block_n x 576 entries plus the 16 x 576 query tile and about 41 KB more.
    The float32 config must fit by that same count."""
    from kernels.triton import tuning_ops
    monkeypatch.setattr(tuning_ops, "target", lambda device: "nvidia")
    for element_size in (2, 4):
        config = tuning_ops.mla_decode_config(torch.device("cuda"), 12, batch, 64, element_size)
        needed = ((config.num_stages - 1) * config.block_n + 16) * 576 * element_size + 41 * 1024
        assert needed <= 232448, (element_size, config, needed)


def test_mla_decode_config_picks_gather_tiles_where_a_tile_spans_pages():
    assert mla_decode_config(torch.device("cpu"), 12, 1, 16).tiles == "page"
    assert mla_decode_config(torch.device("cpu"), 12, 1, 4).tiles == "gather"


def test_mla_decode_rejects_configs_it_cannot_run():
    q, kv_cache, page_table, seq_lens_t, scale, v_dim, _ = _mla_case([5], 4)
    page = MlaDecodeConfig(block_h=16, block_n=16, num_warps=1, num_stages=1, programs_per_unit=2, tiles="page")
    with pytest.raises(ValueError, match="divide the page size"):
        mla_decode.mla_decode_with_splits(q, kv_cache, page_table, seq_lens_t, scale, v_dim, 1, page)
    with pytest.raises(ValueError, match="unknown tiles"):
        mla_decode.mla_decode_with_splits(q, kv_cache, page_table, seq_lens_t, scale, v_dim, 1,
                                          page._replace(tiles="rows"))
    with pytest.raises(ValueError, match="power of two"):
        mla_decode.mla_decode_with_splits(q, kv_cache, page_table, seq_lens_t, scale, v_dim, 1,
                                          page._replace(tiles="gather", merge_splits=3))
    with pytest.raises(ValueError, match="split_policy"):
        mla_decode.mla_decode_with_splits(q, kv_cache, page_table, seq_lens_t, scale, v_dim, 1,
                                          page._replace(tiles="gather", split_policy="even"))


# (16, 24, 16): a partial value block; (8, 16, 24): a key width below its power-of-two tile (masked lanes)
@pytest.mark.parametrize("block_v,v_dim,k_dim", [(1, 16, 16), (4, 32, 16), (8, 24, 16), (16, 24, 16), (8, 16, 24),
                                                 (64, 32, 16)])
def test_kda_decode_value_blocks_match_reference(block_v, v_dim, k_dim):
    generator = _generator(block_v, v_dim, k_dim)
    num_seqs, heads, num_slots = 3, 2, 7
    inputs = {"q": _randn(num_seqs, heads, k_dim, generator=generator),
                  "k": _randn(num_seqs, heads, k_dim, generator=generator),
                  "v": _randn(num_seqs, heads, v_dim, generator=generator),
                  "f": _randn(num_seqs, heads, k_dim, generator=generator),
                  "beta_logits": _randn(num_seqs, heads, generator=generator)}
    gate = KdaGateParams(_randn(heads, generator=generator) * 0.5, _randn(heads * k_dim, generator=generator),
                         "lower_bound", -5.0)
    arena = _randn(num_slots, 2, heads, v_dim, k_dim, generator=generator)
    state = arena[:, 1]                                            # dim 0 strided, like a view into the pool
    before = arena.clone()
    slot_ids = torch.tensor([5, 0, 3], device=DEVICE)
    expected_state = state.double()
    expected = ref_kda.kda_decode(**{n: t.double() for n, t in inputs.items()}, gate=gate, state=expected_state,
                                  slot_ids=slot_ids, scale=0.3)
    out = _poisoned(lambda: kda_decode(**inputs, gate=gate, state=state, slot_ids=slot_ids, scale=0.3,
                                       config=KdaDecodeConfig(block_v=block_v, num_warps=1)))
    torch.testing.assert_close(out.double(), expected, **KDA_OUT_TOL)
    torch.testing.assert_close(state[slot_ids].double(), expected_state[slot_ids], **KDA_STATE_TOL)
    untouched = torch.tensor([s not in (5, 0, 3) for s in range(num_slots)], device=DEVICE)
    assert torch.equal(arena[untouched], before[untouched]) and torch.equal(arena[:, 0], before[:, 0])


def test_kda_decode_rejects_a_block_v_that_is_not_a_power_of_two():
    q = torch.randn(1, 1, 16, device=DEVICE)
    gate = KdaGateParams(torch.zeros(1, device=DEVICE), torch.zeros(16, device=DEVICE), "lower_bound", -5.0)
    with pytest.raises(ValueError, match="power of two"):
        kda_decode(q, q, q, q, torch.zeros(1, 1, device=DEVICE), gate, torch.zeros(2, 1, 16, 16, device=DEVICE),
                   torch.zeros(1, dtype=torch.int64, device=DEVICE), 1.0, KdaDecodeConfig(block_v=12, num_warps=1))
