"""MLA benchmark cases: absorbed decode over the paged 576-wide latent (vs the naive
PyTorch reference run in bf16 in the same process), and causal prefill with 192/128 heads (vs cuDNN SDPA).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.context import BF16_OUTPUT_TOL, FP32_STATE_TOL, BenchContext, load
from bench.report import Row, check, poison_allocator

HEADS = 12                       # 96 query heads at TP8
LATENT, V_DIM, PAGE = 576, 512, 64
QK_DIM, PREFILL_V_DIM = 192, 128
SCALE = QK_DIM ** -0.5           # the q/k head width before absorption sets the softmax scale
DECODE_SHAPES = ((64, 8192), (1, 131072))
SMOKE_DECODE = dict(heads=4, latent=48, v_dim=32, page=8, shapes=((2, 37), (1, 50)))
PREFILL_LENGTHS = (8192, 32768)
SMOKE_PREFILL = dict(heads=2, qk=48, v=32, lengths=(37,))
REF_REQUESTS = 8                 # the float64 decode reference runs on the first requests of the batch
REF_HEAD_QUERIES, REF_TAIL_QUERIES = 512, 256   # prefill reference: the first and the last queries (causal slices)


def mla_decode_rows(ctx: BenchContext) -> list[Row]:
    if ctx.smoke:
        p = SMOKE_DECODE
        return [_decode_row(ctx, b, n, p["heads"], p["latent"], p["v_dim"], p["page"]) for b, n in p["shapes"]]
    return [_decode_row(ctx, b, n, HEADS, LATENT, V_DIM, PAGE) for b, n in DECODE_SHAPES]


def _decode_row(ctx: BenchContext, batch: int, seq_len: int, heads: int, latent: int, v_dim: int, page: int) -> Row:
    pages_per_seq = -(-seq_len // page)
    num_pages = batch * pages_per_seq + 5
    kv_cache = ctx.randn(num_pages, page, latent)                                 # [pages, page, D_latent]
    order = torch.randperm(num_pages, generator=ctx.generator)[:batch * pages_per_seq]
    page_table = order.view(batch, pages_per_seq).to(device=ctx.device, dtype=torch.int32)  # scattered pages
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=ctx.device)
    q = ctx.randn(batch, heads, latent)                                           # [B, H, D_latent]
    kv_bytes = batch * seq_len * latent * kv_cache.element_size()
    row = Row("mla_decode", f"B={batch} L={seq_len}", "k3core triton mla_decode", "naive torch (gather+einsum)",
              flops=float(batch * heads * seq_len * 2 * (latent + v_dim)), bytes=float(kv_bytes),
              notes="bytes = KV entries read (q and output are < 1% of it)")
    kernel = load("kernels.triton.mla_decode:mla_decode")
    naive = load("kernels.torch.mla:mla_decode")

    def ours():
        return kernel(q, kv_cache, page_table, seq_lens, SCALE, v_dim)

    def anchor():
        return naive(q, kv_cache, page_table, seq_lens, SCALE, v_dim)

    checked = batch if ctx.smoke else min(batch, REF_REQUESTS)
    # q in float64 makes the reference compute in float64 (it upcasts the gathered entries itself)
    ref = naive(q[:checked].double(), kv_cache, page_table[:checked], seq_lens[:checked], SCALE, v_dim)
    for who, fn, checks in (("", ours, row.checks), ("naive ", anchor, row.anchor_checks)):
        poison_allocator(ctx.device, q.numel() * 4 * 4)
        result = fn()
        checks.append(check(result.output[:checked], ref.output, ctx.tolerance(BF16_OUTPUT_TOL),
                            f"{who}output, first {checked} requests", full=result.output))
        # the LSE is float32 math on the same bf16 values as the reference
        checks.append(check(result.lse[:checked], ref.lse, ctx.tolerance(FP32_STATE_TOL),
                            f"{who}lse, first {checked} requests", full=result.lse))
    if row.passed:
        timing = ctx.timer.time_graph([ours])
        row.ours_ms, row.timing = timing.ms, timing.method
    if row.anchor_passed:
        row.anchor_ms = ctx.timer.time_graph([anchor]).ms
    if row.passed:
        row.notes += "; " + ctx.timer.single_pass_note([ours], [anchor] if row.anchor_passed else None)
    return row


def mla_prefill_rows(ctx: BenchContext) -> list[Row]:
    if ctx.smoke:
        p = SMOKE_PREFILL
        return [_prefill_row(ctx, n, p["heads"], p["qk"], p["v"]) for n in p["lengths"]]
    return [_prefill_row(ctx, n, HEADS, QK_DIM, PREFILL_V_DIM) for n in PREFILL_LENGTHS]


def _cudnn_unavailable(ctx: BenchContext) -> str:
    if ctx.device.type != "cuda":
        return "torch SDPA's cuDNN backend needs a CUDA device (this smoke run is on the CPU)"
    if not torch.backends.cudnn.is_available():
        return "this torch build has no cuDNN"
    return ""


def _prefill_row(ctx: BenchContext, seq_len: int, heads: int, qk_dim: int, v_dim: int) -> Row:
    q = ctx.randn(seq_len, heads, qk_dim)                                         # [T, H, Dqk]
    k = ctx.randn(seq_len, heads, qk_dim)
    v = ctx.randn(seq_len, heads, v_dim)                                          # [T, H, Dv]
    cu = torch.tensor([0, seq_len], dtype=torch.int32, device=ctx.device)
    scale = qk_dim ** -0.5
    element = q.element_size()
    row = Row("mla_prefill", f"T={seq_len} H={heads}", "k3core triton mla_prefill", "torch SDPA cuDNN",
              flops=float(heads * seq_len * seq_len * (qk_dim + v_dim)),        # causal: half of 2 T^2 (Dqk + Dv)
              bytes=float(seq_len * heads * (2 * qk_dim + 2 * v_dim) * element))
    kernel = load("kernels.triton.mla_prefill:mla_prefill")
    reference = load("kernels.torch.mla:mla_prefill")

    def ours():
        return kernel(q, k, v, cu, cu, scale)

    head = seq_len if ctx.smoke else min(REF_HEAD_QUERIES, seq_len)
    tail = seq_len if ctx.smoke else min(REF_TAIL_QUERIES, seq_len)
    ref_head = reference(q[:head].double(), k[:head].double(), v[:head].double(),
                         cu.new_tensor([0, head]), cu.new_tensor([0, head]), scale)
    # the last queries see every key: aligned to the end of the keys, as the op table defines
    ref_tail = reference(q[-tail:].double(), k.double(), v.double(), cu.new_tensor([0, tail]), cu, scale)
    tol = ctx.tolerance(BF16_OUTPUT_TOL)

    def checks_of(out: torch.Tensor, who: str) -> list:
        return [check(out[:head], ref_head, tol, f"{who}output, first {head} queries", full=out),
                check(out[-tail:], ref_tail, tol, f"{who}output, last {tail} queries")]

    poison_allocator(ctx.device, seq_len * heads * v_dim * element)
    row.checks += checks_of(ours(), "")
    if row.passed:
        timing = ctx.timer.time(ours)
        row.ours_ms, row.timing = timing.ms, timing.method
    row.anchor_unavailable = _cudnn_unavailable(ctx)
    if row.anchor_unavailable:
        return row
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415
    q4, k4, v4 = (t.unsqueeze(0).transpose(1, 2) for t in (q, k, v))             # [1, H, T, D] views

    def anchor():
        return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale)

    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            poison_allocator(ctx.device, seq_len * heads * v_dim * element)
            row.anchor_checks += checks_of(anchor()[0].transpose(0, 1), "cuDNN ")  # back to [T, H, Dv]
            row.anchor_ms = ctx.timer.time(anchor).ms
    except RuntimeError as exc:         # cuDNN refuses some head sizes or versions: say so, never substitute
        row.anchor_unavailable = f"cuDNN SDPA refused ({str(exc)[:150]})"
    return row
