"""Sizes that decide how a model fits: parameters, per-GPU weights, per-token MLA KV, per-request KDA state, and
the MLA context capacity left in a GPU. The memory pool and the parallel planner reuse `StateSizes` and `Capacity`.

`python -m k3core.sizing --model k3 --tp 8 [--dcp 8] [--gpu-memory 288GB]` prints them.

Placement assumptions (the ones the numbers rest on):
* `capacity()` spreads the weights evenly over the `tp` GPUs of a group (attention and dense weights by TP, routed
  experts by TP or EP over the same GPUs). The report and the fit verdict (`per_gpu_weights`) instead shard every
  tensor by the parallel plan's rule, as the engine does: replicated tensors (embeddings, lm_head, router, the
  LatentMoE projections, norms) count in full on every GPU. Routed experts are held as `config.expert_format`
  says: MXFP4 (packed uint8 codes [.., K/2] + one E8M0 byte per 32 values = 4.25 bits) for the K3 release and
  MXFP4 checkpoints, the model dtype otherwise; everything else is bf16, and fp32 where the weight table says so
  and for the router, which the network holds in float32 (`k3core.model.held`). Fused projections are held once,
  KDA's with its zero padding rows (`kda_padding_rows`), counted with attention.
* MLA KV: one [kv_lora_rank + rope] latent per token per MLA layer. TP does not split it (every head reads the
  whole latent); decode context parallelism spreads tokens over `dcp` GPUs (token i on rank i mod dcp), so a GPU
  holds 1/dcp of it.
* KDA state: heads split by TP, so a GPU holds kda_num_heads / tp heads of [head_dim, head_dim] per KDA layer, plus
  the short-conv tail (the last conv_kernel_size - 1 pre-conv q/k/v rows). DCP does not split it.
* Capacity: usable = gpu_memory * mem_fraction - weights/GPU - activation_reserve - max_requests * KDA state/GPU;
  tokens = usable / (MLA bytes per token per GPU). mem_fraction leaves room for the CUDA context, communication
  buffers and fragmentation; the activation reserve holds the forward pass's scratch; KDA slots for
  `max_requests` running requests share the same arena (the unified pool). Tokens are logical context across the
  dcp group.
"""
from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass

from k3core.config import EXPERT_FORMATS, ModelConfig, load_config
from k3core.model.held import held_kind, kda_padding_rows, kda_x_names
from k3core.model.weights import count_parameters, expected_tensors, is_routed_expert

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
MXFP4_BITS_PER_VALUE = 4 + 8 / 32     # an E2M1 code plus a share of the per-32 E8M0 scale byte
_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2 ** 10, "MIB": 2 ** 20,
          "GIB": 2 ** 30, "TIB": 2 ** 40}


@dataclass(frozen=True)
class StateSizes:
    """Per-GPU sequence state of one model under a (tp, dcp) layout, in bytes."""
    mla_bytes_per_token: float          # all MLA layers; averaged over the dcp ranks
    kda_state_bytes_per_request: int    # recurrent matrices of all KDA layers
    kda_conv_bytes_per_request: int     # short-conv tails of all KDA layers

    @property
    def kda_bytes_per_request(self) -> int:
        return self.kda_state_bytes_per_request + self.kda_conv_bytes_per_request


@dataclass(frozen=True)
class Capacity:
    """How much MLA context fits beside weights, reserves and KDA slots on one GPU (all sizes in bytes)."""
    gpu_memory_bytes: float
    mem_fraction: float
    weight_bytes_per_gpu: float
    activation_reserve_bytes: float
    kda_reserve_bytes: float            # max_requests * kda_bytes_per_request
    kv_budget_bytes: float              # what is left for MLA pages (never negative)
    mla_bytes_per_token: float
    tokens: int                         # logical context tokens across the dcp group


def state_sizes(config: ModelConfig, tp: int = 1, dcp: int = 1, kv_dtype: str = "bf16",
                state_dtype: str = "fp32", conv_dtype: str = "bf16") -> StateSizes:
    _check_split(config, tp, dcp)
    num_kda, num_mla = len(config.kda_layer_ids), len(config.mla_layer_ids)
    heads_per_gpu = config.kda_num_heads // tp if num_kda else 0
    conv_channels = 3 * heads_per_gpu * config.kda_head_dim                                  # [q | k | v] per GPU
    return StateSizes(
        mla_bytes_per_token=num_mla * config.mla_latent_width * DTYPE_BYTES[kv_dtype] / dcp,
        kda_state_bytes_per_request=num_kda * heads_per_gpu * config.kda_head_dim ** 2 * DTYPE_BYTES[state_dtype],
        kda_conv_bytes_per_request=num_kda * (config.conv_kernel_size - 1) * conv_channels * DTYPE_BYTES[conv_dtype],
    )


