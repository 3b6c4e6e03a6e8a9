"""LatentMoE expert benchmark: our Triton `moe_experts` and the `torch._grouped_mm` provider
against the bare grouped GEMMs on the same routed rows, and the routed path of a whole layer against its GEMMs.

Shape: one rank at TP8 holding 112 experts, top-16 over them, 1024 tokens = 16384 routed rows, experts working in
the 3584-wide latent with expert width 3072 and SiTU-GLU. The layer row is the whole layer on that rank, as the
layer target counts it: router GEMM, routing, latent down projection, the experts through the grouped_mm provider
(torch._grouped_mm where it runs, else the Triton kernels), the latent RMSNorm, the up projection and the shared
expert (intermediate 2 x 3072 split over TP8: 768 per rank). Its anchor is the sum of its seven GEMMs, each timed
alone: the two grouped expert GEMMs, router, latent down and up, shared gate/up and down.
"""
from __future__ import annotations

import torch

from bench.context import BenchContext, load
from bench.report import Row, check, poison_allocator

EXPERTS, TOP_K, LATENT, WIDTH, HIDDEN, TOKENS, SHARED = 112, 16, 3584, 3072, 7168, 1024, 2 * 3072 // 8
SMOKE = dict(experts=6, top_k=2, latent=32, width=16, hidden=48, tokens=24, shared=8)
SITU_BETA, SITU_LINEAR_BETA = 4.0, 25.0
# the hidden activation is rounded to bf16 between the two GEMMs (as in every bf16 MoE), on top of the output
# rounding: two roundings, hence 2e-2 rather than the single-rounding 1e-2
MOE_TOL = 2e-2
REF_TOKENS = 64                   # the float64 reference (a loop over experts) runs on the first tokens


def _shape(ctx: BenchContext) -> dict:
    return SMOKE if ctx.smoke else dict(experts=EXPERTS, top_k=TOP_K, latent=LATENT, width=WIDTH, hidden=HIDDEN,
                                        tokens=TOKENS, shared=SHARED)


def grouped_mm_unavailable(ctx: BenchContext) -> str:
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if ctx.device.type == "cuda" and torch.cuda.get_device_capability(ctx.device)[0] < 9:
        return "torch._grouped_mm's CUTLASS path needs compute capability 9.0+"
    return ""


def moe_rows(ctx: BenchContext) -> list[Row]:
    s = _shape(ctx)
    experts, top_k, latent, width, tokens = s["experts"], s["top_k"], s["latent"], s["width"], s["tokens"]
    x = ctx.randn(tokens, latent)                                                  # [T, D]
    w13 = ctx.randn(experts, 2 * width, latent, scale=latent ** -0.5)              # [E, 2I, D]
    w2 = ctx.randn(experts, latent, width, scale=width ** -0.5)                    # [E, D, I]
    route = load("kernels.torch.moe:moe_route")(ctx.randn(tokens, experts, dtype=torch.float32), None, top_k,
                                                  "sigmoid", True, 1.0)
    weights, expert_ids = route.weights, route.expert_ids                          # [T, k]
    rows_routed = tokens * top_k
    flops = float(6 * rows_routed * latent * width)
    weight_bytes = float((w13.numel() + w2.numel()) * w13.element_size())
    shape = f"{rows_routed} rows E={experts} top{top_k}"
    args = (weights, expert_ids, "situ", SITU_BETA, SITU_LINEAR_BETA)

    checked = tokens if ctx.smoke else REF_TOKENS
    ref = load("kernels.torch.moe:moe_experts")(x[:checked].double(), w13.double(), w2.double(),
                                                 weights[:checked], expert_ids[:checked], *args[2:])
    gemm_ms, gemm_unavailable, gemm_checks = _plain_grouped_gemms(ctx, x, w13, w2, expert_ids)

    rows = []
    for provider, target in (("k3core triton moe_experts", "kernels.triton.moe_experts:moe_experts"),
                             ("k3core grouped_mm provider", "backends.cuda.grouped_mm:moe_experts")):
        row = Row("moe_experts", shape, provider, "plain torch._grouped_mm (2 GEMMs only)", flops=flops,
                  bytes=weight_bytes, anchor_unavailable=gemm_unavailable, anchor_checks=list(gemm_checks),
                  anchor_ms=gemm_ms, notes="ratio = GEMM-only time / whole expert op (1.0 = no overhead)")
        if target.startswith("backends") and gemm_unavailable:
            row.checks.append(check(torch.tensor([float("nan")]), torch.tensor([1.0]), 0.0,
                                    f"provider not run: {gemm_unavailable}"))
            rows.append(row)
            continue
        kernel = load(target)

        def ours(kernel=kernel):
            return kernel(x, w13, w2, weights, expert_ids, *args[2:])

        poison_allocator(ctx.device, x.numel() * x.element_size())
        out = ours()
        row.checks.append(check(out[:checked], ref, ctx.tolerance(MOE_TOL), f"output, first {checked} tokens",
                                full=out))
        if row.passed:
            timing = ctx.timer.time(ours)
            row.ours_ms, row.timing = timing.ms, timing.method
        rows.append(row)
    rows.append(_layer_row(ctx, s, x, w13, w2, gemm_ms, gemm_unavailable, gemm_checks, flops))
    return rows


