"""The demo model's training network means the same thing as the engine's network on the same weights.

`tools/demo_model.DemoModel` is written for autograd (whole sequences, F.conv1d, SDPA for MLA); the engine runs
`k3core.model.network.Network` through the backend ops with a paged state. The trained weights are only useful if
both compute the same function, so the training network's logits are compared with `k3core.LLM(..., backend=
"torch")` on a K3-format checkpoint written from the same weights (MXFP4 experts, read back by the loader: the
path a real checkpoint takes). Every K3 switch is on in the tiny config (k3-tiny): lower-bounded KDA gate,
full-rank KDA output gate, gated NoPE MLA, the 3:1 pattern ending in MLA, AttnRes blocks, a first dense layer,
LatentMoE with its norm, SiTU, top-k routing with a correction bias, a shared expert.
"""
from __future__ import annotations

import pytest
import torch

from k3core import LLM
from k3core.config import ModelConfig
from k3core.model.checkpoint_writer import save_k3_checkpoint
from k3core.model.weights import init_random_weights
from tools.demo_model import TRAIN_CHUNK, DemoModel, fake_mxfp4, initial_weights

# The two networks order float32 sums differently (chunked KDA vs the prefill op, SDPA vs explicit softmax,
# per-expert GEMMs); over 10 layers that leaves ~1e-5 relative error in the logits. A wrong weight, a missing gate
# or a mis-ordered AttnRes seal changes them at O(1).
LOGIT_ATOL = 2e-4


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    config = ModelConfig.preset("k3-tiny")
    weights = init_random_weights(config, seed=7)
    directory = tmp_path_factory.mktemp("demo_ckpt")
    held = save_k3_checkpoint(weights, config, directory, mxfp4_experts=True)
    return config, held, directory


def _prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    # longer than one training chunk (a chunk boundary inside), and an awkward short one
    lengths = (2 * TRAIN_CHUNK + 7, 15)
    return [torch.randint(0, 256, (n,), generator=generator).tolist() for n in lengths]


def test_every_k3_switch_is_on(tiny_checkpoint):
    config, _, _ = tiny_checkpoint
    assert config.kda_gate == "lower_bound" and config.kda_output_gate == "full_rank"
    assert config.mla_output_gate and config.layer_types[-1] == "mla" and config.layer_types[:4] == (
        "kda", "kda", "kda", "mla")
    assert config.attn_res and config.attn_res_block_size < config.num_layers
    assert config.mlp_types[0] == "dense" and set(config.mlp_types[1:]) == {"moe"}
    assert config.activation == "situ" and config.moe_latent_size is not None and config.moe_latent_norm
    assert config.router_correction_bias and config.num_shared_experts > 0


def test_logits_equal_the_engine(tiny_checkpoint):
    config, held, directory = tiny_checkpoint
    llm = LLM(str(directory), backend="torch", device="cpu", dtype="float32")
    model = DemoModel(config, held)
    prompts = _prompts(config.vocab_size)
    with torch.no_grad():
        for prompt in prompts:
            want = llm.prompt_logits(prompt)                                          # [T, V]
            got = model(torch.tensor([prompt]))[0]                                    # [T, V]
            assert got.shape == want.shape
            assert torch.allclose(got, want, atol=LOGIT_ATOL, rtol=0), (got - want).abs().max()
        # a batch of equal-length sequences gives each sequence's own logits (no leak between rows)
        length = min(len(p) for p in prompts)
        batch = torch.tensor([p[:length] for p in prompts])
        batched = model(batch)
        for row, prompt in enumerate(prompts):
            want = llm.prompt_logits(prompt[:length])
            assert torch.allclose(batched[row], want, atol=LOGIT_ATOL, rtol=0)


def test_a_changed_weight_is_seen(tiny_checkpoint):
    """The comparison can fail: perturbing one AttnRes query changes the training network's logits."""
    config, held, directory = tiny_checkpoint
    llm = LLM(str(directory), backend="torch", device="cpu", dtype="float32")
    changed = dict(held)
    name = "model.layers.5.mlp_res_proj.weight"
    changed[name] = held[name] + 0.5
    prompt = _prompts(config.vocab_size)[1]
    with torch.no_grad():
        got = DemoModel(config, changed)(torch.tensor([prompt]))[0]
    assert (got - llm.prompt_logits(prompt)).abs().max() > 100 * LOGIT_ATOL


def test_fake_quant_experts_train_the_checkpoint_values(tiny_checkpoint):
    """With fake quantisation on, the network run on the float weights equals the one on the MXFP4 values the
    checkpoint holds, and the gradient passes straight through to the float weights."""
    config, held, _ = tiny_checkpoint
    weights = init_random_weights(config, seed=7)
    model = DemoModel(config, weights)
    model.fake_quant_experts = True
    prompt = torch.tensor([_prompts(config.vocab_size)[1]])
    logits = model(prompt)
    with torch.no_grad():
        want = DemoModel(config, held)(prompt)
    assert torch.allclose(logits, want, atol=1e-5, rtol=0)
    logits.square().mean().backward()
    grad = model.params["model__layers__1__mlp__experts__w13"].grad
    assert grad is not None and grad.abs().sum() > 0
    w = torch.randn(4, 64, requires_grad=True)
    fake_mxfp4(w).sum().backward()
    assert torch.equal(w.grad, torch.ones_like(w))


def test_training_initialisation_covers_every_tensor():
    config = ModelConfig.preset("k3-tiny")
    weights = initial_weights(config, seed=0)
    again = initial_weights(config, seed=0)
    assert weights.keys() == init_random_weights(config, seed=0).keys()
    assert all(torch.equal(weights[n], again[n]) for n in weights)
    assert all(torch.isfinite(t).all() for t in weights.values())
