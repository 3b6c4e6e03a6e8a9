"""Agreement with an implementation nobody here wrote: transformers 5.23's KimiLinearForCausalLM.

Each case builds a small random HF model, perturbs every parameter and buffer away from its initial value (so no
bug hides behind a zero bias or a unit norm weight), saves it with `save_pretrained`, loads the directory with
k3core and compares float32 logits (relative max error 1e-4) and 16-token greedy continuations.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from k3core import LLM, SamplingParams  # noqa: E402

# Relative max error of float32 logits: both sides run float32 with different summation orders (chunked KDA,
# fused GEMMs); 1e-4 of the largest logit is far above that rounding and far below any real bug.
LOGIT_RTOL = 1e-4


def _hf_config(**overrides):
    base = dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, num_experts=8, num_experts_per_token=2, num_shared_experts=1,
        routed_scaling_factor=2.446, linear_num_heads=2, linear_head_dim=16, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"], rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False,
    )
    base.update(overrides)
    return transformers.KimiLinearConfig(**base)


CASES = {
    "no_q_lora": {},
    "q_lora_two_shared_8_layers": dict(
        q_lora_rank=24, num_shared_experts=2, num_hidden_layers=8,
        layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
        mlp_layer_types=["dense"] + ["sparse"] * 7),
    "no_dense_first": dict(mlp_layer_types=["sparse"] * 4, num_experts_per_token=3),
}


def _perturbed_model(config, seed: int):
    torch.manual_seed(seed)
    model = transformers.KimiLinearForCausalLM(config).eval().float()
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


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    config = _hf_config(**CASES[request.param])
    model = _perturbed_model(config, seed=sorted(CASES).index(request.param))
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory)
    llm = LLM(str(directory), backend="torch", device="cpu", dtype="float32")
    return model, llm


@pytest.mark.parametrize("prompt_len", [1, 63, 200])
def test_logits_match_transformers(checkpoint, prompt_len):
    model, llm = checkpoint
    ids = torch.randint(0, 256, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len))
    with torch.no_grad():
        expected = model(ids[None], use_cache=False).logits[0].float()                   # [T, V]
    got = llm.prompt_logits(ids.tolist())
    assert got.shape == expected.shape
    error = (got - expected).abs().max().item() / expected.abs().max().item()
    assert error <= LOGIT_RTOL, f"relative max logit error {error:.2e} > {LOGIT_RTOL:.0e}"


@pytest.mark.parametrize("prompt_len", [1, 63])
def test_greedy_continuation_matches_transformers(checkpoint, prompt_len):
    model, llm = checkpoint
    ids = torch.randint(0, 256, (prompt_len,), generator=torch.Generator().manual_seed(100 + prompt_len))
    with torch.no_grad():
        hf = model.generate(ids[None], max_new_tokens=16, do_sample=False, min_new_tokens=16)[0, prompt_len:]
    out = llm.generate([ids.tolist()], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == hf.tolist()
