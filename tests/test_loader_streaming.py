"""Loading under a parallel plan: each rank reads only its slices of the checkpoint, straight from the files.

* In one process (no process group needed to load): for many plans and every rank, the streamed tensors equal
  loading the whole checkpoint and applying `shard_model`, bit for bit, for MXFP4 experts held packed and
  dequantised (also when a rank's share of the intermediate splits MXFP4 scale groups).
* Over gloo in two CPU processes (tp=2, and tp=2 ep=2 with MXFP4 experts): each rank's peak resident memory
  during the load grows by less than its own shard plus three times the largest tensor plus slack (the whole
  model is ~23x the largest tensor); each shard file is opened once per rank; the rank holds packed experts, its
  parameter bytes are what `k3core.sizing.per_gpu_weights` says, and its greedy tokens and logits match the
  single-process, dequantised-expert reference within the float32 tolerance of tests/test_parallel.py.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from k3core import LLM, SamplingParams
from k3core.config import ModelConfig
from k3core.model.checkpoint_writer import save_k3_checkpoint
from k3core.model.loader import load_checkpoint
from k3core.model.weights import expected_tensors, init_random_weights
from k3core.parallel.launch import spawn
from k3core.parallel.plan import ParallelPlan
from k3core.parallel.shard import shard_model

LOGIT_RTOL = 1e-4                  # as tests/test_parallel.py: reduction order only
SLACK_BYTES = 8 << 20              # allocator and interpreter noise
PROMPT = [5, 17, 2, 99, 3, 1, 250, 7, 8, 9, 10, 11]
ENGINE = dict(page_size=2, checkpoint_interval=8, chunked_prefill_tokens=64, memory_bytes=32 << 20,
              prefix_cache=False)
NUM_SHARDS = 3


def _big_config() -> ModelConfig:
    """~46 MB of float32 weights whose largest tensor (embedding, lm_head) is 2 MB."""
    return ModelConfig.preset("k3-tiny").replace(
        vocab_size=2048, hidden_size=256, num_layers=16, layer_types=("kda", "kda", "kda", "mla") * 4,
        mlp_types=("dense",) + ("moe",) * 15, intermediate_size=512, kda_num_heads=4, kda_head_dim=64,
        mla_num_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        num_experts=8, moe_intermediate_size=256, moe_latent_size=128, expert_format="mxfp4")


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("big")
    config = _big_config()
    save_k3_checkpoint(init_random_weights(config, seed=4), config, directory, mxfp4_experts=True,
                       num_shards=NUM_SHARDS)
    return directory


@pytest.fixture(scope="module")
def warmup_checkpoint(tmp_path_factory) -> Path:
    """A k3-tiny MXFP4 checkpoint (about 2 MB): a rank loads it first, so that the measured load does not also pay
    the process's first-use costs (lazy imports, torch's first allocations: 7.7 MiB retained, the same for any
    checkpoint; they made the measured growth flaky against the bound). It is far smaller than the model the bound
    guards against: whatever of it is freed and reused cannot hide a whole-model copy (46 MB)."""
    directory = tmp_path_factory.mktemp("warmup")
    config = ModelConfig.preset("k3-tiny").replace(expert_format="mxfp4", moe_intermediate_size=64)
    save_k3_checkpoint(init_random_weights(config, seed=5), config, directory, mxfp4_experts=True, num_shards=2)
    return directory


# ---- in one process: streamed == whole load, then shard_model ------------------------------------------------------

PLANS = {"tp2": ParallelPlan(tp=2), "tp2_ep2": ParallelPlan(tp=2, ep=2), "pp2": ParallelPlan(pp=2),
         "pp2_tp2": ParallelPlan(pp=2, tp=2), "dcp2": ParallelPlan(tp=2, dcp=2), "ep4": ParallelPlan(dcp=4, ep=4)}


def _assert_same(streamed: dict[str, torch.Tensor], sharded: dict[str, torch.Tensor], label: str) -> None:
    assert streamed.keys() == sharded.keys(), label
    for name, tensor in sharded.items():
        assert streamed[name].dtype == tensor.dtype and torch.equal(streamed[name], tensor), f"{label}: {name}"


@pytest.mark.parametrize("expert_format", ["mxfp4", "bf16"])
@pytest.mark.parametrize("plan_name", sorted(PLANS))
def test_streamed_shards_equal_whole_load_then_shard(tmp_path, plan_name, expert_format):
    plan = PLANS[plan_name]
    config = ModelConfig.preset("k3-tiny").replace(expert_format="mxfp4", num_layers=4, moe_intermediate_size=64,
                                                   layer_types=("kda", "kda", "kda", "mla"),
                                                   mlp_types=("dense", "moe", "moe", "moe"))
    save_k3_checkpoint(init_random_weights(config, seed=9), config, tmp_path, mxfp4_experts=True, num_shards=2)
    held = config.replace(expert_format=expert_format)
    whole = load_checkpoint(tmp_path, held, dtype=torch.float32)
    for rank in range(plan.world_size):
        streamed = load_checkpoint(tmp_path, held, dtype=torch.float32, plan=plan, rank=rank)
        _assert_same(streamed, shard_model(held, whole, plan, rank).weights, f"{plan_name} rank {rank}")


def test_dequantised_experts_whose_tp_share_splits_scale_groups(tmp_path):
    """moe_intermediate_size 96 under tp=2: 48 columns per rank straddle the 32-wide MXFP4 scale groups, so the
    rank dequantises whole w2 tensors before cutting its columns; the result must still equal shard_model's."""
    config = ModelConfig.preset("k3-tiny").replace(expert_format="mxfp4", moe_intermediate_size=96, num_layers=2,
                                                   layer_types=("kda", "mla"), mlp_types=("dense", "moe"))
    save_k3_checkpoint(init_random_weights(config, seed=10), config, tmp_path, mxfp4_experts=True)
    held, plan = config.replace(expert_format="bf16"), ParallelPlan(tp=2)
    whole = load_checkpoint(tmp_path, held, dtype=torch.float32)
    for rank in range(2):
        _assert_same(load_checkpoint(tmp_path, held, dtype=torch.float32, plan=plan, rank=rank),
                     shard_model(held, whole, plan, rank).weights, f"rank {rank}")


