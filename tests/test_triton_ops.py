"""The portable Triton kernels (MLA, MoE, AttnRes, norms, activation) against the float64 torch references.

On a CPU box the kernels run under TRITON_INTERPRET=1 in float32 (set below before triton is imported); on a GPU
they run compiled. Every kernel-allocated output is NaN-poisoned (torch.empty is patched to fill with NaN) so that
an element a kernel forgets to write fails the comparison. Inputs are fresh random tensors, shapes are the awkward
ones (1, 15, 63, 64, 65 tokens, mixed varlen batches, empty batches, non-power-of-two widths).
"""
from __future__ import annotations

import math
import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from kernels.torch import activation as ref_activation  # noqa: E402
from kernels.torch import attn_res as ref_attn_res  # noqa: E402
from kernels.torch import mla as ref_mla  # noqa: E402
from kernels.torch import moe as ref_moe  # noqa: E402
from kernels.torch import norm as ref_norm  # noqa: E402
from kernels.triton import activation, attn_res, mla_decode, mla_prefill, moe_experts, moe_route, norm  # noqa: E402
from kernels.triton import tuning_ops  # noqa: E402
from poison_helpers import nan_poisoned_allocations  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu")


def randn(*shape, scale=1.0, generator=None):
    return (torch.randn(*shape, dtype=torch.float64, generator=generator) * scale).to(torch.float32).to(DEVICE)


def f64(t):
    return t.detach().to("cpu", torch.float64)


