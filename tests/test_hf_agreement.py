"""Agreement with an implementation nobody here wrote: transformers 5.23's KimiLinearForCausalLM.

Each case builds a small random HF model, perturbs every parameter and buffer away from its initial value (so no
bug hides behind a zero bias or a unit norm weight), saves it with `save_pretrained`, loads the directory with
k3core and compares float32 logits (relative max error 1e-4) and 16-token greedy continuations.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_helpers import perturbed_kimi_linear  # noqa: E402
from k3core import LLM, SamplingParams  # noqa: E402

# Relative max error of float32 logits: both sides run float32 with different summation orders (chunked KDA,
# fused GEMMs); 1e-4 of the largest logit is far above that rounding and far below any real bug.
LOGIT_RTOL = 1e-4


CASES = {
    "no_q_lora": {},
    "q_lora_two_shared_8_layers": dict(
        q_lora_rank=24, num_shared_experts=2, num_hidden_layers=8,
        layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
        mlp_layer_types=["dense"] + ["sparse"] * 7),
    "no_dense_first": dict(mlp_layer_types=["sparse"] * 4, num_experts_per_token=3),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    model = perturbed_kimi_linear(seed=sorted(CASES).index(request.param), **CASES[request.param])
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