def _check_split(config: ModelConfig, tp: int, dcp: int) -> None:
    if tp < 1 or dcp < 1:
        raise ValueError(f"tp and dcp must be at least 1, got tp={tp} dcp={dcp}")
    if config.kda_layer_ids and config.kda_num_heads % tp:
        raise ValueError(f"tp={tp} does not divide the {config.kda_num_heads} KDA heads; choose a divisor")
    if config.mla_layer_ids and config.mla_num_heads % tp:
        raise ValueError(f"tp={tp} does not divide the {config.mla_num_heads} MLA heads; choose a divisor")


def _tensor_bytes(config: ModelConfig, expert_format: str | None, dtype: str) -> dict[str, tuple[str, float]]:
    """name -> (kind, bytes) of every weight as held: routed experts in `expert_format` (None: the config's;
    "mxfp4", "bf16" = the model dtype, or another dtype such as "fp8"), the rest in `dtype`, fp32 and uint8 kept."""
    held = config if expert_format in (None, config.expert_format) or expert_format not in EXPERT_FORMATS else \
        config.replace(expert_format=expert_format)
    sizes = {}
    for name, spec in expected_tensors(held).items():
        numel = math.prod(spec.shape)
        if is_routed_expert(name) and expert_format is not None and expert_format not in EXPERT_FORMATS:
            sizes[name] = (spec.kind, numel * DTYPE_BYTES[expert_format])
        else:
            kind = held_kind(name, spec)
            sizes[name] = (kind, numel * {"fp32": 4, "uint8": 1}.get(kind, DTYPE_BYTES[dtype]))
    return sizes


def _kda_padding_bytes(config: ModelConfig, tp: int, dtype: str) -> float:
    """Bytes of the zero rows padding each KDA layer's fused x projection on one GPU (tp ranks: the head-split
    projections hold 1/tp of their rows, f_a and g_a all of theirs; `k3core.parallel.plan`)."""
    from k3core.parallel.plan import ParallelPlan
    plan, specs = ParallelPlan(tp=tp), expected_tensors(config)
    names = kda_x_names(config.kda_output_gate == "full_rank")
    total = 0.0
    for prefix in (name.removesuffix("self_attn.f_a_proj.weight") for name in specs
                   if name.endswith("self_attn.f_a_proj.weight")):
        rows = sum(specs[prefix + name].shape[0] // (tp if plan.weight_rule(prefix + name) == "rows" else 1)
                   for name in names)
        total += kda_padding_rows(rows) * specs[prefix + names[0]].shape[1] * DTYPE_BYTES[dtype]
    return total


def weight_bytes(config: ModelConfig, expert_format: str | None = None, dtype: str = "bf16") -> float:
    """Bytes of all weights as the engine holds them: routed experts in `expert_format` (default the config's:
    "mxfp4" packed codes and scales, "bf16" the model dtype `dtype`; "fp8" for estimates), the rest in `dtype`,
    fp32 tensors in fp32, and KDA's fused padding rows."""
    return float(sum(size for _, size in _tensor_bytes(config, expert_format, dtype).values())
                 + _kda_padding_bytes(config, 1, dtype))


@dataclass(frozen=True)
class PerGpuWeights:
    """Weight bytes one GPU holds under a (tp, ep) plan, each tensor sharded by the plan's rule."""
    routed_experts: float
    attention: float              # KDA and MLA projections, convs, gates
    dense_mlp: float              # dense layers and shared experts
    embeddings: float             # embed_tokens and lm_head (replicated)
    other: float                  # router, LatentMoE projections, norms, AttnRes (replicated)

    @property
    def total(self) -> float:
        return self.routed_experts + self.attention + self.dense_mlp + self.embeddings + self.other