def check(actual, expected, atol, rtol, what):
    assert not torch.isnan(actual).any(), f"{what}: NaN in the kernel output (an element was not written)"
    torch.testing.assert_close(f64(actual), f64(expected), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------------------------------------- norms, activation
@pytest.mark.parametrize("shape", [(1, 64), (15, 48), (3, 5, 100), (0, 32)])
def test_rms_norm(shape):
    x, weight = randn(*shape, scale=3.0), randn(shape[-1])
    with nan_poisoned_allocations():
        out = norm.rms_norm(x, weight, 1e-6)
    # float32 sum of squares over <= 100 elements against float64: a few ulp of relative error
    check(out, ref_norm.rms_norm(f64(x), f64(weight), 1e-6), atol=1e-5, rtol=1e-5, what="rms_norm")


@pytest.mark.parametrize("shape", [(1, 64), (15, 48), (2, 7, 100)])
def test_gated_rms_norm(shape):
    x, gate, weight = randn(*shape), randn(*shape, scale=4.0), randn(shape[-1])
    with nan_poisoned_allocations():
        out = norm.gated_rms_norm(x, gate, weight, 1e-5)
    # float32 end to end against float64: a few ulp relative
    check(out, ref_norm.gated_rms_norm(f64(x), f64(gate), f64(weight), 1e-5), atol=1e-5, rtol=1e-5,
          what="gated_rms_norm")


@pytest.mark.parametrize("activation_name,beta,linear_beta", [("silu", None, None), ("situ", 4.0, 25.0),
                                                               ("situ", 1.5, 3.0), ("situ", 4.0, None)])
@pytest.mark.parametrize("num_tokens,inter", [(1, 16), (15, 40), (65, 8)])
def test_glu_activation(activation_name, beta, linear_beta, num_tokens, inter):
    # scale 8 pushes gate and up well past the soft-clip ranges, and small values exercise the tanh series branch
    x = randn(num_tokens, 2 * inter, scale=8.0)
    x[:, ::3] *= 1e-3
    with nan_poisoned_allocations():
        out = activation.glu_activation(x, activation_name, beta, linear_beta)
    expected = ref_activation.glu_activation(f64(x), activation_name, beta, linear_beta)
    # exp-based tanh and sigmoid in float32: relative error a few ulp, outputs up to ~|gate * up| ~ 100
    check(out, expected, atol=2e-5, rtol=2e-5, what=f"glu_activation[{activation_name}]")


def test_glu_activation_rejects_unknown_activation():
    with pytest.raises(ValueError, match="choose one of"):
        activation.glu_activation(randn(2, 8), "gelu", 4.0, None)


# ---------------------------------------------------------------------------------------------- AttnRes
@pytest.mark.parametrize("num_tokens,width", [(1, 64), (15, 100), (64, 48)])
@pytest.mark.parametrize("num_valid", [0, 3, 8])
def test_attn_res_read(num_tokens, width, num_valid):
    slots = 9
    arena = randn(num_tokens, slots + 1, width, scale=2.0)
    arena[:, num_valid:] = float("nan")           # unsealed slots are garbage: the kernel must not read them
    bank = arena[:, 1:]                           # a strided view, as a slice of a larger per-forward buffer
    bank[:, :num_valid] = randn(num_tokens, num_valid, width, scale=2.0)
    live = randn(num_tokens, width, scale=5.0)
    query = randn(width, scale=0.3)
    with nan_poisoned_allocations():
        out = attn_res.attn_res_read(bank, num_valid, live, query, 1e-5)
    expected = ref_attn_res.attn_res_read(f64(bank), num_valid, f64(live), f64(query), 1e-5)
    # float32 dot/RMS over <= 100 elements, softmax over <= 9 candidates: relative ~1e-6 of outputs of size ~5
    check(out, expected, atol=2e-5, rtol=1e-5, what="attn_res_read")


# ---------------------------------------------------------------------------------------------- MLA prefill
def varlen(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("head_dim_qk,head_dim_v", [(24, 16), (64, 32), (48, 16)])
@pytest.mark.parametrize("query_lens,prefix_lens", [
    ([1], [0]),
    ([15, 1, 65], [0, 5, 3]),                    # mixes a 1-token sequence with longer ones, cached prefixes
    ([63, 64], [0, 1]),
    ([1, 1, 2], [7, 0, 30]),                     # decode-like rows with long prefixes
])
def test_mla_prefill(head_dim_qk, head_dim_v, query_lens, prefix_lens):
    heads = 2
    key_lens = [q + p for q, p in zip(query_lens, prefix_lens)]
    q = randn(sum(query_lens), heads, head_dim_qk)
    k = randn(sum(key_lens), heads, head_dim_qk)
    v = randn(sum(key_lens), heads, head_dim_v)
    cu_q, cu_k = varlen(query_lens), varlen(key_lens)
    scale = head_dim_qk ** -0.5
    with nan_poisoned_allocations():
        out = mla_prefill.mla_prefill(q, k, v, cu_q, cu_k, scale)
    expected = ref_mla.mla_prefill(f64(q), f64(k), f64(v), cu_q.cpu(), cu_k.cpu(), scale)
    # float32 scores over <= 64 dims and an online softmax over <= 70 keys: outputs are convex mixes of N(0,1)
    check(out, expected, atol=2e-5, rtol=1e-5, what="mla_prefill output")


def test_mla_prefill_empty_batch():
    q = randn(0, 2, 24)
    out = mla_prefill.mla_prefill(q, randn(0, 2, 24), randn(0, 2, 16), varlen([]), varlen([]), 0.2)
    assert out.shape == (0, 2, 16)


def test_split_head_dim():
    assert mla_prefill.split_head_dim(192) == (128, 64)
    assert mla_prefill.split_head_dim(128) == (128, 0)
    assert mla_prefill.split_head_dim(24) == (16, 16)


# ---------------------------------------------------------------------------------------------- MLA decode
def paged_cache(seq_lens, page_size, latent, generator):
    """A poisoned arena of pages (dim 0 strided) and a shuffled, non-contiguous page table."""
    pages_needed = [math.ceil(n / page_size) for n in seq_lens]
    max_pages = max(pages_needed) + 1                          # one spare column of garbage page ids
    num_pages = sum(pages_needed) + 5
    arena = torch.full((2 * num_pages, page_size, latent), float("nan"), device=DEVICE)
    kv_cache = arena[::2]                                      # any stride on dim 0, as a view into the pool
    permutation = torch.randperm(num_pages, generator=generator).tolist()
    page_table = torch.full((len(seq_lens), max_pages), 10 ** 6, dtype=torch.int32)   # garbage past the end
    for b, (n, used) in enumerate(zip(seq_lens, pages_needed)):
        for j in range(used):
            page = permutation.pop()
            page_table[b, j] = page
            valid = min(page_size, n - j * page_size)
            kv_cache[page, :valid] = randn(valid, latent, generator=generator)
    return kv_cache, page_table.to(DEVICE)


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("seq_lens", [[1], [15, 1, 65], [63, 64, 2]])
@pytest.mark.parametrize("v_dim,rope_dim", [(32, 16), (64, 8)])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_mla_decode(page_size, seq_lens, v_dim, rope_dim, num_splits):
    generator = torch.Generator().manual_seed(zlib.crc32(repr((page_size, seq_lens, v_dim, num_splits)).encode()))
    heads, latent = 2, v_dim + rope_dim
    kv_cache, page_table = paged_cache(seq_lens, page_size, latent, generator)
    q = randn(len(seq_lens), heads, latent, generator=generator)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = latent ** -0.5
    with nan_poisoned_allocations():
        if num_splits is None:
            result = mla_decode.mla_decode(q, kv_cache, page_table, seq_lens_t, scale, v_dim)
        else:
            result = mla_decode.mla_decode_with_splits(q, kv_cache, page_table, seq_lens_t, scale, v_dim, num_splits)
    table = page_table.cpu().clamp(max=kv_cache.shape[0] - 1)     # the reference gathers before it masks
    expected = ref_mla.mla_decode(f64(q), f64(kv_cache), table, seq_lens_t.cpu(), scale, v_dim)
    # float32 scores over <= 80 dims, online softmax over <= 65 entries, split partials merged by LSE
    check(result.output, expected.output, atol=2e-5, rtol=1e-5, what="mla_decode output")
    # the LSE is of size ~log(65) + max score: float32 absolute error ~1e-6
    check(result.lse, expected.lse, atol=1e-5, rtol=1e-6, what="mla_decode lse")
    assert result.lse.dtype == torch.float32 and result.output.dtype == q.dtype


def test_mla_decode_empty_batch():
    result = mla_decode.mla_decode(randn(0, 2, 48), randn(4, 16, 48), torch.zeros(0, 3, dtype=torch.int32,
                                   device=DEVICE), torch.zeros(0, dtype=torch.int32, device=DEVICE), 0.1, 32)
    assert result.output.shape == (0, 2, 32) and result.lse.shape == (0, 2)


# ---------------------------------------------------------------------------------------------- MoE routing
@pytest.mark.parametrize("num_tokens", [1, 15, 65])
@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (20, 5)])
@pytest.mark.parametrize("scoring,use_bias,renormalize,scaling", [
    ("sigmoid", True, True, 1.0), ("sigmoid", False, False, 2.5), ("softmax", False, True, 1.0),
    ("softmax", True, False, 0.5)])
