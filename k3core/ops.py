"""The op table: every numeric op the model needs, with its signature, shapes, dtypes and layouts fixed here.

Each op has a PyTorch reference in `kernels/torch` (the oracle and the CPU path) with exactly the signature
written below; every provider of the op (Triton, vendor libraries) takes the same arguments and returns the
same results. Conventions that hold for every op:

* Variable-length batches are packed along the token axis and described by `cu_seqlens` (int32 [B+1],
  cumulative lengths starting at 0). An empty batch has B = 0, `cu_seqlens = [0]` and T = 0.
* KDA recurrent state (per layer) is `state: [num_slot_positions, H, V, K]` float32; the decay acts on the last
  (K) axis. Dimension 0 may have any stride (a view into the unified pool's arena); the inner three dims are
  contiguous. Requests address it through `slot_ids` (int64 [B]). Short-conv state is
  `conv_state: [num_slot_positions, K_conv - 1, C]` (window-major; the last K_conv - 1 PRE-conv inputs), with
  C = 3 * H * D for the packed [q | k | v] channels. Ops update the addressed slots in place.
* MLA latent cache (per layer) is `kv_cache: [num_page_positions, page_size, D_latent]` (D_latent =
  kv_lora_rank + qk_rope_head_dim, entries [normalised c_kv | k_pe]); dim 0 may have any stride. A request's
  tokens live in pages `page_table[b, 0..]` (int32 [B, max_pages]), token j of request b at
  `kv_cache[page_table[b, j // page_size], j % page_size]`.
* Log-sum-exp outputs are in natural log, float32.
* A reference computes internally in float32 (or float64 when given float64) and returns the input dtype unless
  the signature says otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class OpInfo:
    name: str
    reference: str      # "module:function" in kernels.torch
    doc: str


class KdaGateParams(NamedTuple):
    """Forget-gate parameters of one KDA layer (all float32).

    softplus form (Kimi-Linear):   g = -exp(A_log[h]) * softplus(f + dt_bias)
    lower_bound form (K3 'safe'):  g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias))
    """
    A_log: torch.Tensor          # [H] per head
    dt_bias: torch.Tensor        # [H * K] per channel
    form: str                    # "softplus" | "lower_bound"
    lower_bound: float = -5.0


class KdaPrefillOut(NamedTuple):
    output: torch.Tensor                 # [T, H, V] dtype of v
    checkpoint_states: torch.Tensor      # [N_ckpt, H, V, K] float32; states after token checkpoint_positions[i]
    checkpoint_seq_ids: torch.Tensor     # int64 [N_ckpt]: which sequence of the batch
    checkpoint_lengths: torch.Tensor     # int64 [N_ckpt]: tokens of that sequence consumed (within this call)


class MlaDecodeOut(NamedTuple):
    output: torch.Tensor     # [B, H, D_v_latent] dtype of q
    lse: torch.Tensor        # [B, H] float32, natural log


class RouteOut(NamedTuple):
    weights: torch.Tensor    # [T, top_k] float32 (renormalised and scaled as configured)
    expert_ids: torch.Tensor  # [T, top_k] int64


GREEDY_TEMPERATURE = 1e-5    # `sample`: a row whose temperature is below this is greedy


OPS: tuple[OpInfo, ...] = (
    OpInfo("rms_norm", "kernels.torch.norm:rms_norm", """
        rms_norm(x [..., D], weight [D], eps) -> [..., D]
        HF style: normalise in float32, cast to x.dtype, then multiply by weight (result dtype of x)."""),
    OpInfo("gated_rms_norm", "kernels.torch.norm:gated_rms_norm", """
        gated_rms_norm(x [..., D], gate [..., D], weight [D], eps) -> [..., D]
        float32 throughout: x / sqrt(mean(x^2) + eps) * weight * sigmoid(gate), cast to x.dtype once."""),
    OpInfo("glu_activation", "kernels.torch.activation:glu_activation", """
        glu_activation(x [T, 2I], activation, situ_beta, situ_linear_beta) -> [T, I]
        x = [gate | up] (non-interleaved). silu: silu(gate) * up.
        situ: (b * tanh(gate / b) * sigmoid(gate)) * (bl * tanh(up / bl)) (up term skipped if bl is None).
        float32 math."""),
    OpInfo("kda_gate", "kernels.torch.kda:kda_gate", """
        kda_gate(f [T, H, K], params: KdaGateParams) -> g [T, H, K] float32 log-decay (<= 0)."""),
    OpInfo("short_conv_prefill", "kernels.torch.conv:short_conv_prefill", """
        short_conv_prefill(x [T, C], weight [C, K_conv] float32, cu_seqlens [B+1], conv_state, slot_ids [B],
                           has_initial_state [B] bool) -> y [T, C]
        Causal depthwise conv per sequence then SiLU; history is conv_state[slot] when has_initial_state else zeros.
        Writes the last K_conv-1 pre-conv inputs of each sequence (history included when it is short) back to
        conv_state[slot]. cu_seqlens and slot_ids may be on the host, as for kda_prefill."""),
    OpInfo("short_conv_decode", "kernels.torch.conv:short_conv_decode", """
        short_conv_decode(x [B, C], weight [C, K_conv], conv_state, slot_ids [B]) -> y [B, C]
        One token per sequence; shifts the window in place."""),
    OpInfo("kda_prefill", "kernels.torch.kda:kda_prefill", """
        kda_prefill(q [T, H, K], k [T, H, K], v [T, H, V], f [T, H, K], beta_logits [T, H], gate: KdaGateParams,
                    cu_seqlens [B+1], state, slot_ids [B], has_initial_state [B] bool, scale: float,
                    checkpoint_interval: int = 0, *, checkpoint_lengths: list[list[int]] | None = None)
                    -> KdaPrefillOut
        Per sequence: q, k L2-normalised (eps 1e-6, float32), g = kda_gate(f), beta = sigmoid(beta_logits);
        recurrence S <- S diag(exp g_t); S <- S + beta_t (v_t - S k_t) k_t^T; o_t = scale * S q_t, starting from
        state[slot] (or zeros) and writing the final state back to state[slot].
        checkpoint_interval > 0: also return the state after every multiple of checkpoint_interval tokens of
        each sequence (counted from the start of this call) and after its last token. checkpoint_lengths (host
        lists, one per sequence, strictly increasing in 1..its length; not with checkpoint_interval): the states
        after exactly those token counts (the engine's cache snapshots inside a prefill chunk).
        cu_seqlens and slot_ids may be CPU tensors while the data is on the device (the model passes them so:
        providers read them on the host); every provider must accept both placements."""),
    OpInfo("kda_decode", "kernels.torch.kda:kda_decode", """
        kda_decode(q [B, H, K], k [B, H, K], v [B, H, V], f [B, H, K], beta_logits [B, H], gate: KdaGateParams,
                   state, slot_ids [B], scale) -> o [B, H, V]
        One step of the same recurrence, state updated in place."""),
    OpInfo("mla_prefill", "kernels.torch.mla:mla_prefill", """
        mla_prefill(q [Tq, H, Dqk], k [Tk, H, Dqk], v [Tk, H, Dv], cu_seqlens_q [B+1], cu_seqlens_k [B+1],
                    scale) -> o [Tq, H, Dv]
        Causal softmax attention per sequence with the queries aligned to the END of the keys (query i of a
        sequence with Lq queries and Lk keys sees keys j <= Lk - Lq + i): a cached prefix plus new tokens.
        cu_seqlens_q and cu_seqlens_k may be on the host (the model passes them so), as for kda_prefill."""),
    OpInfo("mla_decode", "kernels.torch.mla:mla_decode", """
        mla_decode(q [B, H, D_latent], kv_cache, page_table [B, max_pages] int32, seq_lens [B] int32, scale,
                   v_dim) -> MlaDecodeOut
        Absorbed MLA decode: scores = scale * q . kv over each request's seq_lens[b] cached entries, softmax,
        output = weights @ kv[..., :v_dim]. seq_lens[b] >= 1."""),
    OpInfo("moe_route", "kernels.torch.moe:moe_route", """
        moe_route(logits [T, E] float32, correction_bias [E] | None, top_k, scoring, renormalize,
                  routed_scaling_factor, num_expert_group: int = 1, topk_group: int = 1) -> RouteOut
        scores = sigmoid(logits) (or softmax); choose top_k by scores + bias; weights = scores at the chosen
        experts, divided by (sum + 1e-20) when renormalize, times routed_scaling_factor.
        num_expert_group > 1 (grouped top-k, DeepSeek-V3 / transformers' Kimi-Linear): the experts form that many
        contiguous groups, a group scores the sum of its two best (scores + bias), and the top_k are chosen among
        the experts of the topk_group best groups only (group ties go to the lower group)."""),
    OpInfo("moe_experts", "kernels.torch.moe:moe_experts", """
        moe_experts(x [T, D], w13 [E, 2I, D], w2 [E, D, I], weights [T, k] float32, expert_ids [T, k],
                    activation, situ_beta, situ_linear_beta, expert_offset: int = 0) -> y [T, D]
        y_t = sum_j weights[t, j] * w2_e (act(w13_e x_t)), e = expert_ids[t, j] - expert_offset; ids outside
        [expert_offset, expert_offset + E) contribute nothing (expert parallelism). Sum in float32."""),
    OpInfo("moe_experts_mxfp4", "kernels.torch.moe_mxfp4:moe_experts_mxfp4", """
        moe_experts_mxfp4(x [T, D], w13_packed [E, 2I, D/2] uint8, w13_scale [E, 2I, D/32] uint8,
                          w2_packed [E, D, I/2] uint8, w2_scale [E, D, I/32] uint8, weights [T, k] float32,
                          expert_ids [T, k], activation, situ_beta, situ_linear_beta, expert_offset: int = 0,
                          *, max_scale: int | None = None) -> y [T, D] (dtype of x)
        moe_experts with the expert weights in MXFP4 as the checkpoint stores them (compressed-tensors
        mxfp4-pack-quantized, k3core.model.mxfp4): W[e, n, k] = e2m1(code) * 2^(scale[e, n, k // 32] - 127), the
        code of k in byte [e, n, k // 2], low nibble for even k, high nibble for odd k; a code is sign (bit 3) and
        a magnitude index (bits 0-2) into {0, 0.5, 1, 1.5, 2, 3, 4, 6}. Scale byte 255 (NaN in E8M0) reads as
        254. D and I are multiples of 32; w13 rows are [gate | up] as in moe_experts. Weights are dequantised
        per call (never held dense); products in x's dtype, sums in float32. max_scale: None, or a bound on
        every scale byte of both tensors (measured once at load: k3core.model.mxfp4.max_scale_of), which
        kernels may use to fold constants (the Triton swap kernels at <= 128); the result does not depend on it
        and the reference checks it."""),
    OpInfo("attn_res_read", "kernels.torch.attn_res:attn_res_read", """
        attn_res_read(bank [T, S_max, D], num_valid: int, live [T, D], query [D] float32, eps) -> [T, D]
        candidates = bank[:, :num_valid] then live; score_j = rsqrt(mean(v_j^2) + eps) * (v_j . query);
        softmax over j; mix of the raw candidates in float32, cast to live.dtype."""),
    OpInfo("sample", "kernels.torch.sampling:sample", """
        sample(logits [R, V] any float, temperature [R] float32, top_k [R] int64 (0 = off), top_p [R] float32,
               min_p [R] float32, seeds [R] int64, positions [R] int64, filter_width: int) -> token_ids int64 [R]
        temperature < GREEDY_TEMPERATURE: argmax (lowest index on ties). Else Gumbel-max over the tokens top_k,
        top_p (of the top-k renormalised distribution), min_p (relative to the most likely) keep, in float32,
        with noise hashed from (seeds[r], positions[r], token id): a row's token never depends on other rows.
        filter_width (host): how many largest logits per row the filters see (0 = no row filters; >= the largest
        top_k; V when a row has top_p or min_p without top_k). Device work only, no host sync."""),
)

OP_NAMES: tuple[str, ...] = tuple(op.name for op in OPS)


def op_info(name: str) -> OpInfo:
    for op in OPS:
        if op.name == name:
            return op
    raise KeyError(f"unknown op {name!r}; ops are: {', '.join(OP_NAMES)}")
