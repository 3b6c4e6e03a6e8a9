"""Generation through the engine (chunked KDA prefill, recurrent decode, paged MLA) agrees with full forwards."""
from __future__ import annotations

import pytest
import torch

from k3core import LLM, SamplingParams

# Per-step logits vs a fresh full-sequence forward: both float32; the decode path (recurrent KDA, absorbed MLA) sums
# in a different order than the prefill path, so allow float32 rounding of the largest logit, nothing more.
STEP_LOGIT_RTOL = 1e-4


@pytest.fixture(scope="module")
def tiny():
    return LLM("k3-tiny", backend="torch", device="cpu", dtype="float32", seed=3,
               page_size=4, checkpoint_interval=8, chunked_prefill_tokens=16)


def _record_step_logits(llm, monkeypatch):
    """(tokens fed so far, logits) of every sample; the fed tokens are known once the generation is done (an
    overlapped step may feed a token the host has not read yet), so `seen` holds their count until `resolve`."""
    seen = []
    original = llm.engine._sample

    def spy(logits, requests):
        seen.extend((request.num_tokens, logits[row].clone()) for row, request in enumerate(requests))
        return original(logits, requests)

    monkeypatch.setattr(llm.engine, "_sample", spy)
    return seen


@pytest.mark.parametrize("prompt_len", [1, 7, 37])
def test_every_step_matches_prompt_logits(tiny, monkeypatch, prompt_len):
    prompt = torch.randint(0, tiny.config.vocab_size, (prompt_len,),
                           generator=torch.Generator().manual_seed(prompt_len)).tolist()
    seen = _record_step_logits(tiny, monkeypatch)
    out = tiny.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 12
    assert len(seen) == 12
    for count, step_logits in seen:
        tokens_so_far = (prompt + out.token_ids)[:count]
        expected = tiny.prompt_logits(tokens_so_far)[-1]
        error = (step_logits - expected).abs().max().item() / expected.abs().max().item()
        assert error <= STEP_LOGIT_RTOL, f"step at {len(tokens_so_far)} tokens: relative error {error:.2e}"
    assert out.token_ids[0] == int(tiny.prompt_logits(prompt)[-1].argmax())


def test_batch_of_mixed_lengths_equals_one_at_a_time(tiny):
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (1, 5, 19, 40)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    together = [o.token_ids for o in tiny.generate(prompts, params)]
    alone = [tiny.generate([p], params)[0].token_ids for p in prompts]
    assert together == alone


def test_seeded_sampling_is_reproducible(tiny):
    params = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=123, ignore_eos=True)
    first = tiny.generate([[5, 6, 7]], params)[0].token_ids
    second = tiny.generate([[5, 6, 7]], params)[0].token_ids
    assert first == second


def test_bad_prompts_are_refused_clearly(tiny):
    with pytest.raises(ValueError, match="empty"):
        tiny.generate([[]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny.prompt_logits([tiny.config.vocab_size])


def test_k3_format_checkpoint_with_mxfp4_experts_loads_and_generates(tmp_path):
    """A K3 checkpoint (language_model. names, AttnRes, LatentMoE, MXFP4 routed experts) written to disk loads
    through the same path as a real one and generates; its logits equal the network on the weights it holds."""
    from k3core.backend import reference_ops
    from k3core.config import ModelConfig
    from k3core.model.checkpoint_writer import save_k3_checkpoint
    from k3core.model.network import Network
    from k3core.model.weights import init_random_weights

    config = ModelConfig.preset("k3-tiny")
    held = save_k3_checkpoint(init_random_weights(config, seed=21), config, tmp_path, mxfp4_experts=True, num_shards=2)
    llm = LLM(str(tmp_path), backend="torch", device="cpu", dtype="float32")
    assert not llm.is_random and llm.config.attn_res and llm.config.moe_latent_size == config.moe_latent_size
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    expected = Network(config, held, reference_ops())
    from k3core.llm import scratch_forward
    want = expected.forward(*scratch_forward(config, prompt, torch.float32, torch.device("cpu")))
    assert torch.equal(llm.prompt_logits(prompt), want)
    out = llm.generate([prompt], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.token_ids[0] == int(want[-1].argmax())


def test_generate_cli_runs_on_a_preset_and_on_a_saved_kimi_linear_checkpoint(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from k3core.generate import main
    main(["--model", "k3-tiny", "--prompt", "hello", "--max-tokens", "4"])
    assert capsys.readouterr().out.startswith("hello")
    config = transformers.KimiLinearConfig(
        vocab_size=300, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=8, num_experts=4, num_experts_per_token=2, linear_num_heads=2, linear_head_dim=16,
        layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"],
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    transformers.KimiLinearForCausalLM(config).save_pretrained(tmp_path)
    main(["--model", str(tmp_path), "--prompt", "hi", "--max-tokens", "3"])
    assert capsys.readouterr().out.startswith("hi")
