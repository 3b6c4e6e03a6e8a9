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

Every expected tensor must be found with the right shape and dtype: the headers of all files are checked against
the config first (k3core.model.validate), missing, unexpected, mis-shaped and mis-typed tensors are reported
together, and only then is any tensor read, so a config that disagrees with its weights allocates nothing. Files
are read by k3core.model.safetensors_file (the header checked, nothing executed); an index may name only files
inside the checkpoint directory. Float tensors are checked for NaN/Inf where they land (`check_finite`, on by
default: one pass over bytes just read costs little beside reading them, and a NaN weight would be served as
garbage without it).

Under a parallel plan (`plan`, `rank`) the loader reads only what the rank holds (k3core.parallel.shard.RankShare):
its layers, its experts, and the TP slice of each tensor, straight from the files, opening each file once; the
result equals loading everything and applying `shard_model`, bit for bit.
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from k3core.config import ModelConfig
from k3core.model.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from k3core.model.safetensors_file import CheckpointError, SafetensorsFile
from k3core.model.validate import Stored, inventory
from k3core.model.weights import TensorSpec, expected_tensors

if TYPE_CHECKING:
    from k3core.parallel.plan import ParallelPlan
    from k3core.parallel.shard import Index, RankShare

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
IGNORED_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.")
_PROGRESS_MIN_TENSORS = 2000   # a bar for a handful of tensors is noise

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(w[123])\.(weight|weight_packed|weight_scale)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


