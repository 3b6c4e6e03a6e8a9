"""The two token mixers: KDA (K3_ARCHITECTURE.md §3.2) and gated MLA (§3.3), built only from backend ops.

Both take the normalised attention input x [T, H] of a ForwardBatch and read/write the sequence state through
`StateViews` by slot / page position.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from k3core.config import ModelConfig
from k3core.model.batch import ForwardBatch, StateViews
from k3core.model.held import fuse_rows, kda_padding_rows, kda_x_names
from k3core.ops import KdaGateParams


class KdaLayer:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], prefix: str, kda_index: int):
        w = lambda name: weights[prefix + name]  # noqa: E731
        self.config = config
        self.kda_index = kda_index
        self.num_heads, self.head_dim = config.kda_num_heads, config.kda_head_dim
        # Every projection of x is one GEMM: q, k, v, the forget gate's low-rank f_a, beta's b and the output gate's
        # g (or its low-rank g_a), rows concatenated and padded with zero rows for cuBLAS; the q/k/v depthwise conv
        # weights are packed the same way. Held once: the table's entries become views of the fused tensors
        # (k3core.model.held).
        full_rank_gate = config.kda_output_gate == "full_rank"
        names = kda_x_names(full_rank_gate)
        self.x_rows = [sum(w(name).shape[0] for name in names[:3])] + [w(name).shape[0] for name in names[3:]]
        padding = kda_padding_rows(sum(self.x_rows))
        self.x_split = self.x_rows + ([padding] if padding else [])
        self.w_x = fuse_rows(weights, [prefix + name for name in names], padding)      # [3P + D + Hk + P|D + pad, H]
        conv = fuse_rows(weights, [prefix + f"self_attn.{part}_conv1d.weight" for part in "qkv"])       # [3P, 1, K]
        self.conv_weight = conv.squeeze(1).float()                                      # [3P, K_conv] (fp32 held)
        self.w_f_b = w("self_attn.f_b_proj.weight")
        self.gate = KdaGateParams(A_log=w("self_attn.A_log").float(), dt_bias=w("self_attn.dt_bias").float(),
                                  form=config.kda_gate, lower_bound=config.kda_gate_lower_bound)
        self.w_g_b = None if full_rank_gate else w("self_attn.g_b_proj.weight")
        self.w_o_norm, self.w_o = w("self_attn.o_norm.weight"), w("self_attn.o_proj.weight")
        self.scale = self.head_dim ** -0.5

    def forward(self, ops, x: torch.Tensor, batch: ForwardBatch, state: StateViews) -> torch.Tensor:
        num_tokens = x.shape[0]
        heads = (num_tokens, self.num_heads, self.head_dim)
        qkv, f_a, beta_logits, g, *_ = F.linear(x, self.w_x).split(self.x_split, dim=-1)   # [T, 3P], [T, D], [T, Hk]
        conv_state = state.conv_state(self.kda_index)
        if batch.is_decode:
            qkv = ops.short_conv_decode(qkv, self.conv_weight, conv_state, batch.slot_positions)
        else:
            cu_seqlens, slots = _host_metadata(batch)
            if batch.snapshots is not None and batch.snapshots.num_snapshots:   # before the op overwrites them
                conv_state[batch.snapshots.slot] = _conv_tails(qkv, conv_state, batch)
            qkv = ops.short_conv_prefill(qkv, self.conv_weight, cu_seqlens, conv_state, slots,
                                         batch.has_initial_state)
        q, k, v = (t.reshape(heads) for t in qkv.chunk(3, dim=-1))                      # [T, Hk, D] each
        f = F.linear(f_a, self.w_f_b).reshape(heads)                                   # [T, Hk, D]
        recurrent = state.kda_state(self.kda_index)
        if batch.is_decode:
            o = ops.kda_decode(q, k, v, f, beta_logits, self.gate, recurrent, batch.slot_positions, self.scale)
        else:
            snapshots = batch.snapshots
            out = ops.kda_prefill(q, k, v, f, beta_logits, self.gate, cu_seqlens, recurrent, slots,
                                  batch.has_initial_state, self.scale,
                                  checkpoint_lengths=snapshots.lengths if snapshots is not None else None)
            if snapshots is not None and snapshots.num_snapshots:
                recurrent[snapshots.slot] = out.checkpoint_states[snapshots.rows].to(recurrent.dtype)
            o = out.output
        z = g if self.w_g_b is None else F.linear(g, self.w_g_b)                        # [T, P]
        o = ops.gated_rms_norm(o, z.reshape(heads), self.w_o_norm, self.config.rms_norm_eps)  # [T, Hk, D]
        return F.linear(o.reshape(num_tokens, -1), self.w_o)                            # [T, H]


def _conv_tails(x: torch.Tensor, conv_state: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """[S, K_conv - 1, C]: each snapshot's conv window, the last K_conv - 1 pre-conv inputs after its sequence's
    first n new tokens: rows n .. n + K_conv - 2 of (history window, then the new inputs x), gathered on the device.
    A sequence without initial state has a zero history, as in the conv op."""
    snap = batch.snapshots
    history = conv_state.shape[1]                                               # K_conv - 1
    at = snap.num_new[:, None] + torch.arange(history, device=x.device)         # [S, K-1] index into the concat
    seq_start = batch.cu_seqlens.to(torch.int64)[snap.seq]                      # [S]
    seq_slot = batch.slot_positions[snap.seq]                                   # [S]
    from_x = x[(seq_start[:, None] + at - history).clamp(min=0)]                # [S, K-1, C]
    old = conv_state[seq_slot[:, None], at.clamp(max=history - 1)].to(x.dtype)  # [S, K-1, C]
    old = torch.where(batch.has_initial_state[snap.seq][:, None, None], old, torch.zeros_like(old))
    return torch.where((at >= history)[..., None], from_x, old).to(conv_state.dtype)


def _host_metadata(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """cu_seqlens and slot positions for the prefill ops, on the host when the batch carries copies there (the
    ops read them on the host anyway: a device copy would make each layer wait for the GPU to drain)."""
    if batch.cu_seqlens_host is not None and batch.slot_positions_host is not None:
        return batch.cu_seqlens_host, batch.slot_positions_host
    return batch.cu_seqlens, batch.slot_positions


class MlaLayer:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], prefix: str, mla_index: int,
                 dcp_group=None):
        w = lambda name: weights[prefix + name]  # noqa: E731
        self.config = config
        self.dcp = dcp_group                  # None, or the DCP group when MLA tokens are split by position
        self.mla_index = mla_index
        self.num_heads = config.mla_num_heads
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_rank = config.kv_lora_rank
        # Every projection of x is one GEMM: q (or its low-rank q_a), kv_a and the output gate, rows concatenated
        # (held once, k3core.model.held).
        names = ["self_attn.q_a_proj.weight" if config.q_lora_rank is not None else "self_attn.q_proj.weight",
                 "self_attn.kv_a_proj_with_mqa.weight"] + (["self_attn.g_proj.weight"] if config.mla_output_gate
                                                           else [])
        self.x_rows = [w(name).shape[0] for name in names]
        self.w_x = fuse_rows(weights, [prefix + name for name in names])
        if config.q_lora_rank is not None:
            self.w_q_a_norm, self.w_q_b = w("self_attn.q_a_layernorm.weight"), w("self_attn.q_b_proj.weight")
        else:
            self.w_q_a_norm = self.w_q_b = None
        self.w_kv_a_norm = w("self_attn.kv_a_layernorm.weight")
        self.w_kv_b = w("self_attn.kv_b_proj.weight")                                   # [Hm*(nope+v), r]
        kv_b = self.w_kv_b.reshape(self.num_heads, self.nope + self.v_dim, self.kv_rank)
        self.w_kc = kv_b[:, : self.nope, :]                                             # [Hm, nope, r]
        self.w_vc = kv_b[:, self.nope:, :].transpose(1, 2).contiguous()                 # [Hm, r, v]
        self.w_o = w("self_attn.o_proj.weight")
        self.scale = config.qk_head_dim ** -0.5     # NoPE: no rotary, no YaRN mscale

    def forward(self, ops, x: torch.Tensor, batch: ForwardBatch, state: StateViews) -> torch.Tensor:
        num_tokens = x.shape[0]
        eps = self.config.mla_latent_norm_eps
        q, kv_a, *gate = F.linear(x, self.w_x).split(self.x_rows, dim=-1)              # kv_a [T, r + rope]
        if self.w_q_b is not None:
            q = F.linear(ops.rms_norm(q, self.w_q_a_norm, eps), self.w_q_b)
        q = q.reshape(num_tokens, self.num_heads, self.nope + self.rope)                # [T, Hm, Dqk]
        latent = torch.cat([ops.rms_norm(kv_a[:, : self.kv_rank], self.w_kv_a_norm, eps),
                            kv_a[:, self.kv_rank:]], dim=-1)                            # [T, D_latent]
        cache = state.mla_kv(self.mla_index)
        owned = latent if batch.dcp_size == 1 else latent[batch.new_owned_rows]        # DCP: store my tokens only
        cache[batch.new_page, batch.new_offset] = owned.to(cache.dtype)
        if batch.is_decode:
            o = self._decode(ops, q, cache, batch)
        else:
            o = self._prefill(ops, q, cache, batch)
        o = o.reshape(num_tokens, self.num_heads * self.v_dim)                          # [T, Hm*v]
        if gate:
            o = o * torch.sigmoid(gate[0])
        return F.linear(o, self.w_o)

    def _prefill(self, ops, q: torch.Tensor, cache: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        keys = cache[batch.key_page, batch.key_offset].to(q.dtype)                     # [Tk_local, D_latent]
        if batch.dcp_size > 1:
            keys = torch.cat(self.dcp.all_gather_varlen(keys))[batch.key_gather_index]  # [Tk, D_latent]
        kv = F.linear(keys[:, : self.kv_rank], self.w_kv_b)
        kv = kv.reshape(-1, self.num_heads, self.nope + self.v_dim)                     # [Tk, Hm, nope+v]
        k_pe = keys[:, None, self.kv_rank:].expand(-1, self.num_heads, self.rope)       # [Tk, Hm, rope]
        k = torch.cat([kv[..., : self.nope], k_pe], dim=-1)                             # [Tk, Hm, Dqk]
        v = kv[..., self.nope:].contiguous()                                            # [Tk, Hm, v]
        if batch.cu_seqlens_host is not None and batch.cu_seqlens_k_host is not None:   # read on the host: no wait
            return ops.mla_prefill(q, k, v, batch.cu_seqlens_host, batch.cu_seqlens_k_host, self.scale)
        return ops.mla_prefill(q, k, v, batch.cu_seqlens, batch.cu_seqlens_k, self.scale)

    def _decode(self, ops, q: torch.Tensor, cache: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # Weight absorption: score = q_nope . (W_kc c) = (W_kc^T q_nope) . c, so attention runs over the latent.
        q_latent = torch.einsum("bhn,hnr->bhr", q[..., : self.nope], self.w_kc.to(q.dtype))  # [B, Hm, r]
        q_full = torch.cat([q_latent, q[..., self.nope:]], dim=-1)                      # [B, Hm, r + rope]
        if batch.dcp_size > 1:
            return self._decode_dcp(ops, q_full, cache, batch)
        out = ops.mla_decode(q_full, cache, batch.page_table, batch.seq_lens, self.scale, self.kv_rank)
        return torch.einsum("bhr,hrv->bhv", out.output.to(q.dtype), self.w_vc.to(q.dtype))  # [B, Hm, v]

    def _decode_dcp(self, ops, q_full: torch.Tensor, cache: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Each rank attends every DCP member's queries over its own 1/dcp of the tokens; an all-gather of the
        partial outputs and their LSEs lets each rank merge its own heads exactly."""
        members = self.dcp.size
        heads = q_full.shape[1]
        q_all = torch.cat(self.dcp.all_gather(q_full), dim=1)                            # [B, dcp*Hm, D_latent]
        local = batch.local_seq_lens
        out = ops.mla_decode(q_all, cache, batch.page_table, local.clamp(min=1), self.scale, self.kv_rank)
        lse = torch.where(local[:, None] > 0, out.lse, torch.full_like(out.lse, float("-inf")))  # [B, dcp*Hm]
        block = slice(self.dcp.index * heads, (self.dcp.index + 1) * heads)
        outputs = [o[:, block].float() for o in self.dcp.all_gather(out.output.float())]  # dcp x [B, Hm, r]
        lses = torch.stack([part[:, block] for part in self.dcp.all_gather(lse)])        # [dcp, B, Hm]
        weights = torch.softmax(lses, dim=0)                                             # exact LSE merge
        merged = sum(weights[j][..., None] * outputs[j] for j in range(members))         # [B, Hm, r]
        return torch.einsum("bhr,hrv->bhv", merged.to(q_full.dtype), self.w_vc.to(q_full.dtype))