def per_gpu_weights(config: ModelConfig, tp: int = 1, ep: int = 1, expert_format: str | None = None,
                    dtype: str = "bf16") -> PerGpuWeights:
    """What one GPU holds: "replicate" tensors in full, TP-split ones / tp, EP-split experts / ep (the rules of
    `k3core.parallel.plan.ParallelPlan.weight_rule`, which `shard_model` applies)."""
    from k3core.parallel.plan import ParallelPlan
    plan = ParallelPlan(tp=tp, ep=ep)
    parts = {"replicate": 1, "experts": ep}
    totals = dict(routed_experts=0.0, attention=0.0, dense_mlp=0.0, embeddings=0.0, other=0.0)
    for name, (_, size) in _tensor_bytes(config, expert_format, dtype).items():
        rule = plan.weight_rule(name)
        share = size / parts.get(rule, tp)
        if is_routed_expert(name):
            totals["routed_experts"] += share
        elif ".self_attn." in name:
            totals["attention"] += share
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            totals["embeddings"] += share
        elif rule != "replicate" and ".mlp." in name:
            totals["dense_mlp"] += share
        else:
            totals["other"] += share
    totals["attention"] += _kda_padding_bytes(config, tp, dtype)
    return PerGpuWeights(**totals)


def capacity(config: ModelConfig, gpu_memory_bytes: float, tp: int = 1, dcp: int = 1, mem_fraction: float = 0.9,
             activation_reserve_bytes: float = 8 * 2 ** 30, max_requests: int = 256, expert_format: str | None = None,
             sizes: StateSizes | None = None, weight_bytes_per_gpu: float | None = None) -> Capacity:
    """MLA context capacity per the formula in the module docstring (weights split evenly over tp unless
    `weight_bytes_per_gpu` is given, e.g. `per_gpu_weights(...).total`)."""
    sizes = sizes or state_sizes(config, tp, dcp)
    weights = weight_bytes(config, expert_format) / tp if weight_bytes_per_gpu is None else weight_bytes_per_gpu
    kda_reserve = max_requests * sizes.kda_bytes_per_request
    budget = max(0.0, gpu_memory_bytes * mem_fraction - weights - activation_reserve_bytes - kda_reserve)
    tokens = int(budget // sizes.mla_bytes_per_token) if sizes.mla_bytes_per_token else 0
    return Capacity(gpu_memory_bytes, mem_fraction, weights, activation_reserve_bytes, kda_reserve, budget,
                    sizes.mla_bytes_per_token, tokens)


def parse_bytes(text: str) -> float:
    """'288GB' -> 288e9, '8GiB' -> 8 * 2**30 (decimal GB/MB, binary GiB/MiB), plain numbers are bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"cannot read {text!r} as a size; write e.g. 288GB or 80GiB")
    return float(match.group(1)) * _UNITS[match.group(2).upper()]


def _expert_format(config: ModelConfig, requested: str) -> str:
    """auto: what the engine will hold (the config's expert_format: mxfp4 for K3 and MXFP4 checkpoints)."""
    return config.expert_format if requested == "auto" else requested


def _fmt(num_bytes: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if num_bytes >= size:
            return f"{num_bytes / size:.2f} {unit}"
    return f"{num_bytes:.0f} B"


def report(config: ModelConfig, tp: int, dcp: int, gpu_memory: float | None, mem_fraction: float,
           activation_reserve: float, max_requests: int, expert_format: str, kv_dtype: str, state_dtype: str,
           ep: int = 1) -> str:
    params = count_parameters(config)
    sizes = state_sizes(config, tp, dcp, kv_dtype=kv_dtype, state_dtype=state_dtype)
    num_kda, num_mla = len(config.kda_layer_ids), len(config.mla_layer_ids)
    heads = config.kda_num_heads // tp if num_kda else 0
    per_gpu = per_gpu_weights(config, tp, ep, expert_format)
    expert_text = "MXFP4 packed: E2M1 codes + E8M0 scales" if expert_format == "mxfp4" else expert_format
    lines = [
        f"model {config.name}: {config.num_layers} layers ({num_kda} KDA, {num_mla} MLA, "
        f"{config.mlp_types.count('moe')} MoE); tp={tp} ep={ep} dcp={dcp}",
        f"parameters: total {params.total / 1e9:.1f}B, active {params.active / 1e9:.1f}B per token",
        f"weights per GPU: {_fmt(per_gpu.total)} = routed experts {_fmt(per_gpu.routed_experts)} ({expert_text}) + "
        f"attention {_fmt(per_gpu.attention)} + dense/shared MLP {_fmt(per_gpu.dense_mlp)} + embeddings/lm_head "
        f"{_fmt(per_gpu.embeddings)} + router/latent/norms {_fmt(per_gpu.other)} (sharded as the plan shards them)",
        f"MLA KV per token per GPU: {sizes.mla_bytes_per_token:.0f} B ({sizes.mla_bytes_per_token / 1024:.1f} KiB) = "
        f"{num_mla} layers x {config.mla_latent_width} x {DTYPE_BYTES[kv_dtype]} B / dcp {dcp}",
        f"KDA state per request per GPU: {_fmt(sizes.kda_bytes_per_request)} = recurrent "
        f"{_fmt(sizes.kda_state_bytes_per_request)} ({num_kda} x {heads} x {config.kda_head_dim} x "
        f"{config.kda_head_dim} x {DTYPE_BYTES[state_dtype]} B) + conv tail {_fmt(sizes.kda_conv_bytes_per_request)}",
    ]
    if gpu_memory is not None:
        cap = capacity(config, gpu_memory, tp, dcp, mem_fraction, activation_reserve, max_requests, expert_format,
                       sizes=sizes, weight_bytes_per_gpu=per_gpu.total)
        needed = per_gpu.total + activation_reserve + cap.kda_reserve_bytes
        verdict = (f"fits on {_fmt(gpu_memory)} GPUs: {_fmt(needed)} of {_fmt(gpu_memory * mem_fraction)} usable "
                   f"per GPU before MLA pages" if cap.kv_budget_bytes > 0 else
                   f"does NOT fit on {_fmt(gpu_memory)} GPUs: {_fmt(needed)} needed per GPU before any MLA page, "
                   f"{_fmt(gpu_memory * mem_fraction)} usable; raise tp/ep, use mxfp4 experts or larger GPUs")
        lines.append(f"plan: {verdict} (weights {_fmt(per_gpu.total)} + activation reserve "
                     f"{_fmt(activation_reserve)} + {max_requests} KDA slots {_fmt(cap.kda_reserve_bytes)})")
        lines.append(
            f"MLA context capacity: {cap.tokens:,} tokens = ({_fmt(gpu_memory)} x {mem_fraction:.2f} - "
            f"{_fmt(cap.weight_bytes_per_gpu)} weights - {_fmt(activation_reserve)} activation reserve - "
            f"{max_requests} x {_fmt(sizes.kda_bytes_per_request)} KDA slots = {_fmt(cap.kv_budget_bytes)}) / "
            f"{sizes.mla_bytes_per_token:.0f} B per token")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m k3core.sizing",
                                     description="Parameter counts, per-GPU state sizes and MLA context capacity.")
    parser.add_argument("--model", default="k3", help="preset name, YAML file or checkpoint directory")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs (KDA/MLA heads split by it)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (routed experts split by it)")
    parser.add_argument("--dcp", type=int, default=1, help="decode-context-parallel ranks (MLA tokens split by it)")
    parser.add_argument("--gpu-memory", type=parse_bytes, default=None, help="per-GPU memory, e.g. 288GB or 141GiB")
    parser.add_argument("--mem-fraction", type=float, default=0.9, help="share of GPU memory k3core may use")
    parser.add_argument("--activation-reserve", type=parse_bytes, default=8 * 2 ** 30,
                        help="scratch kept for the forward pass (default 8GiB)")
    parser.add_argument("--max-requests", type=int, default=256, help="running requests whose KDA slots are reserved")
    parser.add_argument("--expert-format", default="auto", choices=["auto", "mxfp4", "bf16", "fp8"],
                        help="routed-expert storage (auto: what the engine holds: mxfp4 for K3 and MXFP4 "
                             "checkpoints, else bf16)")
    parser.add_argument("--kv-dtype", default="bf16", choices=["bf16", "fp8"])
    parser.add_argument("--state-dtype", default="fp32", choices=["fp32", "bf16"])
    args = parser.parse_args(argv)
    config = load_config(args.model)
    try:
        text = report(config, args.tp, args.dcp, args.gpu_memory, args.mem_fraction, args.activation_reserve,
                      args.max_requests, _expert_format(config, args.expert_format), args.kv_dtype, args.state_dtype,
                      ep=args.ep)
    except ValueError as exc:
        parser.error(str(exc))
    print(text)


if __name__ == "__main__":
    main()