__all__ = ["CheckpointError", "checkpoint_files", "load_checkpoint", "route"]
_FINITE_CHUNK = 1 << 24                   # elements checked at a time: bounds the check's scratch


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
        return [_inside(path, path / name, index) for name in sorted(set(_weight_map(index).values()))]
    if (path / SAFETENSORS_FILE).exists():
        return [_inside(path, path / SAFETENSORS_FILE, path / SAFETENSORS_FILE)]
    pickles = sorted(p for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(_convert_hint(pickles[0]))
    raise CheckpointError(f"{path} has neither {SAFETENSORS_FILE} nor {SAFETENSORS_INDEX}; pass a directory "
                          "that holds the safetensors weights")


def _weight_map(index: Path) -> dict[str, str]:
    try:
        with open(index, "rb") as handle:
            data = json.loads(handle.read().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{index} is not readable JSON ({str(exc).splitlines()[0]}); re-download it") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index} has no `weight_map`; rewrite it with save_pretrained")
    for tensor, file_name in weight_map.items():
        if not isinstance(file_name, str) or not file_name or os.path.isabs(file_name) or \
                ".." in Path(file_name).parts or "\\" in file_name:
            raise CheckpointError(f"{index} maps tensor {tensor} to {file_name!r}, which is not a file name inside "
                                  "the checkpoint directory; an index may name only files next to it")
    return weight_map


def _inside(root: Path, file: Path, named_by: Path) -> Path:
    """`file`, once it is known to exist and to resolve inside `root` (or, for a Hugging Face cache snapshot
    `<repo>/snapshots/<rev>/`, inside that repo's `blobs/`, where the hub's own symlinks point)."""
    if not file.exists():
        what = "names a missing file" if named_by != file else "is a dangling link"
        raise CheckpointError(f"{named_by} {what}, {file.name}; download the complete checkpoint")
    real, base = file.resolve(), root.resolve()
    blobs = base.parent.parent / "blobs" if base.parent.name == "snapshots" else None
    if not (real.is_relative_to(base) or (blobs is not None and real.is_relative_to(blobs))):
        raise CheckpointError(f"{file} resolves to {real}, outside the checkpoint directory {base}; copy the file "
                              "into the directory instead of linking to it")
    if not real.is_file():
        raise CheckpointError(f"{file} is not a regular file; put the safetensors file itself there")
    return file


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

def _progress(total: int, desc: str):
    from tqdm import tqdm  # lazy: only loading needs it
    return tqdm(total=total, desc=desc, unit="tensor",
                disable=total < _PROGRESS_MIN_TENSORS or not sys.stderr.isatty())


def load_checkpoint(path: str | Path, config: ModelConfig, dtype: torch.dtype = torch.bfloat16,
                    device: str | torch.device = "cpu", plan: "ParallelPlan | None" = None, rank: int = 0,
                    check_finite: bool = True) -> dict[str, torch.Tensor]:
    """Canonical name -> tensor on `device`; "weight" tensors in `dtype`, "fp32" tensors in float32.

    With a multi-rank `plan`, only rank `rank`'s tensors, already sharded (what `shard_model` would give it)."""
    from k3core.parallel.shard import RankShare
    share = RankShare(config, plan, rank) if plan is not None and not plan.is_single else None
    files: list[SafetensorsFile] = []
    try:
        for file in checkpoint_files(path):
            files.append(SafetensorsFile(file))
        stored = inventory(Path(path), files, config)          # every header checked before any byte is read
        reader = _Reader(config, dtype, torch.device(device), share, check_finite)
        with _progress(len(stored), "loading weights") as bar:
            for item in stored:
                reader.take(item)
                bar.update(1)
        return reader.result()
    finally:
        for file in files:
            file.close()


def _per_head_a_log(tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """A_log [H], [1, 1, H, 1] (Kimi-Linear) or [head_dim] padded (K3: the first H entries are the heads)."""
    heads = config.kda_num_heads
    if tensor.dim() == 4 and tensor.shape[0] == tensor.shape[1] == tensor.shape[3] == 1:
        tensor = tensor.reshape(-1)
    if tensor.dim() == 1 and tensor.shape[0] == max(heads, config.kda_head_dim) != heads:
        tensor = tensor[:heads]
    return tensor


class _Reader:
    """Reads the checked tensors (only the rank's slices under a plan) into canonical weights."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device, share: "RankShare | None",
                 check_finite: bool) -> None:
        self.config, self.dtype, self.device, self.share = config, dtype, device, share
        self.check_finite = check_finite
        self.expected = expected_tensors(config)
        self.weights: dict[str, torch.Tensor] = {}
        self.pending: dict[tuple[str, int, str], dict[str, torch.Tensor]] = {}   # MXFP4 halves awaiting a pair
        self.packed = config.expert_format == "mxfp4"
        tp = share.plan.tp if share is not None and share.plan.ep == 1 else 1
        self.expert_tp = tp                                         # TP split of each expert's intermediate
        self.tp_rank = share.tp_rank if share is not None else 0
        self.experts = share.experts if share is not None else range(config.num_experts)

    # ---- helpers -----------------------------------------------------------------------------------------------
    def owns(self, name: str) -> bool:
        return self.share is None or self.share.owns(name)

    def pieces(self, name: str, shape: tuple[int, ...]) -> tuple[list["Index"], int]:
        return self.share.pieces(name, shape) if self.share is not None else ([()], 0)

    def read(self, item: Stored, indices: list["Index"], dim: int) -> torch.Tensor:
        parts = [item.file.read(item.name, index) for index in indices]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)

    def finite(self, tensor: torch.Tensor, item: Stored) -> torch.Tensor:
        """`tensor`, once no NaN or Inf is in it (when checking); run where the tensor is (on the GPU, for most)."""
        if self.check_finite and tensor.is_floating_point():
            flat = tensor.reshape(-1)
            for start in range(0, flat.numel(), _FINITE_CHUNK):
                if not torch.isfinite(flat[start:start + _FINITE_CHUNK]).all():
                    raise CheckpointError(f"{item.file.path} holds NaN or Inf values in tensor {item.name} (or "
                                          f"values that overflow {tensor.dtype}); re-download the checkpoint, or load "
                                          "with check_finite=False")
        return tensor

    def held_dtype(self, name: str) -> torch.dtype:
        return {"fp32": torch.float32, "uint8": torch.uint8}.get(self.expected[name].kind, self.dtype)

    def store(self, name: str, tensor: torch.Tensor, item: Stored) -> None:
        self.weights[name] = self.finite(tensor.to(device=self.device, dtype=self.held_dtype(name)), item)

    def result(self) -> dict[str, torch.Tensor]:
        names = [n for n in self.expected if self.owns(n)]
        absent = [n for n in names if n not in self.weights]
        if absent:   # the inventory found every tensor, so this is a loader bug, not a checkpoint problem
            raise AssertionError(f"loader left {absent[0]} unread")
        return {name: self.weights[name] for name in names}

    # ---- routes ------------------------------------------------------------------------------------------------
    def take(self, item: Stored) -> None:
        r, config = item.route, self.config
        if r.kind == "direct":
            if self.owns(r.target):
                self.store(r.target, self.read(item, *self.pieces(r.target, item.info.shape)), item)
        elif r.kind == "a_log":
            if self.owns(r.target):
                self.store(r.target, self.shard(r.target, _per_head_a_log(self.read(item, [()], 0), config)), item)
        elif r.kind == "conv_qkv":
            if self.owns(r.target + "q_conv1d.weight"):
                for part, chunk in zip("qkv", self.read(item, [()], 0).split(config.kda_proj_size, dim=0)):
                    name = f"{r.target}{part}_conv1d.weight"
                    self.store(name, self.shard(name, chunk), item)
        elif r.kind == "quantize":
            if self.owns(r.target + "_packed"):   # stacked dense experts [E, N, K] held as MXFP4
                dense = self.finite(self.read(item, *self.pieces(r.target + "_packed", item.info.shape)), item)
                packed, scale = quantize_mxfp4(dense)
                self.store(r.target + "_packed", packed, item)
                self.store(r.target + "_scale", scale, item)
        elif self.owns(r.target + ".w13") and r.expert in self.experts:
            self.take_expert(item)

    def shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return self.share.shard(name, tensor).clone() if self.share is not None else tensor

    def take_expert(self, item: Stored) -> None:
        """One expert's w1/w3/w2 field: its TP slice read, converted to the held format, placed in the stack."""
        r = item.route
        index, after = self.expert_index(r.part, r.field, item.info.shape)
        tensor = self.read(item, [index], 0)
        if r.field == "weight":
            tensor = self.finite(tensor, item)
            parts = quantize_mxfp4(tensor) if self.packed else (tensor,)
        else:
            halves = self.pending.setdefault((r.target, r.expert, r.part), {})
            halves[r.field] = tensor
            if len(halves) < 2:
                return
            del self.pending[(r.target, r.expert, r.part)]
            packed, scale = halves["weight_packed"], halves["weight_scale"]
            parts = (packed, scale) if self.packed else (dequantize_mxfp4(packed, scale)[after],)
        self.place(r.target, r.expert - self.experts.start, r.part, parts)

    def expert_index(self, part: str, field: str, shape: tuple[int, ...]) -> tuple["Index", "Index"]:
        """(what to read of the stored tensor, what to keep of its dense value after dequantising)."""
        tp, rank = self.expert_tp, self.tp_rank
        if tp == 1:
            return (), ()
        if part != "w2":                                   # [I, ...]: the rank's rows of the intermediate
            step = shape[0] // tp
            return (slice(rank * step, (rank + 1) * step),), ()
        inner = self.config.moe_intermediate_size          # w2 [De, I (/2, /32)]: the rank's columns
        cols = slice(rank * inner // tp, (rank + 1) * inner // tp)
        per = {"weight": 1, "weight_packed": 2, "weight_scale": 32}[field]
        if field == "weight" or self.packed or (inner // tp) % 32 == 0:
            return (slice(None), slice(cols.start // per, cols.stop // per)), ()
        return (), (slice(None), cols)                     # scale groups straddle ranks: dequantise, then cut

    def place(self, prefix: str, slot: int, part: str, parts: tuple[torch.Tensor, ...]) -> None:
        fields = ("_packed", "_scale") if self.packed else ("",)
        for suffix, value in zip(fields, parts):
            name = prefix + (".w2" if part == "w2" else ".w13") + suffix
            if name not in self.weights:
                held = self.held_dtype(name)
                shape = self.local_shape(name)
                # NaN (or 0xFF bytes) until filled; the inventory has checked that every slot is in the checkpoint
                self.weights[name] = torch.full(shape, 255 if held == torch.uint8 else float("nan"), dtype=held,
                                                device=self.device)
            target = self.weights[name]
            if part == "w2":
                target[slot].copy_(value)                                          # [De, I(/2 or /32)]
            else:
                rows = target.shape[1] // 2                                        # w13: gate rows, then up rows
                span = slice(0, rows) if part == "w1" else slice(rows, 2 * rows)
                target[slot, span].copy_(value)

    def local_shape(self, name: str) -> tuple[int, ...]:
        shape = self.expected[name].shape
        if self.share is None:
            return shape
        indices, dim = self.share.pieces(name, shape)
        if indices == [()]:
            return shape
        size = sum(len(range(*index[dim].indices(shape[dim]))) for index in indices)
        return shape[:dim] + (size,) + shape[dim + 1:]


def check_checkpoint(path: str | Path, config: ModelConfig) -> None:
    """Every check `load_checkpoint` makes before reading data (files, headers, shapes, dtypes), reading no data:
    a server refuses a bad directory with this before it starts."""
    files: list[SafetensorsFile] = []
    try:
        for file in checkpoint_files(path):
            files.append(SafetensorsFile(file))
        inventory(Path(path), files, config)
    finally:
        for file in files:
            file.close()
