"""Small random transformers Kimi-Linear checkpoints for tests (not a test module): the independent model."""
from __future__ import annotations

import pytest
import torch

BASE = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, num_experts=8, num_experts_per_token=2, num_shared_experts=1,
    routed_scaling_factor=2.446, linear_num_heads=2, linear_head_dim=16, linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"], rms_norm_eps=1e-5,
    bos_token_id=1, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False,
)


def perturbed_kimi_linear(seed: int, **overrides):
    """A random KimiLinearForCausalLM (float32, eval) with every parameter and buffer moved off its initial value,
    so that no bug hides behind a zero bias or a unit norm weight."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    model = transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(**{**BASE, **overrides})).eval().float()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if not tensor.is_floating_point():
                continue
            noise = torch.randn(tensor.shape, generator=generator)
            if "A_log" in name or "dt_bias" in name:
                tensor.add_(0.3 * noise)
            elif name.endswith("norm.weight"):
                tensor.copy_(1.0 + 0.2 * noise)
            elif "e_score_correction_bias" in name:
                tensor.copy_(0.05 * noise)
            else:
                tensor.add_(0.02 * noise)
    return model


def save_kimi_linear(directory, seed: int, **overrides) -> str:
    perturbed_kimi_linear(seed, **overrides).save_pretrained(directory)
    return str(directory)