def test_moe_route(num_tokens, num_experts, top_k, scoring, use_bias, renormalize, scaling):
    logits = randn(num_tokens, num_experts, scale=2.0)
    bias = randn(num_experts, scale=0.5) if use_bias else None
    with nan_poisoned_allocations():
        result = moe_route.moe_route(logits, bias, top_k, scoring, renormalize, scaling)
    expected = ref_moe.moe_route(f64(logits), None if bias is None else f64(bias), top_k, scoring, renormalize,
                                 scaling)
    # random float logits have no ties within float32 rounding, so the choice and its order must be exact
    assert torch.equal(result.expert_ids.cpu(), expected.expert_ids), "moe_route expert_ids"
    # float32 sigmoid/softmax and a sum of <= 5 terms: a few ulp relative
    check(result.weights, expected.weights, atol=1e-6, rtol=1e-5, what="moe_route weights")


# ---------------------------------------------------------------------------------------------- MoE experts
@pytest.mark.parametrize("num_tokens", [1, 15, 65])
@pytest.mark.parametrize("activation_name,beta,linear_beta", [("silu", None, None), ("situ", 4.0, 25.0)])
@pytest.mark.parametrize("expert_offset,local_experts", [(0, 8), (3, 4)])
def test_moe_experts(num_tokens, activation_name, beta, linear_beta, expert_offset, local_experts):
    hidden, inter, top_k, global_experts = 48, 24, 2, 8
    x = randn(num_tokens, hidden)
    w13 = randn(local_experts, 2 * inter, hidden, scale=hidden ** -0.5)
    w2 = randn(local_experts, hidden, inter, scale=inter ** -0.5)
    expert_ids = torch.stack([torch.randperm(global_experts)[:top_k] for _ in range(num_tokens)]).to(DEVICE)
    weights = torch.rand(num_tokens, top_k, device=DEVICE)
    with nan_poisoned_allocations():
        out = moe_experts.moe_experts(x, w13, w2, weights, expert_ids, activation_name, beta, linear_beta,
                                      expert_offset)
    expected = ref_moe.moe_experts(f64(x), f64(w13), f64(w2), f64(weights), expert_ids.cpu(), activation_name,
                                   beta, linear_beta, expert_offset)
    # two float32 GEMMs (K = 48 then 24) of unit-scale values and a 2-term float32 sum
    check(out, expected, atol=2e-5, rtol=1e-5, what="moe_experts")


