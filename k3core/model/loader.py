"""Load a safetensors checkpoint into canonical weights (`k3core.model.weights.expected_tensors`).

Only safetensors are read: pickle checkpoints (.bin/.pt/.pth) can run arbitrary code when opened, so they are
refused with the way to convert them. Three naming schemes map to the canonical names:

(a) the Kimi-Linear release (and what transformers `save_pretrained` writes): `block_sparse_moe.*`, per-expert
    `experts.{e}.{w1,w2,w3}.weight`, `A_log` as [1, 1, H, 1];
(b) transformers' in-memory names (a raw `state_dict` saved with safetensors): `self_attn.forget_gate.*`, the q/k/v
    convs fused as `self_attn.conv1d.weight` [3P, 1, Kc], experts stacked as `gate_up_proj` [E, 2I, H] and
    `down_proj` [E, H, I];
(c) Kimi-K3: a `language_model.` prefix, AttnRes and LatentMoE tensors, `A_log` padded to [head_dim] (the first
    kda_num_heads entries are the per-head values), MXFP4 routed experts (`weight_packed` + `weight_scale`);
    vision tower and projector tensors are ignored.

Routed experts are held in `config.expert_format`: with "mxfp4" the packed bytes are kept as stored (a bf16
checkpoint's experts are quantised here), with "bf16" an MXFP4 checkpoint's experts are dequantised.

Every expected tensor must be found with the right shape: missing, unexpected and mis-shaped tensors are collected
and reported together, and nothing is ever left random.
"""
from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import torch