def _plain_grouped_gemms(ctx: BenchContext, x, w13, w2, expert_ids):
    """The floor the expert ops are held to: two grouped GEMMs on rows already sorted by expert (no gather,
    activation, weighting or combine), each timed on its own and summed."""
    why = grouped_mm_unavailable(ctx)
    if why:
        return None, why, []
    experts, top_k = w13.shape[0], expert_ids.shape[1]
    order = torch.argsort(expert_ids.flatten(), stable=True)                      # [P]
    rows = x[order // top_k].contiguous()                                           # [P, D] sorted by expert
    offs = torch.cumsum(torch.bincount(expert_ids.flatten(), minlength=experts), 0).to(torch.int32)  # [E]
    hidden = torch._grouped_mm(rows, w13.transpose(-2, -1), offs=offs)              # [P, 2I]
    act = load("kernels.torch.activation:glu_activation")(hidden, "situ", SITU_BETA, SITU_LINEAR_BETA)  # [P, I]
    # check the GEMM against float64 on the first expert's rows (a wrong anchor would make any ratio meaningless)
    first = int(offs[0])
    checks = []
    if first > 0:
        ref = rows[:first].double() @ w13[0].double().T
        checks.append(check(hidden[:first], ref, ctx.tolerance(1e-2), "grouped GEMM rows of expert 0"))
    else:
        checks.append(check(torch.tensor([float("nan")]), torch.tensor([1.0]), 0.0, "expert 0 received no rows"))
    up_ms = ctx.timer.time(lambda: torch._grouped_mm(rows, w13.transpose(-2, -1), offs=offs)).ms
    down_ms = ctx.timer.time(lambda: torch._grouped_mm(act, w2.transpose(-2, -1), offs=offs)).ms
    return up_ms + down_ms, "", checks


def _layer_row(ctx: BenchContext, s: dict, latent_x, w13, w2, gemm_ms, gemm_unavailable, gemm_checks,
               expert_flops) -> Row:
    hidden_dim, latent, experts, top_k, shared = s["hidden"], s["latent"], s["experts"], s["top_k"], s["shared"]
    tokens = s["tokens"]
    x = ctx.randn(tokens, hidden_dim)                                              # [T, H]
    w_router = ctx.randn(experts, hidden_dim, scale=hidden_dim ** -0.5)            # [E, H]
    w_down = ctx.randn(latent, hidden_dim, scale=hidden_dim ** -0.5)               # [D, H]
    w_up = ctx.randn(hidden_dim, latent, scale=latent ** -0.5)                     # [H, D]
    w_shared13 = ctx.randn(2 * shared, hidden_dim, scale=hidden_dim ** -0.5)       # [2S, H]
    w_shared2 = ctx.randn(hidden_dim, shared, scale=shared ** -0.5)                # [H, S]
    norm_weight = 1.0 + ctx.randn(latent, scale=0.1)
    # the grouped_mm provider where it runs (bf16, sm90+), else the Triton kernels
    use_grouped_mm = not gemm_unavailable and ctx.dtype == torch.bfloat16
    experts_target = ("backends.cuda.grouped_mm:moe_experts" if use_grouped_mm
                      else "kernels.triton.moe_experts:moe_experts")
    route, experts_op = load("kernels.triton.moe_route:moe_route"), load(experts_target)
    norm, glu = load("kernels.triton.norm:rms_norm"), load("kernels.triton.activation:glu_activation")

    def layer():
        logits = (x @ w_router.T).float()                                          # [T, E]
        chosen = route(logits, None, top_k, "sigmoid", True, 1.0)
        z = x @ w_down.T                                                           # [T, D] latent
        y = experts_op(z, w13, w2, chosen.weights, chosen.expert_ids, "situ", SITU_BETA, SITU_LINEAR_BETA)
        routed = norm(y, norm_weight, 1e-5) @ w_up.T                               # [T, H]
        return routed + glu(x @ w_shared13.T, "situ", SITU_BETA, SITU_LINEAR_BETA) @ w_shared2.T

    def reference():
        # the same float32 router logits as the layer (bf16 GEMM): float64 logits could pick other experts at
        # near ties, which would test the routing's rounding rather than the layer's arithmetic
        logits = (x @ w_router.T).float()                                          # [T, E]
        chosen = load("kernels.torch.moe:moe_route")(logits, None, top_k, "sigmoid", True, 1.0)
        x64 = x[:checked].double()
        y = load("kernels.torch.moe:moe_experts")(x64 @ w_down.double().T, w13.double(), w2.double(),
                                                  chosen.weights[:checked], chosen.expert_ids[:checked], "situ",
                                                  SITU_BETA, SITU_LINEAR_BETA)
        routed = load("kernels.torch.norm:rms_norm")(y, norm_weight.double(), 1e-5) @ w_up.double().T
        act = load("kernels.torch.activation:glu_activation")(x64 @ w_shared13.double().T, "situ", SITU_BETA,
                                                              SITU_LINEAR_BETA)
        return routed + act @ w_shared2.double().T

    checked = tokens if ctx.smoke else REF_TOKENS
    dense_flops = 2.0 * tokens * hidden_dim * (experts + 2 * latent + 3 * shared)
    provider = "torch._grouped_mm" if use_grouped_mm else "triton"
    row = Row("moe_layer", f"T={tokens} (whole layer, shared expert)",
              f"k3core route + {provider} experts + proj + shared", "sum of its 7 GEMMs, each alone",
              flops=expert_flops + dense_flops,
              bytes=float((w13.numel() + w2.numel() + w_down.numel() + w_up.numel() + w_shared13.numel()
                           + w_shared2.numel()) * w13.element_size()),
              anchor_unavailable=gemm_unavailable, anchor_checks=list(gemm_checks))
    poison_allocator(ctx.device, x.numel() * x.element_size())
    out = layer()
    # z, the expert hidden, y, the normed y and the shared hidden are rounded to bf16 on the way: MOE_TOL, as for
    # the experts
    row.checks.append(check(out[:checked], reference(), ctx.tolerance(MOE_TOL), f"output, first {checked} tokens",
                            full=out))
    if row.passed:
        timing = ctx.timer.time(layer)
        row.ours_ms, row.timing = timing.ms, timing.method
    if gemm_ms is not None and row.passed:
        # the five dense GEMMs alone, on inputs of the layer's shapes (what they multiply does not change their time)
        z = x @ w_down.T
        act = glu(x @ w_shared13.T, "situ", SITU_BETA, SITU_LINEAR_BETA)
        dense = {"router": lambda: x @ w_router.T, "latent down": lambda: x @ w_down.T,
                 "latent up": lambda: z @ w_up.T, "shared gate/up": lambda: x @ w_shared13.T,
                 "shared down": lambda: act @ w_shared2.T}
        dense_ms = {name: ctx.timer.time(fn).ms for name, fn in dense.items()}
        row.anchor_ms = gemm_ms + sum(dense_ms.values())
        parts = ", ".join(f"{name} {ms:.3f}" for name, ms in dense_ms.items())
        row.notes = (f"ratio = sum of the layer's GEMMs / whole layer (target: >= 1/1.3 = 0.77). GEMMs in ms: "
                     f"expert pair {gemm_ms:.3f}, {parts}; the layer over its expert GEMMs alone: "
                     f"{row.ours_ms / gemm_ms:.2f}x")
    return row