def _uneven_blocks_routing(num_tokens, experts, block_m):
    """expert 0: 37 rows (a full block, then 5 rows: second half empty); expert 1: 20 rows (second half used);
    experts 2 and 3: 8 and 9 rows."""
    expert_ids = torch.tensor([[0, 1 if t < 20 else 2 + t % 2] for t in range(num_tokens)], device=DEVICE)
    counts = torch.bincount(expert_ids.reshape(-1).cpu(), minlength=experts)
    last_rows = (counts - 1) % block_m + 1                           # rows in each expert's last block
    assert (last_rows > block_m // 2).any() and (last_rows <= block_m // 2).any(), counts
    return expert_ids


@pytest.mark.parametrize("fused_gate_up", [False, True])
@pytest.mark.parametrize("sub_blocks,weight_desc", [(2, False), (1, True), (2, True)])
@pytest.mark.parametrize("hidden,inter,block_n", [(48, 24, 16), (40, 40, 32)])
def test_moe_experts_sub_blocks_and_weight_descriptors(monkeypatch, sub_blocks, weight_desc, hidden, inter, block_n,
                                                       fused_gate_up):
    """Row blocks as two halves sharing each weight tile (the second skipped when all padding) and weight tiles
    through descriptors, with gate/up as two dots or one fused dot, the whole op against float64. The routing gives
    blocks whose second half is used and blocks where it is empty. I = 24 with 16-wide columns: the second gate
    column block runs into the up rows (masked); D = 40: the last K tile and the last down column block run past
    the width."""
    block_m = 32
    tile = tuning_ops.GemmConfig(block_n=block_n, block_k=16, num_warps=1, num_stages=1, sub_blocks=sub_blocks,
                                 weight_desc=weight_desc)
    _check_moe_experts_with_tiles(monkeypatch, block_m, tile, fused_gate_up, _uneven_blocks_routing(37, 4, block_m),
                                  hidden, inter)


def _check_moe_experts_with_tiles(monkeypatch, block_m, tile, fused_gate_up, expert_ids, hidden, inter):
    """The whole op with `tile` for both GEMMs (gate/up fused or not) on 4 experts against float64, every output
    allocation NaN-poisoned: SiTU-GLU, top-k from expert_ids [T, k], random routing weights."""
    monkeypatch.setattr(moe_experts, "moe_gemm_config", lambda *args: tuning_ops.MoeGemmConfig(
        block_m=block_m, gate_up=tile._replace(fused_gate_up=fused_gate_up), down=tile))
    (num_tokens, top_k), experts = expert_ids.shape, 4
    x = randn(num_tokens, hidden)
    w13 = randn(experts, 2 * inter, hidden, scale=hidden ** -0.5)
    w2 = randn(experts, hidden, inter, scale=inter ** -0.5)
    weights = torch.rand(num_tokens, top_k, device=DEVICE)
    with nan_poisoned_allocations():
        out = moe_experts.moe_experts(x, w13, w2, weights, expert_ids, "situ", 4.0, 25.0)
    expected = ref_moe.moe_experts(f64(x), f64(w13), f64(w2), f64(weights), expert_ids.cpu(), "situ", 4.0, 25.0)
    check(out, expected, atol=2e-5, rtol=1e-5,
          what=f"moe_experts block_m={block_m} sub_blocks={tile.sub_blocks} weight_desc={tile.weight_desc} "
               f"fused_gate_up={fused_gate_up}")


def _three_sub_block_routing(block_m):
    """166 pairs over 4 experts of 10, 68, 40 and 48 rows: with block_m = 48 (three sub-blocks of 16) their last
    blocks use 1, 2, 3 and 3 sub-blocks, and expert 1 also fills a whole block. Token t takes the sorted multiset's
    entries t and t + 83, never the same expert twice (none has more than 83 rows)."""
    counts = [10, 68, 40, 48]
    flat = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))                # [166], sorted
    expert_ids = torch.stack([flat[:83], flat[83:]], dim=1)                               # [83, 2]
    assert (expert_ids[:, 0] != expert_ids[:, 1]).all()
    used = {-(-((c - 1) % block_m + 1) // (block_m // 3)) for c in counts}               # sub-blocks of last blocks
    assert used == {1, 2, 3}, used
    return expert_ids.to(DEVICE)


@pytest.mark.parametrize("fused_gate_up", [False, True])
@pytest.mark.parametrize("weight_desc", [False, True])
def test_moe_experts_three_sub_blocks(monkeypatch, weight_desc, fused_gate_up):
    """Row blocks of three sub-blocks sharing each weight tile (block_m 192 = 3 x 64 at K3 prefill; 48 = 3 x 16 here),
    with blocks that use one, two and all three: the whole op against float64. The trailing sub-blocks of a block
    are padding and must be neither computed into a routed row nor left unwritten where a pair sits (NaN-poisoned
    outputs). I = 24 with 16-wide columns and D = 40 end in partial tiles."""
    block_m = 48
    tile = tuning_ops.GemmConfig(block_n=16, block_k=16, num_warps=1, num_stages=1, sub_blocks=3,
                                 weight_desc=weight_desc)
    _check_moe_experts_with_tiles(monkeypatch, block_m, tile, fused_gate_up, _three_sub_block_routing(block_m),
                                  40, 24)


@pytest.mark.parametrize("block_m,sub_blocks", [(48, 2), (96, 4), (32, 3), (192, 2)])
def test_moe_sub_blocks_must_split_into_powers_of_two(block_m, sub_blocks):
    """A sub-block is a tl.arange of rows: 48 / 2 = 24 and 192 / 2 = 96 rows are not powers of two, 32 / 3 does not
    divide, and four sub-blocks are not written; each is refused with the rule, not compiled into garbage."""
    x, w13 = randn(9, 48), randn(4, 48, 48, scale=48 ** -0.5)
    blocks = moe_experts.group_pairs_by_expert(torch.zeros(9, 1, dtype=torch.long, device=DEVICE), 0, 4, block_m)
    tile = tuning_ops.GemmConfig(block_n=16, block_k=16, num_warps=1, num_stages=1, sub_blocks=sub_blocks)
    with pytest.raises(ValueError, match="sub_blocks must be 1, 2 or 3"):
        moe_experts.gate_up(x, w13, blocks, 1, "silu", None, None, block_m, tile)


@pytest.mark.parametrize("activation_name,beta,linear_beta", [("silu", None, None), ("situ", 4.0, 25.0)])
@pytest.mark.parametrize("sub_blocks,weight_desc", [(1, False), (2, False), (1, True), (2, True)])
@pytest.mark.parametrize("hidden,inter,block_n", [(48, 24, 16), (40, 40, 32)])
def test_moe_gate_up_fused(sub_blocks, weight_desc, hidden, inter, block_n, activation_name, beta, linear_beta):
    """The fused gate/up form (one weight operand of gate then up columns per K step, the accumulator split after
    the loop) by pointers and by the [E, 2, I, D] descriptor, with one and two sub-blocks, against float64
    act(x W13^T) of every routed row. I = 24 and 40 are not multiples of the 16 and 32 column tiles: the last tile
    runs past I, and its up columns must still come from rows I + col0 of the same expert. Blocks whose second half
    is used and blocks where it is empty; D = 40 ends in a partial K tile."""
    top_k, experts, num_tokens, block_m = 2, 4, 37, 32
    tile = tuning_ops.GemmConfig(block_n=block_n, block_k=16, num_warps=1, num_stages=1, sub_blocks=sub_blocks,
                                 weight_desc=weight_desc, fused_gate_up=True)
    x = randn(num_tokens, hidden)
    w13 = randn(experts, 2 * inter, hidden, scale=hidden ** -0.5)
    expert_ids = _uneven_blocks_routing(num_tokens, experts, block_m)
    blocks = moe_experts.group_pairs_by_expert(expert_ids, 0, experts, block_m)
    with nan_poisoned_allocations():
        hidden_rows = moe_experts.gate_up(x, w13, blocks, top_k, activation_name, beta, linear_beta, block_m, tile)
    flat = expert_ids.reshape(-1).cpu()                                               # [P]
    products = torch.einsum("pd,pnd->pn", f64(x)[torch.arange(flat.numel()) // top_k], f64(w13)[flat])   # [P, 2I]
    expected = ref_activation.glu_activation(products, activation_name, beta, linear_beta)
    # float32 dot over K <= 48 of unit-scale values, then the float32 GLU: a few ulp relative
    check(hidden_rows[blocks.row_of_pair], expected, atol=1e-5, rtol=1e-5,
          what=f"gate_up fused sub_blocks={sub_blocks} weight_desc={weight_desc} {activation_name}")


def test_moe_down_refuses_a_fused_tile():
    """fused_gate_up joins gate/up's two weight operands; the down GEMM has one and says so."""
    inter, hidden, experts, block_m = 24, 48, 4, 32
    w2 = randn(experts, hidden, inter, scale=inter ** -0.5)
    blocks = moe_experts.group_pairs_by_expert(_uneven_blocks_routing(37, experts, block_m), 0, experts, block_m)
    tile = tuning_ops.GemmConfig(block_n=16, block_k=16, num_warps=1, num_stages=1, fused_gate_up=True)
    with pytest.raises(ValueError, match="fused_gate_up"):
        moe_experts.down(torch.zeros(blocks.sorted_pairs.numel(), inter, device=DEVICE), w2, blocks, block_m, tile)


def test_moe_experts_weight_descriptors_fall_back_where_rows_cannot_be_described(monkeypatch):
    """A 50-wide float32 latent has 200-byte rows (not 16-byte aligned): the table's weight_desc choice becomes the
    pointer form for that GEMM, the output stays right, and asking a GEMM for descriptors there says why."""
    hidden, inter, top_k, experts, num_tokens = 50, 24, 2, 4, 9
    tile = tuning_ops.GemmConfig(block_n=16, block_k=16, num_warps=1, num_stages=1, weight_desc=True)
    config = tuning_ops.MoeGemmConfig(block_m=16, gate_up=tile, down=tile)
    x = randn(num_tokens, hidden)
    w13 = randn(experts, 2 * inter, hidden, scale=hidden ** -0.5)
    w2 = randn(experts, hidden, inter, scale=inter ** -0.5)
    runnable = moe_experts.runnable_config(config, w13, w2)
    assert not runnable.gate_up.weight_desc                      # W13 rows: 50 floats = 200 bytes
    assert runnable.down.weight_desc                             # W2 rows: 24 floats = 96 bytes, aligned
    assert moe_experts.runnable_config(config, w13[:, :, :48].contiguous(), w2) == config
    assert not moe_experts.runnable_config(config, w13, w2[::2]).down.weight_desc    # strided expert stack
    monkeypatch.setattr(moe_experts, "moe_gemm_config", lambda *args: config)
    expert_ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(num_tokens)]).to(DEVICE)
    weights = torch.rand(num_tokens, top_k, device=DEVICE)
    out = moe_experts.moe_experts(x, w13, w2, weights, expert_ids, "silu", None, None)
    expected = ref_moe.moe_experts(f64(x), f64(w13), f64(w2), f64(weights), expert_ids.cpu(), "silu", None, None)
    check(out, expected, atol=2e-5, rtol=1e-5, what="moe_experts, descriptor table on unaligned rows")
    blocks = moe_experts.group_pairs_by_expert(expert_ids, 0, experts, 16)
    with pytest.raises(ValueError, match="16-byte aligned rows"):
        moe_experts.gate_up(x, w13, blocks, top_k, "silu", None, None, 16, tile)
    with pytest.raises(ValueError, match="sub_blocks"):
        moe_experts.gate_up(x, w13, blocks, top_k, "silu", None, None, 16, tile._replace(sub_blocks=2,
                                                                                         weight_desc=False))


def test_moe_experts_empty_batch():
    out = moe_experts.moe_experts(randn(0, 48), randn(8, 48, 48), randn(8, 48, 24), torch.zeros(0, 2, device=DEVICE),
                                  torch.zeros(0, 2, dtype=torch.long, device=DEVICE), "silu", None, None)
    assert out.shape == (0, 48)
