"""LatentMoE expert benchmark (issue 6, target 5): our Triton `moe_experts` and the `torch._grouped_mm` provider
against the bare grouped GEMMs on the same routed rows, and the routed path of a whole layer against its GEMMs.

Shape: one rank at TP8 holding 112 experts, top-16 over them, 1024 tokens = 16384 routed rows, experts working in
the 3584-wide latent with expert width 3072 and SiTU-GLU. The layer row adds what surrounds the experts on that
rank: router GEMM, latent down projection, routing, the latent RMSNorm and the up projection (no shared expert).
"""
from __future__ import annotations

import torch

from bench.context import BenchContext, load
from bench.report import Row, check, poison_allocator

EXPERTS, TOP_K, LATENT, WIDTH, HIDDEN, TOKENS = 112, 16, 3584, 3072, 7168, 1024
SMOKE = dict(experts=6, top_k=2, latent=32, width=16, hidden=48, tokens=24)
SITU_BETA, SITU_LINEAR_BETA = 4.0, 25.0
# the hidden activation is rounded to bf16 between the two GEMMs (as in every bf16 MoE), on top of the output
# rounding: two roundings, hence 2e-2 rather than the single-rounding 1e-2
MOE_TOL = 2e-2
REF_TOKENS = 64                   # the float64 reference (a loop over experts) runs on the first tokens


def _shape(ctx: BenchContext) -> dict:
    return SMOKE if ctx.smoke else dict(experts=EXPERTS, top_k=TOP_K, latent=LATENT, width=WIDTH, hidden=HIDDEN,
                                        tokens=TOKENS)


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
    hidden_dim, latent, experts, top_k = s["hidden"], s["latent"], s["experts"], s["top_k"]
    x = ctx.randn(s["tokens"], hidden_dim)                                         # [T, H]
    w_router = ctx.randn(experts, hidden_dim, scale=hidden_dim ** -0.5)            # [E, H]
    w_down = ctx.randn(latent, hidden_dim, scale=hidden_dim ** -0.5)               # [D, H]
    w_up = ctx.randn(hidden_dim, latent, scale=latent ** -0.5)                     # [H, D]
    norm_weight = 1.0 + ctx.randn(latent, scale=0.1)
    route, experts_op = load("kernels.triton.moe_route:moe_route"), load("kernels.triton.moe_experts:moe_experts")
    norm = load("kernels.triton.norm:rms_norm")

    def layer(route=route, experts_op=experts_op, norm=norm):
        logits = (x @ w_router.T).float()                                          # [T, E]
        chosen = route(logits, None, top_k, "sigmoid", True, 1.0)
        z = x @ w_down.T                                                           # [T, D] latent
        y = experts_op(z, w13, w2, chosen.weights, chosen.expert_ids, "situ", SITU_BETA, SITU_LINEAR_BETA)
        return norm(y, norm_weight, 1e-5) @ w_up.T                                 # [T, H]

    def reference():
        # the same float32 router logits as the layer (bf16 GEMM): float64 logits could pick other experts at
        # near ties, which would test the routing's rounding rather than the layer's arithmetic
        logits = (x @ w_router.T).float()                                          # [T, E]
        chosen = load("kernels.torch.moe:moe_route")(logits, None, top_k, "sigmoid", True, 1.0)
        z = (x.double() @ w_down.double().T)
        y = load("kernels.torch.moe:moe_experts")(z[:checked], w13.double(), w2.double(), chosen.weights[:checked],
                                                  chosen.expert_ids[:checked], "situ", SITU_BETA, SITU_LINEAR_BETA)
        return load("kernels.torch.norm:rms_norm")(y, norm_weight.double(), 1e-5) @ w_up.double().T

    checked = s["tokens"] if ctx.smoke else REF_TOKENS
    layer_flops = expert_flops + 2.0 * s["tokens"] * hidden_dim * (experts + 2 * latent)
    row = Row("moe_layer", f"T={s['tokens']} (routed path)", "k3core triton route+experts+proj",
              "sum of its 2 plain grouped GEMMs", flops=layer_flops,
              bytes=float((w13.numel() + w2.numel() + w_down.numel() + w_up.numel()) * w13.element_size()),
              anchor_unavailable=gemm_unavailable, anchor_checks=list(gemm_checks), anchor_ms=gemm_ms,
              notes="ratio = expert GEMM time / whole routed layer: the share of the layer that is expert GEMM")
    poison_allocator(ctx.device, x.numel() * x.element_size())
    out = layer()
    # z, the expert hidden, y and the normed y are each rounded to bf16 before the output: MOE_TOL, as for the experts
    row.checks.append(check(out[:checked], reference(), ctx.tolerance(MOE_TOL), f"output, first {checked} tokens",
                            full=out))
    if row.passed:
        timing = ctx.timer.time(layer)
        row.ours_ms, row.timing = timing.ms, timing.method
    return row
