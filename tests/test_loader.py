"""Checkpoint loading: three naming schemes, sharding, refusal of pickles, errors that name tensors, MXFP4,
random init, and the checkpoint's tokenizer.

The Kimi-Linear cases build a tiny random transformers `KimiLinearForCausalLM` (an implementation nobody here
wrote), perturb every parameter, save it, load it with k3core and compare each canonical tensor with the HF
module's own parameter. Every comparison is exact (torch.equal): loading float32 into float32 only moves bytes.
"""
from __future__ import annotations

import json
import math
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from k3core.config import ModelConfig
from k3core.model.checkpoint_writer import save_k3_checkpoint
from k3core.model.loader import CheckpointError, load_checkpoint
from k3core.model.mxfp4 import E2M1_MAGNITUDES, dequantize_mxfp4, quantize_mxfp4
from k3core.model.weights import expected_tensors, init_random_weights
from k3core.tokenizer import ByteTokenizer, TokenizerError, load_tokenizer, plain_chat_text

transformers = pytest.importorskip("transformers")


def _hf_model(seed: int, q_lora_rank: int | None = None):
    config = transformers.KimiLinearConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=q_lora_rank,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_experts=4, num_experts_per_token=2,
        num_shared_experts=1, linear_num_heads=2, linear_head_dim=16, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"], bos_token_id=256, eos_token_id=257,
        pad_token_id=258)
    torch.manual_seed(seed)
    model = transformers.KimiLinearForCausalLM(config).float()
    with torch.no_grad():
        for param in model.parameters():   # away from init: zero biases and unit norms would hide swaps
            param.add_(torch.randn_like(param) * 0.1)
    return model


def _hf_tensor(state: dict[str, torch.Tensor], name: str, config: ModelConfig) -> torch.Tensor:
    """The HF in-memory tensor that canonical `name` must equal (transformers' module layout, read independently)."""
    P = config.kda_proj_size
    for i, part in enumerate("qkv"):
        if name.endswith(f"self_attn.{part}_conv1d.weight"):
            return state[name.replace(f"{part}_conv1d", "conv1d")][i * P:(i + 1) * P]
    for moved in ("f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log"):
        if name.endswith(f"self_attn.{moved}"):
            tensor = state[name.replace("self_attn.", "self_attn.forget_gate.")]
            return tensor.reshape(-1) if moved == "A_log" else tensor   # HF keeps A_log as [1, 1, H, 1]
    if name.endswith("mlp.experts.w13"):
        return state[name.replace("w13", "gate_up_proj")]
    if name.endswith("mlp.experts.w2"):
        return state[name.replace("w2", "down_proj")]
    return state[name]


def _check_against_hf(weights: dict[str, torch.Tensor], model, config: ModelConfig) -> None:
    state = model.state_dict()
    assert set(weights) == set(expected_tensors(config))
    for name, tensor in weights.items():
        assert torch.equal(tensor, _hf_tensor(state, name, config)), name


@pytest.fixture(scope="module")
def hf_model():
    return _hf_model(seed=11)


