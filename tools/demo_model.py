"""A differentiable K3-family network for training the demo model, on the canonical weight names.

The forward is the network of `k3core/model/network.py` for a batch of whole sequences that start from an empty
state, written for autograd: the math comes from the PyTorch reference ops (`kernels/torch`: RMSNorm, gated
RMSNorm, SiTU, the KDA gate, L2 norm and chunk step, AttnRes, MoE routing and experts); only the short convolution
(F.conv1d instead of a per-sequence unfold) and the causal MLA attention (F.scaled_dot_product_attention) are
written differently, and `tests/test_demo_model.py` checks the logits against `k3core.LLM(..., backend="torch")`.

Training-only parts: the router's correction bias is a buffer updated by load balancing (not by the gradient),
and with `fake_quant_experts` the routed experts run on their MXFP4 values (straight-through gradient), so the
checkpoint's MXFP4 experts are the weights that were trained.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from k3core.config import ModelConfig
from k3core.model.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from k3core.model.weights import expected_tensors, layer_prefix
from k3core.ops import KdaGateParams
from kernels.torch.activation import glu_activation
from kernels.torch.attn_res import attn_res_read
from kernels.torch.kda import _chunk_step, kda_gate, l2_normalize
from kernels.torch.moe import moe_experts, route_scores, route_weights
from kernels.torch.norm import gated_rms_norm, rms_norm

TRAIN_CHUNK = 32            # KDA chunk length in training (the math is the same at any length)


def _key(name: str) -> str:
    return name.replace(".", "__")


def _full_precision(x: torch.Tensor):
    """A region where autocast is off: its float32 inputs stay float32."""
    return torch.autocast(device_type=x.device.type, enabled=False)


def fake_mxfp4(weight: torch.Tensor) -> torch.Tensor:
    """weight with its MXFP4 value in the forward and the identity gradient (straight-through)."""
    packed, scale = quantize_mxfp4(weight)
    return weight + (dequantize_mxfp4(packed, scale).to(weight.dtype) - weight).detach()


def dense_experts(config: ModelConfig, weights: dict[str, torch.Tensor]) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, weights) with the routed experts dense: a config that holds them packed (`expert_format`
    "mxfp4", as a K3 checkpoint loads) is turned into the dense one, its packed pairs dequantised exactly."""
    if getattr(config, "expert_format", "bf16") != "mxfp4":
        return config, weights
    dense = {}
    for name, tensor in weights.items():
        if name.endswith((".mlp.experts.w13_packed", ".mlp.experts.w2_packed")):
            base = name[: -len("_packed")]
            dense[base] = dequantize_mxfp4(tensor, weights[base + "_scale"])
        elif not name.endswith((".mlp.experts.w13_scale", ".mlp.experts.w2_scale")):
            dense[name] = tensor
    return config.replace(expert_format="bf16"), dense


