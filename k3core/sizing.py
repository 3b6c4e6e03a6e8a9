"""Sizes that decide how a model fits: parameters, per-GPU weights, per-token MLA KV, per-request KDA state, and
the MLA context capacity left in a GPU. The memory pool and the parallel planner reuse `StateSizes` and `Capacity`.

`python -m k3core.config --model k3 --tp 8 [--dcp 8] [--gpu-memory 288GB]` prints them.

Placement assumptions (the ones the numbers rest on):
* Weights are spread evenly over the `tp` GPUs of a group (attention and dense weights by TP, routed experts by
  TP or EP over the same GPUs); small replicated tensors (norms) are ignored. Routed experts are MXFP4 (4 bits plus
  one E8M0 byte per 32 values = 4.25 bits) when the checkpoint is, everything else is bf16 and fp32 where the
  weight table says so.
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

from k3core.config import ModelConfig, load_config
from k3core.model.weights import count_parameters, expected_tensors

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


def weight_bytes(config: ModelConfig, expert_format: str = "bf16", dtype: str = "bf16") -> float:
    """Bytes of all weights: routed experts in `expert_format` ("mxfp4" or a dtype), the rest in `dtype`/fp32."""
    total = 0.0
    for name, spec in expected_tensors(config).items():
        numel = math.prod(spec.shape)
        if name.endswith((".mlp.experts.w13", ".mlp.experts.w2")):
            total += numel * (MXFP4_BITS_PER_VALUE / 8 if expert_format == "mxfp4" else DTYPE_BYTES[expert_format])
        else:
            total += numel * DTYPE_BYTES["fp32" if spec.kind == "fp32" else dtype]
    return total


def capacity(config: ModelConfig, gpu_memory_bytes: float, tp: int = 1, dcp: int = 1, mem_fraction: float = 0.9,
             activation_reserve_bytes: float = 8 * 2 ** 30, max_requests: int = 256, expert_format: str = "bf16",
             sizes: StateSizes | None = None) -> Capacity:
    """MLA context capacity per the formula in the module docstring."""
    sizes = sizes or state_sizes(config, tp, dcp)
    weights = weight_bytes(config, expert_format) / tp
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
    if requested != "auto":
        return requested
    quant = config.extra.get("quantization_config") or {}
    # the released K3 ships MXFP4 routed experts; a checkpoint says so in its quantization_config
    return "mxfp4" if "mxfp4" in str(quant).lower() or config.name == "k3" else "bf16"


def _fmt(num_bytes: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if num_bytes >= size:
            return f"{num_bytes / size:.2f} {unit}"
    return f"{num_bytes:.0f} B"


def report(config: ModelConfig, tp: int, dcp: int, gpu_memory: float | None, mem_fraction: float,
           activation_reserve: float, max_requests: int, expert_format: str, kv_dtype: str, state_dtype: str) -> str:
    params = count_parameters(config)
    sizes = state_sizes(config, tp, dcp, kv_dtype=kv_dtype, state_dtype=state_dtype)
    num_kda, num_mla = len(config.kda_layer_ids), len(config.mla_layer_ids)
    heads = config.kda_num_heads // tp if num_kda else 0
    lines = [
        f"model {config.name}: {config.num_layers} layers ({num_kda} KDA, {num_mla} MLA, "
        f"{config.mlp_types.count('moe')} MoE); tp={tp} dcp={dcp}",
        f"parameters: total {params.total / 1e9:.1f}B, active {params.active / 1e9:.1f}B per token",
        f"weights per GPU: {_fmt(weight_bytes(config, expert_format) / tp)} "
        f"(routed experts {expert_format}, the rest bf16/fp32, split over tp={tp})",
        f"MLA KV per token per GPU: {sizes.mla_bytes_per_token:.0f} B ({sizes.mla_bytes_per_token / 1024:.1f} KiB) = "
        f"{num_mla} layers x {config.mla_latent_width} x {DTYPE_BYTES[kv_dtype]} B / dcp {dcp}",
        f"KDA state per request per GPU: {_fmt(sizes.kda_bytes_per_request)} = recurrent "
        f"{_fmt(sizes.kda_state_bytes_per_request)} ({num_kda} x {heads} x {config.kda_head_dim} x "
        f"{config.kda_head_dim} x {DTYPE_BYTES[state_dtype]} B) + conv tail {_fmt(sizes.kda_conv_bytes_per_request)}",
    ]
    if gpu_memory is not None:
        cap = capacity(config, gpu_memory, tp, dcp, mem_fraction, activation_reserve, max_requests, expert_format,
                       sizes=sizes)
        lines.append(
            f"MLA context capacity: {cap.tokens:,} tokens = ({_fmt(gpu_memory)} x {mem_fraction:.2f} - "
            f"{_fmt(cap.weight_bytes_per_gpu)} weights - {_fmt(activation_reserve)} activation reserve - "
            f"{max_requests} x {_fmt(sizes.kda_bytes_per_request)} KDA slots = {_fmt(cap.kv_budget_bytes)}) / "
            f"{sizes.mla_bytes_per_token:.0f} B per token")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m k3core.config",
                                     description="Parameter counts, per-GPU state sizes and MLA context capacity.")
    parser.add_argument("--model", default="k3", help="preset name, YAML file or checkpoint directory")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs (KDA/MLA heads split by it)")
    parser.add_argument("--dcp", type=int, default=1, help="decode-context-parallel ranks (MLA tokens split by it)")
    parser.add_argument("--gpu-memory", type=parse_bytes, default=None, help="per-GPU memory, e.g. 288GB or 141GiB")
    parser.add_argument("--mem-fraction", type=float, default=0.9, help="share of GPU memory k3core may use")
    parser.add_argument("--activation-reserve", type=parse_bytes, default=8 * 2 ** 30,
                        help="scratch kept for the forward pass (default 8GiB)")
    parser.add_argument("--max-requests", type=int, default=256, help="running requests whose KDA slots are reserved")
    parser.add_argument("--expert-format", default="auto", choices=["auto", "mxfp4", "bf16", "fp8"],
                        help="routed-expert storage (auto: mxfp4 for K3 and MXFP4 checkpoints, else bf16)")
    parser.add_argument("--kv-dtype", default="bf16", choices=["bf16", "fp8"])
    parser.add_argument("--state-dtype", default="fp32", choices=["fp32", "bf16"])
    args = parser.parse_args(argv)
    config = load_config(args.model)
    try:
        text = report(config, args.tp, args.dcp, args.gpu_memory, args.mem_fraction, args.activation_reserve,
                      args.max_requests, _expert_format(config, args.expert_format), args.kv_dtype, args.state_dtype)
    except ValueError as exc:
        parser.error(str(exc))
    print(text)