def test_save_pretrained_directory_loads_exactly(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    config = ModelConfig.from_hf(tmp_path)
    weights = load_checkpoint(tmp_path, config, dtype=torch.float32)
    _check_against_hf(weights, hf_model, config)
    assert weights["model.layers.1.self_attn.A_log"].shape == (2,)
    assert weights["model.layers.1.self_attn.dt_bias"].dtype == torch.float32


def test_raw_state_dict_in_memory_names_loads_exactly(hf_model, tmp_path):
    hf_model.config.save_pretrained(tmp_path)
    save_file({k: v.contiguous() for k, v in hf_model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    config = ModelConfig.from_hf(tmp_path)
    _check_against_hf(load_checkpoint(tmp_path, config, dtype=torch.float32), hf_model, config)


def test_sharded_index_loads_only_named_files(tmp_path):
    model = _hf_model(seed=12, q_lora_rank=24)   # also covers the q_a/q_b MLA projection path
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
    # a stray file that the index does not name must not be read (it would be an unexpected tensor)
    save_file({"stray.weight": torch.zeros(3)}, str(tmp_path / "model-stray.safetensors"))
    config = ModelConfig.from_hf(tmp_path)
    assert config.q_lora_rank == 24
    _check_against_hf(load_checkpoint(tmp_path, config, dtype=torch.float32), model, config)


def test_bf16_load_casts_weights_but_keeps_fp32_kinds(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    config = ModelConfig.from_hf(tmp_path)
    weights = load_checkpoint(tmp_path, config, dtype=torch.bfloat16)
    for name, spec in expected_tensors(config).items():
        assert weights[name].dtype == (torch.float32 if spec.kind == "fp32" else torch.bfloat16), name


def _raw_checkpoint(model, directory: Path, edit) -> None:
    model.config.save_pretrained(directory)
    state = {k: v.contiguous().clone() for k, v in model.state_dict().items()}
    edit(state)
    save_file(state, str(directory / "model.safetensors"))


def test_missing_tensor_is_named_with_its_shape(hf_model, tmp_path):
    _raw_checkpoint(hf_model, tmp_path, lambda s: s.pop("model.layers.2.self_attn.b_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing model\.layers\.2\.self_attn\.b_proj\.weight \[2, 64\]"):
        load_checkpoint(tmp_path, ModelConfig.from_hf(tmp_path), dtype=torch.float32)


def test_unexpected_tensor_is_named(hf_model, tmp_path):
    _raw_checkpoint(hf_model, tmp_path, lambda s: s.update({"model.layers.0.self_attn.bogus.weight": torch.ones(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected model\.layers\.0\.self_attn\.bogus\.weight"):
        load_checkpoint(tmp_path, ModelConfig.from_hf(tmp_path), dtype=torch.float32)


def test_misshaped_tensor_names_got_and_expected(hf_model, tmp_path):
    def edit(state):
        state["model.layers.3.self_attn.kv_b_proj.weight"] = torch.zeros(64, 15)
    _raw_checkpoint(hf_model, tmp_path, edit)
    with pytest.raises(CheckpointError, match=r"mis-shaped model\.layers\.3\.self_attn\.kv_b_proj\.weight: "
                                              r"got \[64, 15\], expected \[64, 16\]"):
        load_checkpoint(tmp_path, ModelConfig.from_hf(tmp_path), dtype=torch.float32)


def test_many_problems_are_counted_and_truncated(hf_model, tmp_path):
    def edit(state):
        for name in [n for n in state if n.startswith("model.layers.1.")]:
            del state[name]
    _raw_checkpoint(hf_model, tmp_path, edit)
    with pytest.raises(CheckpointError, match=r"\d+ problem\(s\).*\(and \d+ more\)"):
        load_checkpoint(tmp_path, ModelConfig.from_hf(tmp_path), dtype=torch.float32)


class _Explodes:
    """Unpickling this runs `open(marker, "w")`: proof of execution if the loader ever unpickles."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('executed')",))


@pytest.mark.parametrize("file_name", ["pytorch_model.bin", "model.pt", "weights.pth"])
def test_pickle_checkpoints_are_refused_without_unpickling(tmp_path, file_name):
    marker = tmp_path / "marker"
    (tmp_path / file_name).write_bytes(pickle.dumps(_Explodes(str(marker))))
    config = ModelConfig.preset("k3-tiny")
    for path in (tmp_path, tmp_path / file_name):
        with pytest.raises(CheckpointError, match="safe_serialization=True"):
            load_checkpoint(path, config)
    assert not marker.exists()
    # a pickle beside a safetensors file is ignored, never opened
    save_k3_checkpoint(init_random_weights(config, seed=3), config, tmp_path, mxfp4_experts=False)
    load_checkpoint(tmp_path, config, dtype=torch.float32)
    assert not marker.exists()


@pytest.mark.parametrize("num_shards", [1, 3])
def test_k3_checkpoint_with_mxfp4_experts_round_trips(tmp_path, num_shards):
    config = ModelConfig.preset("k3-tiny")
    weights = init_random_weights(config, seed=5, dtype=torch.bfloat16)
    held = save_k3_checkpoint(weights, config, tmp_path, mxfp4_experts=True, num_shards=num_shards)
    names = _stored_names(tmp_path)
    assert "language_model.model.layers.1.block_sparse_moe.experts.7.w3.weight_packed" in names
    assert "language_model.lm_head.weight" in names
    # the vision tower and projector live in the same checkpoint and are skipped
    _add_file(tmp_path, "vision.safetensors", {"vision_tower.patch.weight": torch.ones(4, 4),
                                               "mm_projector.proj.weight": torch.ones(2, 4)})
    loaded_config = ModelConfig.from_hf(tmp_path)
    # the config.json says mxfp4-pack-quantized, so the experts would be held packed; dequantised here (bf16)
    assert loaded_config == config.replace(name=loaded_config.name, expert_format="mxfp4")
    loaded = load_checkpoint(tmp_path, config, dtype=torch.bfloat16)
    assert set(loaded) == set(expected_tensors(config))
    for name in loaded:
        assert torch.equal(loaded[name], held[name]), name
    # the quantised experts really changed and stayed close: MXFP4 keeps ~1 significant bit, so |err| <= 1/4 of the
    # block scale times 2 (the step between 4 and 6) relative to the block maximum
    w13 = "model.layers.2.mlp.experts.w13"
    assert not torch.equal(held[w13], weights[w13])
    error = (held[w13].float() - weights[w13].float()).abs().max()
    assert error <= weights[w13].float().abs().max() / 3
    # K3 pads A_log to [head_dim]; only the first kda_num_heads entries are loaded
    assert loaded["model.layers.0.self_attn.A_log"].shape == (config.kda_num_heads,)


def _stored_names(directory: Path) -> set[str]:
    from safetensors import safe_open
    names: set[str] = set()
    for file in directory.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            names.update(handle.keys())
    return names


def _add_file(directory: Path, file_name: str, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, str(directory / file_name))
    index_path = directory / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
    else:   # turn the single file into an index so the extra file is part of the checkpoint
        index = {"metadata": {}, "weight_map": {n: "model.safetensors" for n in _stored_names(directory)
                                                if n not in tensors}}
    index["weight_map"].update({n: file_name for n in tensors})
    index_path.write_text(json.dumps(index))


def test_k3_unprefixed_lm_head_and_missing_mxfp4_half(tmp_path):
    config = ModelConfig.preset("k3-tiny")
    save_k3_checkpoint(init_random_weights(config, seed=6), config, tmp_path)
    from safetensors.torch import load_file
    state = load_file(str(tmp_path / "model.safetensors"))
    state["lm_head.weight"] = state.pop("language_model.lm_head.weight")
    save_file(state, str(tmp_path / "model.safetensors"))
    load_checkpoint(tmp_path, config, dtype=torch.float32)
    del state["language_model.model.layers.4.block_sparse_moe.experts.5.w2.weight_scale"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.4\.mlp\.experts\.5\.w2"):
        load_checkpoint(tmp_path, config, dtype=torch.float32)


# ---- MXFP4 ----------------------------------------------------------------------------------------------------

def _mx(packed_rows, scale_rows):
    return dequantize_mxfp4(torch.tensor(packed_rows, dtype=torch.uint8), torch.tensor(scale_rows, dtype=torch.uint8))


def test_mxfp4_nibble_order_sign_and_unit_scale():
    # byte 0x21: low nibble 1 (0.5) is k = 0, high nibble 2 (1.0) is k = 1; 0xF7: 7 -> 6.0, then F -> -6.0;
    # 0x98: 8 is negative zero -> 0, 9 -> -0.5
    packed = [[0x21, 0xF7, 0x98] + [0x00] * 13]
    out = _mx(packed, [[127]])
    assert out.dtype == torch.float32 and out.shape == (1, 32)
    assert out[0, :6].tolist() == [0.5, 1.0, 6.0, -6.0, 0.0, -0.5]
    assert out[0, 6:].eq(0).all()


def test_mxfp4_every_code_and_block_scales():
    codes = list(range(16)) * 4                                        # 64 k: two scale blocks
    packed = [[codes[2 * j] | (codes[2 * j + 1] << 4) for j in range(32)]]
    out = _mx(packed, [[128, 125]])                                    # x2 for k < 32, x1/4 for k >= 32
    table = list(E2M1_MAGNITUDES) + [-m for m in E2M1_MAGNITUDES]
    want = [table[c] * (2.0 if k < 32 else 0.25) for k, c in enumerate(codes)]
    assert out[0].tolist() == want


def test_mxfp4_scale_byte_255_reads_as_254_and_byte_0_is_exact():
    packed = [[0x21] + [0] * 15, [0x21] + [0] * 15]
    out = _mx(packed, [[255], [0]])
    assert out[0, :2].tolist() == [0.5 * 2.0 ** 127, 2.0 ** 127]       # finite: 255 is not NaN
    assert out[1, :2].double().tolist() == [0.5 * 2.0 ** -127, 2.0 ** -127]
    assert torch.equal(_mx(packed[:1], [[255]]), _mx(packed[:1], [[254]]))


def test_mxfp4_leading_expert_dimension():
    weight = torch.randn(3, 5, 64)
    packed, scale = quantize_mxfp4(weight)
    assert packed.shape == (3, 5, 32) and scale.shape == (3, 5, 2)
    assert torch.equal(dequantize_mxfp4(packed, scale)[1], dequantize_mxfp4(packed[1], scale[1]))


def test_mxfp4_quantize_works_in_bounded_chunks_with_the_same_result(monkeypatch):
    """A whole expert stack is quantised in pieces of at most QUANTIZE_CHUNK_ELEMENTS (the nearest-code search
    holds 32 bytes an element: k3-mini's gate/up in one piece needed 21 GiB and failed on an 80 GB GPU), and the
    pieces give the bytes the one-piece search gives, also for a row count the chunk does not divide."""
    from k3core.model import mxfp4
    torch.manual_seed(0)
    weight = torch.randn(3, 7, 256) * torch.logspace(-2, 2, 256)
    whole = quantize_mxfp4(weight)                      # 5376 elements: one piece under the default bound
    seen = []
    real = mxfp4._quantize_rows
    monkeypatch.setattr(mxfp4, "QUANTIZE_CHUNK_ELEMENTS", 1024)
    monkeypatch.setattr(mxfp4, "_quantize_rows", lambda rows: seen.append(rows.numel()) or real(rows))
    chunked = quantize_mxfp4(weight)
    assert max(seen) <= 1024 and sum(seen) == weight.numel() and len(seen) == 6     # 21 rows, 4 a piece
    assert torch.equal(chunked[0], whole[0]) and torch.equal(chunked[1], whole[1])
    assert chunked[0].shape == (3, 7, 128) and chunked[1].shape == (3, 7, 8)
    empty = quantize_mxfp4(torch.zeros(0, 4, 64))
    assert empty[0].shape == (0, 4, 32) and empty[1].shape == (0, 4, 2)


def test_mxfp4_quantize_picks_nearest_representable_value():
    torch.manual_seed(0)
    weight = torch.randn(7, 96, dtype=torch.float64) * torch.logspace(-3, 3, 96, dtype=torch.float64)
    packed, scale = quantize_mxfp4(weight)
    out = dequantize_mxfp4(packed, scale).double()
    # brute force in float64: under each block's chosen scale, no representable value is nearer than the pick
    block_scale = torch.pow(2.0, scale.double() - 127).repeat_interleave(32, dim=-1)      # [7, 96]
    grid = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)
    candidates = torch.cat([grid, -grid]) * block_scale.unsqueeze(-1)                     # [7, 96, 16]
    best = (candidates - weight.unsqueeze(-1)).abs().amin(dim=-1)
    assert torch.equal((out - weight).abs(), best)
    # the shared exponent is the OCP one: the block maximum lands in [4, 8) before rounding
    amax = weight.abs().unflatten(-1, (3, 32)).amax(-1)
    assert ((amax / torch.pow(2.0, scale.double() - 127)).log2().floor() == 2).all()
    # representable values survive a second round trip bit for bit
    again = quantize_mxfp4(out)
    assert torch.equal(again[0], packed) and torch.equal(again[1], scale)


def test_mxfp4_zero_block_and_bad_shapes():
    packed, scale = quantize_mxfp4(torch.zeros(2, 32))
    assert packed.eq(0).all() and dequantize_mxfp4(packed, scale).eq(0).all()
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="does not match"):
        dequantize_mxfp4(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))


# ---- random init ----------------------------------------------------------------------------------------------

def test_init_random_weights_is_deterministic_and_well_scaled():
    config = ModelConfig.preset("k3-tiny")
    first, second = init_random_weights(config, seed=1), init_random_weights(config, seed=1)
    other = init_random_weights(config, seed=2)
    for name, spec in expected_tensors(config).items():
        assert first[name].shape == spec.shape and torch.equal(first[name], second[name]), name
        assert torch.isfinite(first[name]).all(), name
    assert not torch.equal(first["model.norm.weight"], other["model.norm.weight"])
    a_log = first["model.layers.0.self_attn.A_log"].exp()
    assert ((a_log >= 1) & (a_log <= 16)).all()
    dt = torch.nn.functional.softplus(first["model.layers.0.self_attn.dt_bias"])
    assert ((dt > 0.9e-3) & (dt < 1.1e-1)).all()
    proj = first["model.layers.1.self_attn.q_proj.weight"]
    assert abs(proj.std().item() * math.sqrt(config.hidden_size) - 1) < 0.1
    norm = first["model.layers.1.input_layernorm.weight"]
    assert ((norm > 0.89) & (norm < 1.11)).all() and not norm.eq(1).all()


# ---- tokenizer ------------------------------------------------------------------------------------------------


def test_byte_tokenizer_for_presets():
    config = ModelConfig.preset("k3-tiny")
    tokenizer = load_tokenizer("k3-tiny", config)
    assert isinstance(tokenizer, ByteTokenizer)
    text = "héllo, 世界\n"
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tokenizer.decode(ids[:3] + [256, 257] + ids[3:]) == text          # special ids are not text
    assert tokenizer.decode([104, 300, 319, 105]) == "h w300 w319i"           # every other id shows as a word
    assert tokenizer.eos_token_ids == (257,)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert plain_chat_text(messages) == "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"
    assert tokenizer.apply_chat_template(messages) == [256] + list(plain_chat_text(messages).encode())
    small = load_tokenizer("k3-tiny", config.replace(vocab_size=100))   # too small for bytes: token ids only
    assert small.decode([5, 6]) == "" and small.eos_token_ids == (257,)
    with pytest.raises(TokenizerError, match="vocab_size 100 .* pass token ids"):
        small.encode("hi")
    with pytest.raises(TokenizerError, match="needs >= 259"):
        ByteTokenizer(config.replace(vocab_size=100))


def _write_fast_tokenizer(directory: Path, chat_template: str | None) -> None:
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    fast = FastTokenizer(models.BPE(unk_token="<unk>"))
    fast.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    fast.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|bos|>", "<|eos|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    fast.train_from_iterator(["hello world, the quick brown fox"] * 20, trainer=trainer)
    fast.save(str(directory / "tokenizer.json"))
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|eos|>"}
    if chat_template:
        settings["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))


def test_checkpoint_tokenizer_json_and_chat_template(tmp_path):
    template = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}<|im_end|>{% endfor %}"
                "{% if add_generation_prompt %}[assistant]{% endif %}")
    _write_fast_tokenizer(tmp_path, template)
    config = ModelConfig.preset("k3-tiny")
    tokenizer = load_tokenizer(tmp_path, config)
    ids = tokenizer.encode("hello quick fox")
    assert tokenizer.decode(ids) == "hello quick fox" and len(ids) < len("hello quick fox")
    # ids from the tokenizer files (eos 2, generation_config 2 and 3) and from the config (257)
    assert tokenizer.bos_token_id == 1 and set(tokenizer.eos_token_ids) == {2, 3, 257}
    messages = [{"role": "user", "content": "hello"}]
    chat = tokenizer.apply_chat_template(messages)
    assert tokenizer.decode(chat) == "[user]hello[assistant]"          # the checkpoint's template, specials skipped
    assert 3 in chat                                                   # <|im_end|> is one special token


def test_checkpoint_tokenizer_without_template_uses_plain_text(tmp_path):
    _write_fast_tokenizer(tmp_path, None)
    tokenizer = load_tokenizer(tmp_path, ModelConfig.preset("k3-tiny"))
    messages = [{"role": "user", "content": "hello"}]
    assert tokenizer.apply_chat_template(messages) == [1] + tokenizer.encode(plain_chat_text(messages))


def test_tokenizer_needing_remote_code_is_refused(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "TikTokenTokenizer", "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer",
                                                                                None]}}))
    (tmp_path / "tokenization_kimi.py").write_text("raise SystemExit('remote code ran')\n")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        load_tokenizer(tmp_path, ModelConfig.preset("k3-tiny"))
