"""One tolerance per output tensor per run dtype, each with its reason. The oracle is the float64 CPU reference
fed the SAME (already rounded) inputs, so a tolerance covers only the provider's own arithmetic and rounding.

A value passes when |provider - oracle| <= atol + rtol * |oracle|; `worst` in reports is the largest ratio of
the error to that bound (<= 1 passes). Never widen a tolerance to make a provider pass: fix the provider, or
write down a new reason that a reviewer can check.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

EXACT = "exact"


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float
    reason: str


F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

# Pointwise and row-reduction ops: float32 math inside, one rounding to the output dtype (two for rms_norm, which
# casts the normalised row to x.dtype before the weight multiply, as HF does).
POINTWISE = {
    F32: Tolerance(2e-5, 2e-5, "float32 math: a few float32 ulps (1.2e-7) plus row-sum reordering over D <= 8192"),
    BF16: Tolerance(1e-3, 1.6e-2, "output rounded to bfloat16 up to twice (2 x 0.5 ulp = 2^-8 relative); the "
                                  "oracle does not round"),
    F16: Tolerance(1e-4, 2e-3, "output rounded to float16 up to twice (2 x 0.5 ulp = 2^-11 relative)"),
}
# GEMM-heavy ops: attention, the KDA chunked recurrence, expert GEMMs.
MATMUL = {
    F32: Tolerance(2e-3, 2e-3, "tl.dot and cuBLAS use TF32 for float32 inputs on sm80+/CDNA3 (2^-11 relative per "
                               "product), summed over K <= 576"),
    BF16: Tolerance(2e-2, 2e-2, "fp32 accumulation, but intermediate tiles (attention P, KDA chunk matrices, the "
                                "expert hidden) are rounded to bf16 (2^-9) before the next GEMM, plus output rounding"),
    F16: Tolerance(5e-3, 5e-3, "as bf16 with float16's 2^-11 rounding of intermediate tiles and output"),
}
# float32 state written by a GEMM-heavy op (KDA state, checkpoints): no output rounding, but TF32 / bf16 tiles.
STATE = {
    F32: Tolerance(2e-3, 2e-3, "float32 state; TF32 products inside the chunked update (2^-11 relative)"),
    BF16: Tolerance(1e-2, 1e-2, "float32 state, bf16 q/k/v tiles in the chunk GEMMs; no output rounding"),
    F16: Tolerance(5e-3, 5e-3, "float32 state, float16 tiles in the chunk GEMMs"),
}
# The same float32 state, carried through every chunk of a long-memory case (memory="long": about -2e-3 log-decay
# per token), so that the rounding of each chunk's bf16 intermediates adds up instead of being forgotten.
STATE_LONG_MEMORY = {
    F32: STATE[F32],
    BF16: Tolerance(2e-2, 2e-2, "as STATE, but each chunk's bf16 rounding of W, U, the decayed keys and the state "
                                "tile in its products is carried into every later chunk: on the same rounded inputs "
                                "fla-core 0.6.0's chunk_kda reached 1.22x the 1e-2 bound and k3core 1.17x, over 10 "
                                "case/seed pairs on an H200 (bench/results/kda-long-memory-nvidia-h200.md); "
                                "twice the bound leaves room for other seeds. float32 runs keep STATE's "
                                "bound, and they are the ones that catch a wrong carry"),
    F16: STATE[F16],        # not measured: float16's 2^-11 rounding is 4x finer than bf16's
}
# Outputs whose tolerance changes for cases built with memory="long" (conformance/cases.py).
LONG_MEMORY_TOLERANCES = {
    ("kda_prefill", "state"): STATE_LONG_MEMORY,
    ("kda_prefill", "checkpoint_states"): STATE_LONG_MEMORY,
}
# Log-sum-exp (float32 in every run dtype): an absolute error of the scores passes straight through.
LSE = {
    F32: Tolerance(2e-3, 0.0, "scores are TF32 dot products of magnitude <= ~10: absolute error ~1e-3"),
    BF16: Tolerance(1e-2, 0.0, "scores accumulate bf16 q.k products in fp32; no rounding of the lse itself"),
    F16: Tolerance(5e-3, 0.0, "scores accumulate float16 q.k products in fp32"),
}
# Conv state holds raw pre-conv inputs: a provider copies them, so they must be bit-exact after rounding.
COPY = {dtype: Tolerance(0.0, 0.0, "conv state stores copies of the inputs; a copy has no rounding")
        for dtype in (F32, BF16, F16)}
# Router weights: float32 logits in every run dtype.
ROUTER = {dtype: Tolerance(1e-6, 1e-5, "float32 sigmoid/softmax and a sum over top_k <= 16 values")
          for dtype in (F32, BF16, F16)}
# Router choice: a provider computes the biased scores in float32 (the logits are float32 in every run dtype), one
# rounding for the sigmoid / softmax and one for the bias sum, each <= half an ulp (2^-24 relative). Two experts whose
# float64 choice scores at the top-k boundary differ by less than both errors together can come out in either order:
# a tie, which either side may take (conformance/runner.py: `resolve_route_ties`). Four ulps leave room for a
# provider's exp / division differing from torch's by an ulp; nothing wider counts as a tie.
ROUTE_TIE_RTOL = 4 * 2.0 ** -23

TOLERANCES: dict[tuple[str, str], dict[torch.dtype, Tolerance] | str] = {
    ("rms_norm", "out"): POINTWISE,
    ("gated_rms_norm", "out"): POINTWISE,
    ("glu_activation", "out"): POINTWISE,
    ("kda_gate", "out"): {dtype: Tolerance(1e-5, 1e-5, "float32 log-decay from an exactly rounded f: exp, log1p and "
                                                      "sigmoid in float32 (a few ulps)") for dtype in (F32, BF16, F16)},
    ("attn_res_read", "out"): POINTWISE,
    # MXFP4 weights decode exactly in float32 and bf16 (a 3-bit code times a power of two), so the error sources
    # are the bf16 expert GEMMs': the dot's input precision and the bf16 hidden tile between the two GEMMs
    ("moe_experts_mxfp4", "out"): MATMUL,
    ("short_conv_prefill", "out"): POINTWISE,
    ("short_conv_prefill", "conv_state"): COPY,
    ("short_conv_decode", "out"): POINTWISE,
    ("short_conv_decode", "conv_state"): COPY,
    ("kda_prefill", "output"): MATMUL,
    ("kda_prefill", "state"): STATE,
    ("kda_prefill", "checkpoint_states"): STATE,
    ("kda_prefill", "checkpoint_seq_ids"): EXACT,
    ("kda_prefill", "checkpoint_lengths"): EXACT,
    ("kda_decode", "out"): MATMUL,
    ("kda_decode", "state"): STATE,
    ("mla_prefill", "out"): MATMUL,
    ("mla_decode", "output"): MATMUL,
    ("mla_decode", "lse"): LSE,
    ("moe_route", "weights"): ROUTER,
    ("moe_route", "expert_ids"): EXACT,
    ("moe_experts", "out"): MATMUL,
    ("sample", "out"): EXACT,
}


def tolerance(op: str, output: str, dtype: torch.dtype, memory: str = "short") -> Tolerance | str:
    """The tolerance of one output tensor, or EXACT for integer outputs; `memory` is the case's ("long": the state
    is carried across many chunks, see STATE_LONG_MEMORY)."""
    if memory == "long" and (op, output) in LONG_MEMORY_TOLERANCES:
        return LONG_MEMORY_TOLERANCES[(op, output)][dtype]
    try:
        entry = TOLERANCES[(op, output)]
    except KeyError:
        raise KeyError(f"no tolerance for output {output!r} of op {op!r}; add one with its reason to "
                       "conformance/tolerances.py") from None
    return entry if isinstance(entry, str) else entry[dtype]
