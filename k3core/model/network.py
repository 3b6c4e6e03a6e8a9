"""The K3-family network, top to bottom, built only from backend ops (K3_ARCHITECTURE.md §3).

`Network(config, weights, ops).forward(batch, state)` returns float32 logits for the batch's logit rows. The
residual stream is either the ordinary pre-norm residual (Kimi-Linear) or Attention Residuals (K3): a live
running sum `p` plus a bank of sealed block snapshots, read by a softmax over depth before every sublayer.

A parallel plan runs the same network on a subset of layers (a pipeline stage) with sharded weights; the
`comm` it is given reduces the row-parallel outputs. With the defaults it is the whole single-device model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from k3core.config import ModelConfig
from k3core.model.attention import KdaLayer, MlaLayer
from k3core.model.batch import ForwardBatch, StateViews
from k3core.model.ffn import DenseMlp, MoeMlp


@dataclass
class Stream:
    """The residual stream between stages. Plain residual: `live` is x. AttnRes: `live` is the running sum p
    (None right after a seal) and `bank[:, :num_sealed]` the sealed snapshots."""
    live: torch.Tensor | None
    bank: torch.Tensor | None = None
    num_sealed: int = 0


class DecoderLayer:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], layer_id: int, kda_index: int,
                 mla_index: int, comm, expert_offset: int):
        prefix = f"model.layers.{layer_id}."
        self.layer_id = layer_id
        self.reduce = comm.tp.all_reduce if comm is not None else None
        if config.layer_types[layer_id] == "kda":
            self.mixer = KdaLayer(config, weights, prefix, kda_index)
        else:
            self.mixer = MlaLayer(config, weights, prefix, mla_index, comm.dcp if comm is not None else None)
        if config.mlp_types[layer_id] == "dense":
            self.mlp, self.mlp_reduces_itself = DenseMlp(config, weights, prefix + "mlp."), False
        else:
            self.mlp = MoeMlp(config, weights, prefix + "mlp.", comm, expert_offset)
            self.mlp_reduces_itself = True
        self.w_input_norm = weights[prefix + "input_layernorm.weight"]
        self.w_post_norm = weights[prefix + "post_attention_layernorm.weight"]
        if config.attn_res:
            self.q_attn_res_attn = _folded_query(weights, prefix + "self_attention_res_")
            self.q_attn_res_mlp = _folded_query(weights, prefix + "mlp_res_")

    def attention(self, ops, x: torch.Tensor, batch: ForwardBatch, state: StateViews) -> torch.Tensor:
        out = self.mixer.forward(ops, x, batch, state)
        return self.reduce(out) if self.reduce is not None else out

    def feed_forward(self, ops, x: torch.Tensor) -> torch.Tensor:
        out = self.mlp.forward(ops, x)
        return self.reduce(out) if self.reduce is not None and not self.mlp_reduces_itself else out


def _folded_query(weights: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """AttnRes scores use the norm weight only through the query, so fold gamma * w_p once (float32)."""
    return (weights[prefix + "norm.weight"].float() * weights[prefix + "proj.weight"].float().reshape(-1))


class Network:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], ops, comm=None,
                 layer_ids: list[int] | None = None, expert_offset: int = 0):
        self.config = config
        self.ops = ops
        self.weights = weights
        self.layer_ids = list(range(config.num_layers)) if layer_ids is None else list(layer_ids)
        self.first_stage = self.layer_ids[0] == 0
        self.last_stage = self.layer_ids[-1] == config.num_layers - 1
        # State views are indexed by KDA / MLA layer among the layers this network owns.
        local_kda = [i for i in self.layer_ids if config.layer_types[i] == "kda"]
        local_mla = [i for i in self.layer_ids if config.layer_types[i] == "mla"]
        self.layers = [DecoderLayer(config, weights, i, local_kda.index(i) if i in local_kda else -1,
                                    local_mla.index(i) if i in local_mla else -1, comm, expert_offset)
                       for i in self.layer_ids]
        self.num_kda_layers, self.num_mla_layers = len(local_kda), len(local_mla)
        if self.first_stage:
            self.embed = weights["model.embed_tokens.weight"]                           # [V, H]
        if self.last_stage:
            self.lm_head = weights["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]
            self.w_final_norm = weights["model.norm.weight"]
            if config.attn_res:
                self.q_attn_res_out = _folded_query(weights, "model.output_attn_res_")

    @property
    def padding_bytes(self) -> int:
        """Bytes held in zero rows that pad fused projections (KDA's, `k3core.model.held`), outside every table
        entry: what the network holds is its table's entries plus these (`k3core.sizing` counts both)."""
        return sum((layer.mixer.w_x.shape[0] - sum(layer.mixer.x_rows)) * layer.mixer.w_x[0].nbytes
                   for layer in self.layers if isinstance(layer.mixer, KdaLayer))

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, state: StateViews, stream: Stream | None = None):
        """Logits [R, V] float32 on the last stage; the outgoing Stream on earlier stages."""
        if stream is None:
            stream = self.embed_tokens(batch)
        stream = self.run_layers(stream, batch, state)
        if not self.last_stage:
            return stream
        hidden = self.final_hidden(stream)[batch.logit_rows]                            # [R, H]
        return F.linear(hidden, self.lm_head).float()                                   # [R, V]

    def embed_tokens(self, batch: ForwardBatch) -> Stream:
        x = F.embedding(batch.token_ids, self.embed)                                    # [T, H]
        if not self.config.attn_res:
            return Stream(x)
        bank = x.new_empty(x.shape[0], self.config.num_attn_res_blocks, x.shape[1])     # [T, S_max, H] scratch
        return Stream(x, bank, 0)

    def final_hidden(self, stream: Stream) -> torch.Tensor:
        """The final-normed hidden state of every token."""
        x = stream.live
        if self.config.attn_res:
            x = self.ops.attn_res_read(stream.bank, stream.num_sealed, x, self.q_attn_res_out,
                                       self.config.rms_norm_eps)
        return self.ops.rms_norm(x, self.w_final_norm, self.config.rms_norm_eps)

    def run_layers(self, stream: Stream, batch: ForwardBatch, state: StateViews) -> Stream:
        ops, eps = self.ops, self.config.rms_norm_eps
        if not self.config.attn_res:
            x = stream.live
            for layer in self.layers:
                x = x + layer.attention(ops, ops.rms_norm(x, layer.w_input_norm, eps), batch, state)
                x = x + layer.feed_forward(ops, ops.rms_norm(x, layer.w_post_norm, eps))
            return Stream(x)
        return self._attn_res_layers(stream, batch, state)

    def _attn_res_layers(self, stream: Stream, batch: ForwardBatch, state: StateViews) -> Stream:
        """K3_ARCHITECTURE.md §3.1: seal after the pre-attention read at every block start, reset the live sum."""
        ops, c = self.ops, self.config
        eps, block = c.rms_norm_eps, c.attn_res_block_size
        bank, num_sealed, live = stream.bank, stream.num_sealed, stream.live

        def read(query: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
            return ops.attn_res_read(bank, num_sealed, current, query, eps)

        for layer in self.layers:
            h = read(layer.q_attn_res_attn, live) if num_sealed > 0 else live
            if layer.layer_id % block == 0:
                bank[:, num_sealed] = live
                num_sealed += 1
                live = None
            a = layer.attention(ops, ops.rms_norm(h, layer.w_input_norm, eps), batch, state)
            live = a if live is None else live + a
            h2 = read(layer.q_attn_res_mlp, live)
            live = live + layer.feed_forward(ops, ops.rms_norm(h2, layer.w_post_norm, eps))
        return Stream(live, bank, num_sealed)
