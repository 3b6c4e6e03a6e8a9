"""One call of one benchmarked kernel inside an NVTX range named "profile", for Nsight Compute
(`scripts/gpu.sh tune ncu`).

    ncu --nvtx --nvtx-include "profile/" python -m tools.tune.ncu_targets kda_prefill_b1

builds the bench inputs of the target (bench.cases_*), runs the op twice outside the range (Triton compiles on
the first call; the second settles the allocator) and once inside it, so the profile holds exactly one call's
kernels (a target of several sizes, like moe_mxfp4, does this once per size, in order). The bench already checked these calls against float64; this script only places them for the profiler.
"""
from __future__ import annotations

import argparse

import torch

from bench.context import load, make_context
from bench.cases_kda import HEADS, HEAD_DIM, _gate, prefill_inputs
from bench.cases_mla import HEADS as MLA_HEADS, LATENT, PAGE, SCALE, V_DIM
from bench.cases_moe import EXPERTS, LATENT as MOE_LATENT, SITU_BETA, SITU_LINEAR_BETA, TOKENS, TOP_K, WIDTH


def _kda_prefill(lengths: tuple[int, ...]):
    def build(ctx):
        x = prefill_inputs(ctx, lengths, HEADS, HEAD_DIM)
        kernel, args = load("kernels.triton.kda_prefill:kda_prefill"), x.host_args()
        return lambda: kernel(*args)
    return build


def _kda_decode(num_seqs: int):
    def build(ctx):
        pool = ctx.randn(num_seqs + 3, HEADS, HEAD_DIM, HEAD_DIM, scale=0.05, dtype=torch.float32)
        slots = torch.randperm(num_seqs + 3, generator=ctx.generator)[:num_seqs].to(ctx.device)
        q, k, v, f = (ctx.randn(num_seqs, HEADS, HEAD_DIM) for _ in range(4))
        beta, gate = ctx.randn(num_seqs, HEADS), _gate(ctx, HEADS, HEAD_DIM)
        kernel = load("kernels.triton.kda_decode:kda_decode")
        return lambda: kernel(q, k, v, f, beta, gate, pool, slots, HEAD_DIM ** -0.5)
    return build


def _mla_decode(batch: int, seq_len: int):
    def build(ctx):
        pages = -(-seq_len // PAGE)
        kv_cache = ctx.randn(batch * pages + 5, PAGE, LATENT)
        order = torch.randperm(batch * pages + 5, generator=ctx.generator)[:batch * pages]
        page_table = order.view(batch, pages).to(device=ctx.device, dtype=torch.int32)
        seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=ctx.device)
        q = ctx.randn(batch, MLA_HEADS, LATENT)
        kernel = load("kernels.triton.mla_decode:mla_decode")
        return lambda: kernel(q, kv_cache, page_table, seq_lens, SCALE, V_DIM)
    return build


def _moe_experts(ctx):
    x = ctx.randn(TOKENS, MOE_LATENT)
    w13 = ctx.randn(EXPERTS, 2 * WIDTH, MOE_LATENT, scale=MOE_LATENT ** -0.5)
    w2 = ctx.randn(EXPERTS, MOE_LATENT, WIDTH, scale=WIDTH ** -0.5)
    route = load("kernels.torch.moe:moe_route")(ctx.randn(TOKENS, EXPERTS, dtype=torch.float32), None, TOP_K,
                                                  "sigmoid", True, 1.0)
    kernel = load("kernels.triton.moe_experts:moe_experts")
    return lambda: kernel(x, w13, w2, route.weights, route.expert_ids, "situ", SITU_BETA, SITU_LINEAR_BETA)


MXFP4_TOKENS = (1, 64, 512, 1024)          # decode at 16 and 1024 routed rows, prefill at 8K and 16K


def _moe_mxfp4(ctx):
    """The MXFP4 expert op at K3's per-GPU shapes (bench.moe_mxfp4_bench's experts and routing), one call per
    entry of MXFP4_TOKENS, each in its own profile range."""
    from bench.moe_mxfp4_bench import K3_SHAPE, _problem, expert_weights
    from k3core.model.mxfp4 import max_scale_of
    packed = expert_weights(ctx, K3_SHAPE)
    (w13, w13_scale), (w2, w2_scale) = packed["w13"], packed["w2"]
    bound = max_scale_of(w13_scale, w2_scale)
    op = load("kernels.triton.moe_mxfp4:moe_experts_mxfp4")

    def call(tokens):
        x, _, weights, expert_ids = _problem(ctx, K3_SHAPE, tokens, packed)
        return lambda: op(x, w13, w13_scale, w2, w2_scale, weights, expert_ids, "situ", SITU_BETA, SITU_LINEAR_BETA,
                          max_scale=bound)
    return [call(tokens) for tokens in MXFP4_TOKENS]


TARGETS = {"kda_prefill_b1": _kda_prefill((32768,)), "kda_prefill_8x4k": _kda_prefill((4096,) * 8),
           "kda_prefill_64x512": _kda_prefill((512,) * 64), "kda_decode_64": _kda_decode(64),
           "mla_decode_b1": _mla_decode(1, 131072), "mla_decode_b64": _mla_decode(64, 8192),
           "moe_experts": _moe_experts, "moe_mxfp4": _moe_mxfp4}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", choices=sorted(TARGETS))
    args = parser.parse_args(argv)
    ctx = make_context(smoke=False)
    built = TARGETS[args.target](ctx)
    calls = built if isinstance(built, list) else [built]
    for call in calls:
        call()
        call()
        torch.cuda.synchronize(ctx.device)
        torch.cuda.nvtx.range_push("profile")
        call()
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize(ctx.device)
    print(f"{args.target}: {len(calls)} call(s) profiled, one range each")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
