"""AttnRes read benchmark (target: 70% of copy): 9 candidates of 7168 per token (8 sealed blocks + the live sum),
our one-pass Triton read against the naive PyTorch reference (float32 upcast, several kernels) in bf16."""
from __future__ import annotations

import torch

from bench.context import BF16_OUTPUT_TOL, BenchContext, load
from bench.report import Row, check, poison_allocator
from bench.timing import num_input_sets

WIDTH, NUM_VALID, EPS = 7168, 8, 1e-6
TOKENS = (1, 64, 8192)
SMOKE = dict(width=40, tokens=(1, 5))
GRAPH_BELOW = 1024                 # decode-sized reads are timed inside a CUDA graph


def attn_res_rows(ctx: BenchContext) -> list[Row]:
    width = SMOKE["width"] if ctx.smoke else WIDTH
    return [_row(ctx, t, width) for t in (SMOKE["tokens"] if ctx.smoke else TOKENS)]


def _row(ctx: BenchContext, tokens: int, width: int) -> Row:
    element = 2 if ctx.dtype == torch.bfloat16 else 4
    call_bytes = tokens * (NUM_VALID + 2) * width * element + width * 4             # 9 candidates in, 1 row out
    num_sets = num_input_sets(call_bytes, ctx.device, ctx.smoke)
    # the query scaled by 1/sqrt(D) keeps the depth softmax away from one-hot, so the mix is really tested
    sets = [dict(bank=ctx.randn(tokens, NUM_VALID, width), live=ctx.randn(tokens, width),
                 query=ctx.randn(width, scale=width ** -0.5, dtype=torch.float32)) for _ in range(num_sets)]
    row = Row("attn_res", f"T={tokens} S=9 D={width}", "k3core triton attn_res_read", "naive torch (fp32 upcast)",
              flops=float(tokens * (NUM_VALID + 1) * width * 5), bytes=float(call_bytes),
              notes=f"{num_sets} rotated input sets")
    kernel, naive = load("kernels.triton.attn_res:attn_res_read"), load("kernels.torch.attn_res:attn_res_read")
    ours = [lambda s=s: kernel(s["bank"], NUM_VALID, s["live"], s["query"], EPS) for s in sets]
    anchor = [lambda s=s: naive(s["bank"], NUM_VALID, s["live"], s["query"], EPS) for s in sets]
    first = sets[0]
    ref = naive(first["bank"].double(), NUM_VALID, first["live"].double(), first["query"].double(), EPS)
    tol = ctx.tolerance(BF16_OUTPUT_TOL)
    for who, calls, checks in (("", ours, row.checks), ("naive ", anchor, row.anchor_checks)):
        poison_allocator(ctx.device, tokens * width * element)
        checks.append(check(calls[0](), ref, tol, f"{who}output"))
    time = ctx.timer.time_graph if tokens < GRAPH_BELOW else ctx.timer.time_rotating
    if row.passed:
        timing = time(ours)
        row.ours_ms, row.timing = timing.ms, timing.method
    if row.anchor_passed:
        row.anchor_ms = time(anchor).ms
    return row
