"""Grouped top-k routing (num_expert_group > 1 with topk_group): the reference and the Triton route kernel against
transformers' Kimi-Linear router, and a whole num_expert_group: 2 model against transformers' logits."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_helpers import perturbed_kimi_linear  # noqa: E402
from k3core import LLM  # noqa: E402
from k3core.config import ConfigError, ModelConfig  # noqa: E402
from kernels.torch.moe import moe_route  # noqa: E402

LOGIT_RTOL = 1e-4        # as tests/test_hf_agreement.py: float32 both sides, different summation orders

GROUPINGS = [(16, 4, 2, 4), (12, 3, 1, 3), (8, 2, 1, 2), (64, 8, 4, 8)]   # experts, groups, kept groups, top-k


def _hf_router(num_experts: int, groups: int, kept: int, top_k: int, seed: int):
    config = transformers.KimiLinearConfig(hidden_size=32, num_experts=num_experts, num_experts_per_token=top_k,
                                           n_group=groups, topk_group=kept, routed_scaling_factor=2.5,
                                           moe_renormalize=True)
    router = transformers.models.kimi_linear.modeling_kimi_linear.KimiLinearTopkRouter(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=generator))
        router.e_score_correction_bias.copy_(0.1 * torch.randn(num_experts, generator=generator))
    return router, torch.randn(57, 32, generator=generator)


def _sorted(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.argsort(dim=-1)
    return ids.gather(-1, order), weights.gather(-1, order)


@pytest.mark.parametrize("num_experts, groups, kept, top_k", GROUPINGS)
def test_reference_matches_transformers_router(num_experts, groups, kept, top_k):
    router, x = _hf_router(num_experts, groups, kept, top_k, seed=num_experts + groups)
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(x)
    route = moe_route(logits.double(), router.e_score_correction_bias.double(), top_k, "sigmoid", True, 2.5,
                      groups, kept)
    want_ids, want_weights = _sorted(hf_ids, hf_weights)
    got_ids, got_weights = _sorted(route.expert_ids, route.weights)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_weights, want_weights.double(), rtol=1e-6, atol=1e-7)
    ungrouped = moe_route(logits.double(), router.e_score_correction_bias.double(), top_k, "sigmoid", True, 2.5)
    assert not torch.equal(_sorted(ungrouped.expert_ids, ungrouped.weights)[0], want_ids)   # grouping mattered


@pytest.mark.parametrize("num_experts, groups, kept, top_k", GROUPINGS + [(8, 8, 3, 2)])
def test_triton_route_matches_reference(num_experts, groups, kept, top_k):
    pytest.importorskip("triton")
    from kernels.triton.moe_route import moe_route as triton_route
    generator = torch.Generator().manual_seed(7 * num_experts + kept)
    logits = 2 * torch.randn(41, num_experts, generator=generator)
    bias = 0.1 * torch.randn(num_experts, generator=generator)
    want = moe_route(logits.double(), bias.double(), top_k, "sigmoid", True, 2.5, groups, kept)
    got = triton_route(logits, bias, top_k, "sigmoid", True, 2.5, groups, kept)
    assert torch.equal(got.expert_ids, want.expert_ids)                 # both in descending biased score
    torch.testing.assert_close(got.weights.double(), want.weights, rtol=1e-6, atol=1e-7)


def test_bad_groupings_are_refused_with_the_field():
    base = ModelConfig.preset("k3-tiny").to_dict()
    with pytest.raises(ConfigError, match="`num_expert_group`"):
        ModelConfig.from_dict({**base, "num_expert_group": base["num_experts"] + 1})
    with pytest.raises(ConfigError, match="`topk_group`"):
        ModelConfig.from_dict({**base, "num_expert_group": 2, "topk_group": 3})
    with pytest.raises(ValueError, match="num_expert_group=3 must divide"):
        moe_route(torch.zeros(1, 8), None, 2, "sigmoid", True, 1.0, 3, 1)


def test_num_expert_group_2_model_matches_transformers(tmp_path):
    model = perturbed_kimi_linear(seed=5, n_group=2, topk_group=1, mlp_layer_types=["sparse"] * 4,
                                  num_experts_per_token=3)
    model.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), backend="torch", device="cpu", dtype="float32")
    assert (llm.config.num_expert_group, llm.config.topk_group) == (2, 1)
    ids = torch.randint(0, 256, (63,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(ids[None], use_cache=False).logits[0].float()                   # [T, V]
    got = llm.prompt_logits(ids.tolist())
    error = (got - expected).abs().max().item() / expected.abs().max().item()
    assert error <= LOGIT_RTOL, f"relative max logit error {error:.2e} > {LOGIT_RTOL:.0e}"
    for layer in model.model.layers:                    # the same model routed without groups differs by far more
        layer.mlp.gate.num_group = layer.mlp.gate.topk_group = 1
    with torch.no_grad():
        flat = model(ids[None], use_cache=False).logits[0].float()
    assert (flat - expected).abs().max().item() / expected.abs().max().item() > 100 * LOGIT_RTOL
