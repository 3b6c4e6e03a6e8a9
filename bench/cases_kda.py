"""KDA benchmark cases: chunked prefill vs fla `chunk_kda`, decode vs fla
`fused_recurrent_kda`, both on K3's per-GPU shape at TP8 (12 heads, K = V = 128, float32 state, lower-bounded gate).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from bench.context import BF16_OUTPUT_TOL, FP32_STATE_TOL, BenchContext, fla_unavailable, load
from bench.report import Check, Row, check, poison_allocator
from bench.timing import num_input_sets, time_pair
from k3core.ops import KdaGateParams

HEADS, HEAD_DIM = 12, 128
SMOKE_HEADS, SMOKE_HEAD_DIM = 2, 16
LOWER_BOUND = -5.0
CHUNK = 64                          # the chunk size of both chunked kernels, used only in the FLOP estimate
# bf16 q/k/v and bf16 intermediates of the chunked form (w, u, q exp G, ...) round several times per chunk before
# the float32 state absorbs them, so the output drifts further from float64 than one rounding: 2e-2, not 1e-2.
PREFILL_TOL = 2e-2
REF_TOKENS = 8192                   # the float64 reference runs on at most this causal prefix of the batch
PREFILL_SHAPES = (("B=1 T=32768", (32768,)), ("B=1 T=131072", (131072,)),
                  ("varlen 8x4096", (4096,) * 8), ("varlen 64x512", (512,) * 64))
SMOKE_PREFILL_SHAPES = (("B=1 T=40", (40,)), ("varlen 3 seqs", (17, 8, 23)))
DECODE_BATCHES = (1, 16, 64, 256)
SMOKE_DECODE_BATCHES = (1, 3)
FLA_PREFILL = "fla chunk_kda (safe_gate, lb -5, gate+l2norm+sigmoid in kernel)"
FLA_DECODE = "fla fused_recurrent_kda (in place by slot)"


def _gate(ctx: BenchContext, heads: int, dim: int) -> KdaGateParams:
    return KdaGateParams(ctx.randn(heads, scale=0.5, dtype=torch.float32),
                         ctx.randn(heads * dim, scale=0.5, dtype=torch.float32), "lower_bound", LOWER_BOUND)


def _gate64(gate: KdaGateParams) -> KdaGateParams:
    return gate._replace(A_log=gate.A_log.double(), dt_bias=gate.dt_bias.double())


def _reference_prefix(lengths: tuple[int, ...], budget: int) -> tuple[list[int], int]:
    """The leading sequences the reference replays within `budget` tokens (the last one possibly cut: outputs are
    causal, so a prefix's outputs are exact) and how many of them are whole (their final states can be compared)."""
    taken: list[int] = []
    for length in lengths:
        room = budget - sum(taken)
        if room <= 0:
            break
        taken.append(min(length, room))
    whole = sum(1 for cut, length in zip(taken, lengths) if cut == length)
    return taken, whole


def prefill_flops(num_tokens: int, heads: int, k_dim: int, v_dim: int) -> float:
    """Chunked-form estimate per token and head: K K^T and Q K^T inside the chunk (4 C K), M U (2 C V), the
    triangular solve (C V) and three state products (6 K V)."""
    return float(num_tokens * heads * (4 * CHUNK * k_dim + 3 * CHUNK * v_dim + 6 * k_dim * v_dim))


def kda_prefill_rows(ctx: BenchContext) -> list[Row]:
    heads, dim = (SMOKE_HEADS, SMOKE_HEAD_DIM) if ctx.smoke else (HEADS, HEAD_DIM)
    return [_prefill_row(ctx, label, lengths, heads, dim)
            for label, lengths in (SMOKE_PREFILL_SHAPES if ctx.smoke else PREFILL_SHAPES)]


@dataclass
class PrefillInputs:
    """One KDA prefill batch on the bench shapes: bf16 inputs (float32 in smoke runs), fresh NaN states."""
    lengths: tuple[int, ...]
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    f: torch.Tensor
    beta_logits: torch.Tensor
    gate: KdaGateParams
    bounds: list[int]
    cu32: torch.Tensor
    state: torch.Tensor
    slots: torch.Tensor
    no_init: torch.Tensor
    scale: float

    def args(self) -> tuple:
        """The positional arguments of kda_prefill."""
        return (self.q, self.k, self.v, self.f, self.beta_logits, self.gate, self.cu32, self.state, self.slots,
                self.no_init, self.scale)

    def host_args(self) -> tuple:
        """The same with cu_seqlens and slot_ids on the host, as the engine passes them (it plans on the host) and
        as fla gets them (`cu_seqlens_cpu`): no device-to-host read before the launches."""
        return (self.q, self.k, self.v, self.f, self.beta_logits, self.gate, self.cu32.cpu(), self.state,
                self.slots.cpu(), self.no_init, self.scale)


def prefill_inputs(ctx: BenchContext, lengths: tuple[int, ...], heads: int, dim: int) -> PrefillInputs:
    num_tokens, num_seqs = sum(lengths), len(lengths)
    q, k, f = (ctx.randn(num_tokens, heads, dim) for _ in range(3))              # [T, H, K]
    v = ctx.randn(num_tokens, heads, dim)                                         # [T, H, V]
    beta_logits = ctx.randn(num_tokens, heads)                                    # [T, H]
    gate = _gate(ctx, heads, dim)
    bounds = [0, *itertools.accumulate(lengths)]
    # has_initial_state is False, so the NaN in the state must never be read; every slot must be overwritten
    state = torch.full((num_seqs, heads, dim, dim), float("nan"), dtype=torch.float32, device=ctx.device)
    return PrefillInputs(lengths, q, k, v, f, beta_logits, gate, bounds,
                         torch.tensor(bounds, dtype=torch.int32, device=ctx.device), state,
                         torch.arange(num_seqs, device=ctx.device),
                         torch.zeros(num_seqs, dtype=torch.bool, device=ctx.device), dim ** -0.5)


class PrefillReference(NamedTuple):
    output: torch.Tensor           # float64 outputs of the first `used` tokens
    state: torch.Tensor            # float64 final states of the first `whole` sequences (and a cut one)
    used: int
    whole: int


def prefill_reference(ctx: BenchContext, x: PrefillInputs) -> PrefillReference:
    """The float64 reference on at most REF_TOKENS leading tokens of the batch (all of them in smoke runs)."""
    taken, whole = _reference_prefix(x.lengths, sum(x.lengths) if ctx.smoke else REF_TOKENS)
    used = sum(taken)
    heads, dim = x.q.shape[1:]
    ref_state = torch.zeros(len(taken), heads, dim, dim, dtype=torch.float64, device=ctx.device)
    reference = load("kernels.torch.kda:kda_prefill")
    ref = reference(x.q[:used].double(), x.k[:used].double(), x.v[:used].double(), x.f[:used].double(),
                    x.beta_logits[:used].double(), _gate64(x.gate),
                    torch.tensor([0, *itertools.accumulate(taken)], dtype=torch.int32, device=ctx.device),
                    ref_state, torch.arange(len(taken), device=ctx.device),
                    torch.zeros(len(taken), dtype=torch.bool, device=ctx.device), x.scale)
    return PrefillReference(ref.output, ref_state, used, whole)


def prefill_checks(ctx: BenchContext, x: PrefillInputs, ref: PrefillReference, output: torch.Tensor,
                   who: str = "") -> list[Check]:
    """`output` against the reference; the final states too unless `who` names an anchor (it keeps its own)."""
    tol = ctx.tolerance(PREFILL_TOL)
    checks = [check(output[:ref.used], ref.output, tol, f"{who}output, first {ref.used} tokens", full=output)]
    if not who:
        checks.append(check(x.state[:ref.whole], ref.state[:ref.whole], tol,
                            f"final state of {ref.whole} whole sequences", full=x.state))
    return checks


def _prefill_row(ctx: BenchContext, label: str, lengths: tuple[int, ...], heads: int, dim: int) -> Row:
    x = prefill_inputs(ctx, lengths, heads, dim)
    num_tokens, num_seqs = sum(lengths), len(lengths)
    element = x.q.element_size()
    row = Row("kda_prefill", label, "k3core triton kda_prefill", FLA_PREFILL,
              flops=prefill_flops(num_tokens, heads, dim, dim),
              bytes=float(num_tokens * heads * (4 * dim + dim + 1) * element + num_seqs * heads * dim * dim * 4),
              notes="ours: cu_seqlens and slot ids on the host; fla: cu_seqlens_cpu on the varlen batches, its "
                    "dense [1, T] form at B=1")
    kernel = load("kernels.triton.kda_prefill:kda_prefill")

    host_args = x.host_args()

    def ours():
        return kernel(*host_args)

    poison_allocator(ctx.device, x.v.numel() * element)
    output = ours().output                                                        # [T, H, V]
    ref = prefill_reference(ctx, x)
    row.checks += prefill_checks(ctx, x, ref, output)
    if row.passed:                    # inputs are far larger than L2: no rotation needed
        timing = ctx.timer.time(ours)
        row.ours_ms, row.timing = timing.ms, timing.method

    row.anchor_unavailable = fla_unavailable(ctx)
    if not row.anchor_unavailable:
        anchor = fla_prefill(x)
        poison_allocator(ctx.device, x.v.numel() * element)
        fla_out = anchor()[0][0]                                                  # [T, H, V]
        row.anchor_checks += prefill_checks(ctx, x, ref, fla_out, who="fla ")
        row.anchor_ms = ctx.timer.time(anchor).ms
        _retime_alternately(ctx, row, lambda: ctx.timer.time(ours), lambda: ctx.timer.time(anchor))
    return row


def _retime_alternately(ctx: BenchContext, row: Row, time_ours, time_anchor) -> None:
    """With --repeats N > 1 and both sides correct: replace the row's times with the medians of N alternating
    timings, and note the spread of the speed-ups."""
    if row.passed and row.anchor_passed and ctx.repeats > 1:
        pair = time_pair(time_ours, time_anchor, ctx.repeats)
        row.ours_ms, row.anchor_ms = pair.ours_ms, pair.anchor_ms
        row.notes += "; " + pair.note("fla")


def fla_prefill(x: PrefillInputs):
    """fla's chunk_kda on the same inputs, as a zero-argument call (the prefill anchor)."""
    from fla.ops.kda import chunk_kda  # noqa: PLC0415  (vendor package: imported only when it is the anchor)
    options = dict(scale=x.scale, initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=True,
                   use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
                   lower_bound=LOWER_BOUND, A_log=x.gate.A_log, dt_bias=x.gate.dt_bias, state_v_first=True)
    if len(x.bounds) > 2:       # one sequence runs in fla's dense [1, T] form, which is its faster path
        cu64 = torch.tensor(x.bounds, dtype=torch.int64)
        options.update(cu_seqlens=cu64.to(x.q.device), cu_seqlens_cpu=cu64)
    return lambda: chunk_kda(x.q[None], x.k[None], x.v[None], x.f[None], x.beta_logits[None], **options)


def kda_decode_rows(ctx: BenchContext) -> list[Row]:
    heads, dim = (SMOKE_HEADS, SMOKE_HEAD_DIM) if ctx.smoke else (HEADS, HEAD_DIM)
    return [_decode_row(ctx, n, heads, dim) for n in (SMOKE_DECODE_BATCHES if ctx.smoke else DECODE_BATCHES)]


def _decode_row(ctx: BenchContext, num_seqs: int, heads: int, dim: int) -> Row:
    state_bytes = num_seqs * heads * dim * dim * 4 * 2                            # fp32 state read + written
    num_sets = num_input_sets(state_bytes, ctx.device, ctx.smoke)
    num_slots = num_sets * num_seqs + 3
    pool = ctx.randn(num_slots, heads, dim, dim, scale=0.05, dtype=torch.float32)  # [slots, H, V, K]
    order = torch.randperm(num_slots, generator=ctx.generator)[:num_sets * num_seqs]
    slot_sets = order.view(num_sets, num_seqs).to(ctx.device)                    # distinct slots in every set
    sets = [dict(q=ctx.randn(num_seqs, heads, dim), k=ctx.randn(num_seqs, heads, dim),
                 v=ctx.randn(num_seqs, heads, dim), f=ctx.randn(num_seqs, heads, dim),
                 beta=ctx.randn(num_seqs, heads)) for _ in range(num_sets)]
    gate = _gate(ctx, heads, dim)
    scale = dim ** -0.5
    row = Row("kda_decode", f"N={num_seqs}", "k3core triton kda_decode", FLA_DECODE,
              flops=float(num_seqs * heads * 8 * dim * dim), bytes=float(state_bytes),
              notes=f"{num_sets} input sets over distinct state slots")
    kernel = load("kernels.triton.kda_decode:kda_decode")
    calls = [lambda s=s, slots=slots: kernel(s["q"], s["k"], s["v"], s["f"], s["beta"], gate, pool, slots, scale)
             for s, slots in zip(sets, slot_sets)]
    row.checks += _decode_checks(ctx, calls[0], sets[0], slot_sets[0], pool, gate, scale, "")
    if row.passed:
        timing = ctx.timer.time_graph(calls)
        row.ours_ms, row.timing = timing.ms, timing.method

    anchor_calls: list = []
    row.anchor_unavailable = fla_unavailable(ctx)
    if not row.anchor_unavailable:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd  # noqa: PLC0415
        cu64 = torch.arange(num_seqs + 1, dtype=torch.int64, device=ctx.device)   # one token per sequence
        anchor_calls = [
            lambda s=s, slots=slots: fused_recurrent_kda_fwd(
                q=s["q"][None], k=s["k"][None], v=s["v"][None], g=s["f"][None], beta=s["beta"][None],
                A_log=gate.A_log, dt_bias=gate.dt_bias, scale=scale, initial_state=pool, inplace_final_state=True,
                state_v_first=True, cu_seqlens=cu64, ssm_state_indices=slots, use_qk_l2norm_in_kernel=True,
                use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=LOWER_BOUND)[0][0]
            for s, slots in zip(sets, slot_sets)]
        row.anchor_checks += _decode_checks(ctx, anchor_calls[0], sets[0], slot_sets[0], pool, gate, scale, "fla ")
        row.anchor_ms = ctx.timer.time_graph(anchor_calls).ms
        _retime_alternately(ctx, row, lambda: ctx.timer.time_graph(calls), lambda: ctx.timer.time_graph(anchor_calls))
    if row.passed:
        row.notes += "; " + ctx.timer.single_pass_note(calls, anchor_calls if row.anchor_passed else None)
        row.notes += "; " + _same_size_copy_note(ctx, state_bytes // 2, num_sets, row.ours_ms)
    return row


def _same_size_copy_note(ctx: BenchContext, num_bytes: int, num_sets: int, ours_ms: float) -> str:
    """A plain device copy of the bytes the step reads (and so writes), over as many rotated buffers and timed the
    same way: the copy bandwidth at this size, launch and ramp included, beside the 1 GiB ceiling of `% copy`."""
    elements = num_bytes // 4
    pairs = [(torch.randn(elements, device=ctx.device), torch.empty(elements, device=ctx.device))
             for _ in range(num_sets)]                   # drawn on the device: the values do not matter to a copy
    copy_ms = ctx.timer.time_graph([lambda src=src, dst=dst: dst.copy_(src) for src, dst in pairs]).ms
    del pairs
    return (f"a device copy of the same bytes, timed the same way: {copy_ms:.4f} ms (ours takes "
            f"{ours_ms / copy_ms:.2f}x as long)")


def _decode_checks(ctx: BenchContext, call, inputs: dict, slots: torch.Tensor, pool: torch.Tensor,
                   gate: KdaGateParams, scale: float, who: str) -> list[Check]:
    """One step from a saved pool: output and addressed slots against float64, other slots bit-identical; the pool
    is restored afterwards so the timed runs start from the same values."""
    saved = pool.clone()
    expected = saved.double()
    reference = load("kernels.torch.kda:kda_decode")
    ref_out = reference(inputs["q"].double(), inputs["k"].double(), inputs["v"].double(), inputs["f"].double(),
                        inputs["beta"].double(), _gate64(gate), expected, slots, scale)
    poison_allocator(ctx.device, inputs["v"].numel() * inputs["v"].element_size())
    out = call()
    untouched = torch.ones(pool.shape[0], dtype=torch.bool, device=pool.device)
    untouched[slots] = False
    found = [check(out, ref_out, ctx.tolerance(BF16_OUTPUT_TOL), f"{who}output"),
             check(pool[slots], expected[slots], ctx.tolerance(FP32_STATE_TOL), f"{who}addressed state slots"),
             check(pool[untouched], saved[untouched], 0.0, f"{who}other state slots (must be untouched)")]
    pool.copy_(saved)
    return found