class DemoModel(nn.Module):
    """The K3-family network for training: parameters on the canonical names, `forward(token_ids)` -> logits."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor]):
        super().__init__()
        config, weights = dense_experts(config, weights)
        self.config = config
        self.params = nn.ParameterDict()
        self.fake_quant_experts = False
        for name in expected_tensors(config):
            if name.endswith("e_score_correction_bias"):
                self.register_buffer(_key(name), weights[name].detach().float().clone())
            else:
                self.params[_key(name)] = nn.Parameter(weights[name].detach().float().clone())
        self.expert_load: dict[int, torch.Tensor] = {}      # tokens per expert in the last forward, per MoE layer

    def w(self, name: str) -> torch.Tensor:
        key = _key(name)
        return self.params[key] if key in self.params else getattr(self, key)

    def state_weights(self) -> dict[str, torch.Tensor]:
        """Every canonical tensor, detached float32 copies."""
        return {name: self.w(name).detach().clone() for name in expected_tensors(self.config)}

    # ---- forward -------------------------------------------------------------------------------------------
    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [B, T] -> float32 logits [B, T, V]."""
        c = self.config
        batch, seq_len = token_ids.shape
        live = F.embedding(token_ids, self.w("model.embed_tokens.weight")).reshape(batch * seq_len, -1)  # [N, H]
        bank: list[torch.Tensor] = []

        def read(prefix: str, current: torch.Tensor) -> torch.Tensor:
            if not bank:
                return current
            query = self.w(prefix + "norm.weight") * self.w(prefix + "proj.weight").reshape(-1)   # folded [H]
            return attn_res_read(torch.stack(bank, dim=1), len(bank), current, query, c.rms_norm_eps)

        for layer_id in range(c.num_layers):
            prefix = layer_prefix(layer_id)
            h = read(prefix + "self_attention_res_", live)
            if layer_id % c.attn_res_block_size == 0:
                bank.append(live)
                live = None
            x = rms_norm(h, self.w(prefix + "input_layernorm.weight"), c.rms_norm_eps)
            if c.layer_types[layer_id] == "kda":
                a = self._kda(prefix, x, batch, seq_len)
            else:
                a = self._mla(prefix, x, batch, seq_len)
            live = a if live is None else live + a
            h2 = read(prefix + "mlp_res_", live)
            x2 = rms_norm(h2, self.w(prefix + "post_attention_layernorm.weight"), c.rms_norm_eps)
            if c.mlp_types[layer_id] == "dense":
                f = self._glu(prefix + "mlp.", x2)
            else:
                f = self._moe(layer_id, prefix + "mlp.", x2)
            live = live + f
        out = read("model.output_attn_res_", live)
        hidden = rms_norm(out, self.w("model.norm.weight"), c.rms_norm_eps)
        logits = F.linear(hidden, self.w("lm_head.weight")).float()                    # [N, V]
        return logits.reshape(batch, seq_len, -1)

    def _glu(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        gate_up = torch.cat([self.w(prefix + "gate_proj.weight"), self.w(prefix + "up_proj.weight")])
        hidden = glu_activation(F.linear(x, gate_up), c.activation, c.situ_beta, c.situ_linear_beta)
        return F.linear(hidden, self.w(prefix + "down_proj.weight"))

    def _kda(self, prefix: str, x: torch.Tensor, batch: int, seq_len: int) -> torch.Tensor:
        c, w = self.config, lambda n: self.w(prefix + "self_attn." + n)  # noqa: E731
        heads, dim = c.kda_num_heads, c.kda_head_dim
        w_qkv = torch.cat([w("q_proj.weight"), w("k_proj.weight"), w("v_proj.weight")])  # [3P, H]
        conv = torch.cat([w("q_conv1d.weight"), w("k_conv1d.weight"), w("v_conv1d.weight")])  # [3P, 1, Kc]
        qkv = F.linear(x, w_qkv).reshape(batch, seq_len, -1).transpose(1, 2)             # [B, 3P, T]
        qkv = F.silu(F.conv1d(qkv, conv, padding=c.conv_kernel_size - 1, groups=qkv.shape[1])[..., :seq_len])
        qkv = qkv.transpose(1, 2).reshape(batch * seq_len, -1)                            # [N, 3P]
        q, k, v = (t.reshape(-1, heads, dim) for t in qkv.chunk(3, dim=-1))              # [N, Hk, D]
        f = F.linear(F.linear(x, w("f_a_proj.weight")), w("f_b_proj.weight")).reshape(-1, heads, dim)
        gate = KdaGateParams(A_log=w("A_log"), dt_bias=w("dt_bias"), form=c.kda_gate,
                             lower_bound=c.kda_gate_lower_bound)
        g = kda_gate(f, gate)                                                             # [N, Hk, D]
        beta = torch.sigmoid(F.linear(x, w("b_proj.weight")))                            # [N, Hk]

        def heads_first(t: torch.Tensor) -> torch.Tensor:                                # [N, Hk, *] -> [B*Hk, T, *]
            t = t.reshape(batch, seq_len, heads, -1).transpose(1, 2)
            return t.reshape(batch * heads, seq_len, -1)

        with _full_precision(x):
            # The recurrence accumulates decays and a triangular solve: float32 whatever the autocast dtype.
            qh, kh = heads_first(l2_normalize(q.float())), heads_first(l2_normalize(k.float()))
            vh, gh = heads_first(v.float()), heads_first(g)
            bh = heads_first(beta.float()[..., None])[..., 0]                            # [B*Hk, T]
            state = qh.new_zeros(batch * heads, dim, dim)                                # [B*Hk, V, K]
            outputs = []
            for start in range(0, seq_len, TRAIN_CHUNK):
                end = min(start + TRAIN_CHUNK, seq_len)
                o, state = _chunk_step(qh[:, start:end], kh[:, start:end], vh[:, start:end], gh[:, start:end],
                                       bh[:, start:end], state, dim ** -0.5)
                outputs.append(o)
        o = torch.cat(outputs, dim=1).reshape(batch, heads, seq_len, dim).transpose(1, 2)  # [B, T, Hk, D]
        z = F.linear(x, w("g_proj.weight")).reshape(-1, heads, dim)
        o = gated_rms_norm(o.reshape(-1, heads, dim), z, w("o_norm.weight"), c.rms_norm_eps)
        return F.linear(o.reshape(batch * seq_len, -1), w("o_proj.weight"))

    def _mla(self, prefix: str, x: torch.Tensor, batch: int, seq_len: int) -> torch.Tensor:
        c, w = self.config, lambda n: self.w(prefix + "self_attn." + n)  # noqa: E731
        heads, nope, rope, v_dim, rank = (c.mla_num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
                                          c.kv_lora_rank)
        eps = c.mla_latent_norm_eps
        q = F.linear(rms_norm(F.linear(x, w("q_a_proj.weight")), w("q_a_layernorm.weight"), eps), w("q_b_proj.weight"))
        kv_a = F.linear(x, w("kv_a_proj_with_mqa.weight"))                              # [N, r + rope]
        latent = rms_norm(kv_a[:, :rank], w("kv_a_layernorm.weight"), eps)
        kv = F.linear(latent, w("kv_b_proj.weight")).reshape(batch, seq_len, heads, nope + v_dim)
        k_pe = kv_a[:, rank:].reshape(batch, seq_len, 1, rope).expand(-1, -1, heads, -1)  # shared, never rotated
        k = torch.cat([kv[..., :nope], k_pe], dim=-1)                                    # [B, T, Hm, Dqk]
        q = q.reshape(batch, seq_len, heads, nope + rope)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), kv[..., nope:].transpose(1, 2),
                                           is_causal=True, scale=(nope + rope) ** -0.5)   # [B, Hm, T, v]
        o = o.transpose(1, 2).reshape(batch * seq_len, heads * v_dim)
        o = o * torch.sigmoid(F.linear(x, w("g_proj.weight")))
        return F.linear(o, w("o_proj.weight"))

    def _moe(self, layer_id: int, prefix: str, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        with _full_precision(x):                                                          # the router in float32
            logits = F.linear(x.float(), self.w(prefix + "gate.weight").float())         # [N, E]
        scores, choice = route_scores(logits, self.w(prefix + "gate.e_score_correction_bias"), c.router_scoring)
        expert_ids = torch.topk(choice, c.num_experts_per_token, dim=-1, sorted=True).indices  # [N, k]
        weights = route_weights(scores, expert_ids, c.moe_renormalize, c.routed_scaling_factor)
        self.expert_load[layer_id] = torch.bincount(expert_ids.flatten(), minlength=c.num_experts).detach()
        w13, w2 = self.w(prefix + "experts.w13"), self.w(prefix + "experts.w2")
        if self.fake_quant_experts:
            w13, w2 = fake_mxfp4(w13), fake_mxfp4(w2)
        z = F.linear(x, self.w(prefix + "routed_expert_down_proj.weight"))              # [N, De]
        y = moe_experts(z, w13, w2, weights, expert_ids, c.activation, c.situ_beta, c.situ_linear_beta)
        y = rms_norm(y, self.w(prefix + "routed_expert_norm.weight"), c.rms_norm_eps)
        y = F.linear(y, self.w(prefix + "routed_expert_up_proj.weight"))                # [N, H]
        return y + self._glu(prefix + "shared_experts.", x)

    @torch.no_grad()
    def balance_experts(self, rate: float) -> None:
        """Auxiliary-loss-free balancing: raise the correction bias of under-loaded experts, lower over-loaded."""
        for layer_id, load in self.expert_load.items():
            bias = self.w(layer_prefix(layer_id) + "mlp.gate.e_score_correction_bias")
            bias += rate * torch.sign(load.float().mean() - load.float())


def initial_weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Training initialisation on the canonical names (float32)."""
    generator = torch.Generator().manual_seed(seed)
    num_sublayers = 2 * config.num_layers
    out = {}
    for name, spec in expected_tensors(config).items():
        shape = spec.shape
        if name.endswith("embed_tokens.weight"):
            value = torch.randn(shape, generator=generator)
        elif name.endswith(("layernorm.weight", "norm.weight")):
            value = torch.ones(shape)
        elif name.endswith(("res_proj.weight", "e_score_correction_bias")):
            value = torch.zeros(shape)                        # uniform depth mixing and unbiased routing at first
        elif name.endswith("A_log"):
            value = (torch.rand(shape, generator=generator) * 15 + 1).log()
        elif name.endswith("dt_bias"):
            dt = (torch.rand(shape, generator=generator) * (math.log(1e-1) - math.log(1e-3)) + math.log(1e-3)).exp()
            value = dt + torch.log(-torch.expm1(-dt))
        elif name.endswith("conv1d.weight"):
            value = torch.randn(shape, generator=generator) / math.sqrt(shape[-1])
        else:
            value = torch.randn(shape, generator=generator) / math.sqrt(shape[-1])
            if name.endswith(("o_proj.weight", "mlp.down_proj.weight", "shared_experts.down_proj.weight",
                              "experts.w2", "routed_expert_up_proj.weight")):
                value = value / math.sqrt(num_sublayers)      # output projections: a quieter residual stream
        out[name] = value
    return out