# ---- over gloo: memory, file opens, packed experts, sizing, logits -------------------------------------------------

def _peak_rss_reset() -> None:
    """Reset VmHWM to the current resident size. Where the kernel refuses, the peak stays the process's own, which
    can only overstate the growth measured from the current size (a false failure, never a false pass)."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        pass


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"/proc/self/status has no {field}")


def _rank_main(rank: int, plan: ParallelPlan, device, directory: str, warmup: str):
    from k3core.model import safetensors_file
    from k3core.sizing import per_gpu_weights
    config = ModelConfig.from_hf(directory)
    opens: list[str] = []
    original_init = safetensors_file.SafetensorsFile.__init__

    def counting_init(self, path):
        opens.append(Path(path).name)
        original_init(self, path)

    safetensors_file.SafetensorsFile.__init__ = counting_init
    try:
        warm = load_checkpoint(warmup, ModelConfig.from_hf(warmup), dtype=torch.float32, plan=plan, rank=rank)
        del warm
        opens.clear()
        _peak_rss_reset()
        before = _status_kib("VmRSS")
        streamed = load_checkpoint(directory, config, dtype=torch.float32, plan=plan, rank=rank)
        growth = (_status_kib("VmHWM") - before) * 1024
        load_opens = list(opens)
    finally:
        safetensors_file.SafetensorsFile.__init__ = original_init
    own = sum(t.numel() * t.element_size() for t in streamed.values())
    streamed_copy = {name: t.clone() for name, t in streamed.items()}
    del streamed
    whole = load_checkpoint(directory, config, dtype=torch.float32)
    sharded = shard_model(config, whole, plan, rank).weights
    same = streamed_copy.keys() == sharded.keys() and all(torch.equal(streamed_copy[n], sharded[n]) for n in sharded)
    del whole, sharded, streamed_copy

    llm = LLM(directory, backend="torch", device=str(device), dtype="float32", plan=plan, rank=rank, **ENGINE)
    packed = {name: t.dtype for name, t in llm.weights.items() if ".mlp.experts." in name}
    held_bytes = sum(t.numel() * t.element_size() for t in llm.weights.values()) + llm.network.padding_bytes
    sized = per_gpu_weights(config, tp=plan.tp, ep=plan.ep, dtype="fp32").total
    seen = []
    original = llm.engine._sample

    def spy(logits, requests):
        if logits is not None:
            seen.append(logits[0].clone())
        return original(logits, requests)

    llm.engine._sample = spy
    tokens = llm.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0].token_ids
    return dict(growth=growth, own=own, opens=load_opens, same=same, packed=packed, held_bytes=held_bytes,
                sized=sized, tokens=tokens, logits=torch.stack(seen))


@pytest.fixture(scope="module")
def reference(big_checkpoint):
    """One process, the MXFP4 experts dequantised to float32: the same values the packed kernels compute with."""
    llm = LLM(str(big_checkpoint), backend="torch", device="cpu", dtype="float32", expert_format="bf16", **ENGINE)
    seen = []
    original = llm.engine._sample

    def spy(logits, requests):
        seen.append(logits[0].clone())
        return original(logits, requests)

    llm.engine._sample = spy
    tokens = llm.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0].token_ids
    return tokens, torch.stack(seen)


@pytest.mark.parametrize("plan", [ParallelPlan(tp=2), ParallelPlan(tp=2, ep=2)], ids=["tp2", "tp2_ep2"])
def test_rank_load_memory_opens_sizing_and_logits(big_checkpoint, warmup_checkpoint, reference, plan):
    config = _big_config()
    sizes = {n: math.prod(s.shape) * (1 if s.kind == "uint8" else 4)
             for n, s in expected_tensors(config).items()}
    largest, total = max(sizes.values()), sum(sizes.values())
    assert total > 20 * largest                       # the bound below is about tensors, not the model
    shard_files = sorted(p.name for p in big_checkpoint.glob("*.safetensors"))
    assert len(shard_files) == NUM_SHARDS
    ref_tokens, ref_logits = reference
    for rank, got in enumerate(spawn(_rank_main, plan, args=(str(big_checkpoint), str(warmup_checkpoint)))):
        bound = got["own"] + 3 * largest + SLACK_BYTES
        assert got["growth"] < bound, (f"rank {rank}: peak RSS grew {got['growth'] / 2**20:.1f} MiB while loading, "
                                       f"over own shard {got['own'] / 2**20:.1f} MiB + 3 x largest + slack")
        assert got["own"] < total * 0.75, f"rank {rank} holds {got['own']} of {total} bytes"
        assert sorted(got["opens"]) == shard_files, f"rank {rank} opened {got['opens']}"
        assert got["same"], f"rank {rank}: streamed tensors differ from whole load + shard_model"
        assert got["packed"] and all(d == torch.uint8 for d in got["packed"].values()), got["packed"]
        assert got["held_bytes"] == got["sized"], f"rank {rank}: holds {got['held_bytes']}, sizing says {got['sized']}"
        assert got["tokens"] == ref_tokens, f"rank {rank} generated other tokens"
        error = (got["logits"] - ref_logits).abs().max().item() / ref_logits.abs().max().item()
        assert error <= LOGIT_RTOL, f"rank {rank}: relative logit error {error:.2e}"


@pytest.mark.parametrize("layout, expert_format", [("save_pretrained", "bf16"), ("raw_state_dict", "mxfp4")])
def test_streamed_kimi_linear_layouts_equal_whole_load_then_shard(tmp_path, layout, expert_format):
    """The other naming schemes: per-expert tensors and [1, 1, H, 1] A_log (save_pretrained), and the fused q/k/v
    conv with stacked gate_up_proj/down_proj experts (a raw state_dict), held dense or quantised to MXFP4 on load."""
    from safetensors.torch import save_file

    from hf_helpers import perturbed_kimi_linear
    model = perturbed_kimi_linear(seed=21, moe_intermediate_size=64, linear_num_heads=4)
    if layout == "save_pretrained":
        model.save_pretrained(tmp_path)
    else:
        model.config.save_pretrained(tmp_path)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    config = ModelConfig.from_hf(tmp_path).replace(expert_format=expert_format)
    whole = load_checkpoint(tmp_path, config, dtype=torch.float32)
    for plan in (ParallelPlan(tp=2), ParallelPlan(tp=2, ep=2), ParallelPlan(pp=2, tp=2)):
        for rank in range(plan.world_size):
            _assert_same(load_checkpoint(tmp_path, config, dtype=torch.float32, plan=plan, rank=rank),
                         shard_model(config, whole, plan, rank).weights, f"{layout} {plan} rank {rank}")