from k3core.config import ModelConfig
from k3core.model.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from k3core.model.weights import TensorSpec, expected_tensors, is_routed_expert

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
IGNORED_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.")
MAX_REPORTED_PROBLEMS = 5
_PROGRESS_MIN_TENSORS = 2000   # a bar for a handful of tensors is noise

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(w[123])\.(weight|weight_packed|weight_scale)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be loaded for `config`; the message names the tensors or files at fault."""


def _convert_hint(path: Path) -> str:
    return (f"{path} is a pickle checkpoint, which k3core never opens because unpickling can run arbitrary code; "
            "convert it in a trusted environment with transformers (`AutoModelForCausalLM.from_pretrained(...)"
            ".save_pretrained(out_dir, safe_serialization=True)`) and load the safetensors directory instead")


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the one file, or the files its index names (sorted, each once)."""
    path = Path(path)
    if path.is_file():
        if path.suffix in PICKLE_SUFFIXES:
            raise CheckpointError(_convert_hint(path))
        if path.name == SAFETENSORS_INDEX:
            path = path.parent
        elif path.suffix == ".safetensors":
            return [path]
        else:
            raise CheckpointError(f"{path} is not a safetensors file or index; pass a checkpoint directory")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint path {path} does not exist")
    index = path / SAFETENSORS_INDEX
    if index.exists():
        with open(index) as handle:
            weight_map = json.load(handle).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no `weight_map`; rewrite it with save_pretrained")
        files = [path / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.exists()]
        if absent:
            raise CheckpointError(f"{index} names {len(absent)} missing file(s), first {absent[0]}; "
                                  "download the complete checkpoint")
        return files
    if (path / SAFETENSORS_FILE).exists():
        return [path / SAFETENSORS_FILE]
    pickles = sorted(p for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(_convert_hint(pickles[0]))
    raise CheckpointError(f"{path} has neither {SAFETENSORS_FILE} nor {SAFETENSORS_INDEX}")


# ---- name mapping ---------------------------------------------------------------------------------------------

class Route(NamedTuple):
    """Where one stored tensor goes. kind: "direct", "a_log", "conv_qkv" (split in three), "expert", "ignore"."""
    kind: str
    target: str = ""          # canonical name (for "expert": the experts prefix, e.g. model.layers.3.mlp.experts)
    expert: int = -1
    part: str = ""            # w1 | w2 | w3
    field: str = ""           # weight | weight_packed | weight_scale


def normalize_name(name: str) -> str | None:
    """Stored name -> canonical spelling before shape handling; None for tensors k3core does not use."""
    if name.startswith("language_model."):
        name = name[len("language_model."):]
        if name.startswith("layers."):               # the K3 wrapper may drop the inner `model.`
            name = "model." + name
    if name.startswith(IGNORED_PREFIXES) or ".rotary_emb." in name:
        return None
    name = name.replace(".block_sparse_moe.", ".mlp.")
    name = name.replace(".self_attn.forget_gate.", ".self_attn.")
    for site in ("self_attention_res", "mlp_res"):   # a legacy AttnRes spelling
        name = name.replace(f".{site}.proj_weight", f".{site}_proj.weight")
        name = name.replace(f".{site}.norm_weight", f".{site}_norm.weight")
    return name


def route(stored_name: str, config: ModelConfig, expected: dict[str, TensorSpec]) -> Route | None:
    """Route of a stored tensor, or None when it matches no canonical tensor (an unexpected tensor)."""
    name = normalize_name(stored_name)
    if name is None:
        return Route("ignore")
    layer = _LAYER.match(name)
    if layer and int(layer.group(1)) >= config.num_layers:
        # multi-token-prediction layers follow the trunk; k3core does not run them
        mtp_layers = int(config.extra.get("num_nextn_predict_layers", 0))
        return Route("ignore") if int(layer.group(1)) < config.num_layers + mtp_layers else None
    if name.endswith(".self_attn.conv1d.weight"):
        prefix = name[: -len("conv1d.weight")]
        return Route("conv_qkv", prefix) if prefix + "q_conv1d.weight" in expected else None
    if name.endswith(".mlp.experts.gate_up_proj"):
        name = name[: -len("gate_up_proj")] + "w13"
    elif name.endswith(".mlp.experts.down_proj"):
        name = name[: -len("down_proj")] + "w2"
    if name.endswith((".mlp.experts.w13", ".mlp.experts.w2")) and name + "_packed" in expected:
        return Route("quantize", name)                  # stacked dense experts held as MXFP4
    expert = _EXPERT.match(name)
    if expert:
        prefix, index, part, field = expert.groups()
        if (prefix + ".w13" not in expected and prefix + ".w13_packed" not in expected) or \
                int(index) >= config.num_experts:
            return None
        return Route("expert", prefix, int(index), part, field)
    if name not in expected:
        return None
    return Route("a_log" if name.endswith(".self_attn.A_log") else "direct", name)


# ---- loading --------------------------------------------------------------------------------------------------

@dataclass
class _Problems:
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    misshaped: list[str] = field(default_factory=list)

    def raise_if_any(self, path: Path) -> None:
        lines = ([f"missing {m}" for m in self.missing] + [f"unexpected {u}" for u in self.unexpected]
                 + [f"mis-shaped {s}" for s in self.misshaped])
        if lines:
            shown = "; ".join(lines[:MAX_REPORTED_PROBLEMS])
            more = f" (and {len(lines) - MAX_REPORTED_PROBLEMS} more)" if len(lines) > MAX_REPORTED_PROBLEMS else ""
            raise CheckpointError(f"checkpoint {path} does not match the model config: {len(lines)} problem(s): "
                                  f"{shown}{more}; check that config.json belongs to these weights")


def _shape_text(shape: tuple[int, ...] | torch.Size) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


class _ExpertSlots:
    """Fills the stacked experts of one MoE layer (dense w13/w2, or their MXFP4 packed + scale tensors) from
    per-expert tensors (plain or MXFP4 pairs), converting between the formats where the checkpoint's differs."""

    def __init__(self, config: ModelConfig) -> None:
        self.inner, self.width = config.moe_intermediate_size, config.expert_width
        self.packed = config.expert_format == "mxfp4"
        self.filled: dict[str, set[tuple[int, str]]] = {}
        self.pending: dict[tuple[str, int, str], dict[str, torch.Tensor]] = {}   # MXFP4 halves awaiting their pair

    def expected_shape(self, part: str, field: str) -> tuple[int, ...]:
        rows, cols = (self.width, self.inner) if part == "w2" else (self.inner, self.width)
        return {"weight": (rows, cols), "weight_packed": (rows, cols // 2), "weight_scale": (rows, cols // 32)}[field]

    def take(self, r: Route, tensor: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """(expert, part) once complete, in the held format: (dense float weight,) or (packed, scale); None while
        half of an MXFP4 pair waits for the other."""
        if r.field == "weight":
            return quantize_mxfp4(tensor) if self.packed else (tensor,)
        key = (r.target, r.expert, r.part)
        halves = self.pending.setdefault(key, {})
        halves[r.field] = tensor
        if len(halves) < 2:
            return None
        del self.pending[key]
        packed, scale = halves["weight_packed"], halves["weight_scale"]
        return (packed, scale) if self.packed else (dequantize_mxfp4(packed, scale),)   # float32 [rows, cols]

    def place(self, weights: dict[str, torch.Tensor], r: Route, parts: tuple[torch.Tensor, ...]) -> None:
        inner = self.inner
        fields = ("_packed", "_scale") if self.packed else ("",)
        for suffix, value in zip(fields, parts):
            if r.part == "w2":
                weights[r.target + ".w2" + suffix][r.expert].copy_(value)  # [De, I(/2 or /32)]
            else:
                rows = slice(0, inner) if r.part == "w1" else slice(inner, 2 * inner)  # w13: gate rows, then up rows
                weights[r.target + ".w13" + suffix][r.expert, rows].copy_(value)       # [I, De(/2 or /32)]
        self.filled.setdefault(r.target, set()).add((r.expert, r.part))

    def stacked_names(self, prefix: str) -> tuple[str, ...]:
        fields = ("w13_packed", "w13_scale", "w2_packed", "w2_scale") if self.packed else ("w13", "w2")
        return tuple(f"{prefix}.{field}" for field in fields)

    def missing(self, prefix: str, num_experts: int) -> list[str]:
        have = self.filled.get(prefix, set())
        return [f"{prefix}.{e}.{part}" for e in range(num_experts) for part in ("w1", "w3", "w2")
                if (e, part) not in have]


def _iter_tensors(files: list[Path]) -> Iterator[tuple[str, Any]]:
    """(stored name, open safetensors handle) for every tensor; tensors are read only when asked for."""
    from safetensors import safe_open
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle


def _progress(total: int, desc: str):
    from tqdm import tqdm  # lazy: only loading needs it
    return tqdm(total=total, desc=desc, unit="tensor",
                disable=total < _PROGRESS_MIN_TENSORS or not sys.stderr.isatty())


def load_checkpoint(path: str | Path, config: ModelConfig, dtype: torch.dtype = torch.bfloat16,
                    device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Canonical name -> tensor on `device`; "weight" tensors in `dtype`, "fp32" tensors in float32."""
    files = checkpoint_files(path)
    expected = expected_tensors(config)
    fused_experts = {name for name in expected if is_routed_expert(name)}
    weights: dict[str, torch.Tensor] = {}
    loaded: set[str] = set()
    problems = _Problems()
    experts = _ExpertSlots(config)

    def target_dtype(name: str) -> torch.dtype:
        return {"fp32": torch.float32, "uint8": torch.uint8}.get(expected[name].kind, dtype)

    def store(name: str, tensor: torch.Tensor, stored_name: str) -> None:
        spec = expected[name]
        label = name if stored_name == name else f"{stored_name} (as {name})"
        if tuple(tensor.shape) != spec.shape:
            problems.misshaped.append(f"{label}: got {_shape_text(tensor.shape)}, expected {_shape_text(spec.shape)}")
            return
        if name in loaded:
            problems.unexpected.append(f"{label}: a second tensor for the same weight")
            return
        weights[name] = tensor.to(device=device, dtype=target_dtype(name))
        loaded.add(name)

    with _progress(sum(1 for _ in _iter_tensors(files)), "loading weights") as bar:
        for stored_name, handle in _iter_tensors(files):
            bar.update(1)
            r = route(stored_name, config, expected)
            if r is None:
                problems.unexpected.append(stored_name)
                continue
            if r.kind == "ignore":
                continue
            tensor = handle.get_tensor(stored_name)
            if r.kind == "direct":
                store(r.target, tensor, stored_name)
            elif r.kind == "a_log":
                store(r.target, _per_head_a_log(tensor, config), stored_name)
            elif r.kind == "conv_qkv":
                _split_conv(stored_name, r.target, tensor, config, store, problems)
            elif r.kind == "quantize":
                _store_quantized(stored_name, r.target, tensor, expected, store, problems)
            else:
                _load_expert(stored_name, r, tensor, experts, weights, expected, device, dtype, problems)
    for name, spec in expected.items():
        # stacked experts built from per-expert tensors are checked expert by expert below
        if name in loaded or (name in fused_experts and name.rsplit(".", 1)[0] in experts.filled):
            continue
        problems.missing.append(f"{name} {_shape_text(spec.shape)}")
    for prefix in sorted(experts.filled):
        problems.missing.extend(experts.missing(prefix, config.num_experts))
    problems.missing.extend(f"{k[0]}.{k[1]}.{k[2]} (the other half of an MXFP4 pair)" for k in experts.pending)
    problems.raise_if_any(Path(path))
    return {name: weights[name] for name in expected}


def _per_head_a_log(tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """A_log [H], [1, 1, H, 1] (Kimi-Linear) or [head_dim] padded (K3: the first H entries are the heads)."""
    heads = config.kda_num_heads
    if tensor.dim() == 4 and tensor.shape[0] == tensor.shape[1] == tensor.shape[3] == 1:
        tensor = tensor.reshape(-1)
    if tensor.dim() == 1 and tensor.shape[0] == max(heads, config.kda_head_dim) != heads:
        tensor = tensor[:heads]
    return tensor   # a remaining wrong shape is reported by store()


def _split_conv(stored_name: str, prefix: str, tensor: torch.Tensor, config: ModelConfig,
                store: Callable[[str, torch.Tensor, str], None], problems: _Problems) -> None:
    """transformers' fused [3P, 1, Kc] conv weight -> q/k/v [P, 1, Kc] (concatenated in q, k, v order)."""
    P, kernel = config.kda_proj_size, config.conv_kernel_size
    if tuple(tensor.shape) != (3 * P, 1, kernel):
        problems.misshaped.append(f"{stored_name}: got {_shape_text(tensor.shape)}, "
                                  f"expected {_shape_text((3 * P, 1, kernel))}")
        return
    for part, chunk in zip("qkv", tensor.split(P, dim=0)):
        store(f"{prefix}{part}_conv1d.weight", chunk, stored_name)


def _load_expert(stored_name: str, r: Route, tensor: torch.Tensor, experts: _ExpertSlots,
                 weights: dict[str, torch.Tensor], expected: dict[str, TensorSpec], device: str | torch.device,
                 dtype: torch.dtype,
                 problems: _Problems) -> None:
    want = experts.expected_shape(r.part, r.field)
    if tuple(tensor.shape) != want:
        problems.misshaped.append(f"{stored_name}: got {_shape_text(tensor.shape)}, expected {_shape_text(want)}")
        return
    if r.field != "weight" and tensor.dtype != torch.uint8:
        problems.misshaped.append(f"{stored_name}: MXFP4 tensors must be uint8, got {tensor.dtype}")
        return
    parts = experts.take(r, tensor)
    if parts is None:
        return
    for name in experts.stacked_names(r.target):
        if name not in weights:
            # NaN (or 0xFF bytes) until filled: a slot the checkpoint never writes is reported as missing, never used
            held = torch.uint8 if expected[name].kind == "uint8" else dtype
            weights[name] = torch.full(expected[name].shape, 255 if held == torch.uint8 else float("nan"), dtype=held,
                                       device=device)
    experts.place(weights, r, tuple(part.to(device) for part in parts))


def _store_quantized(stored_name: str, name: str, tensor: torch.Tensor, expected: dict[str, TensorSpec],
                     store: Callable[[str, torch.Tensor, str], None], problems: _Problems) -> None:
    """Stacked dense experts [E, N, K] (transformers' names) held as MXFP4: quantised, then stored as the pair."""
    packed_shape = expected[name + "_packed"].shape
    want = (*packed_shape[:-1], packed_shape[-1] * 2)
    if tuple(tensor.shape) != want:
        problems.misshaped.append(f"{stored_name}: got {_shape_text(tensor.shape)}, expected {_shape_text(want)}")
        return
    packed, scale = quantize_mxfp4(tensor)
    store(name + "_packed", packed, stored_name)
    store(name + "_scale", scale, stored_name)
