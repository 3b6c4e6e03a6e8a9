"""The checkpoint's headers against the model config, before any tensor byte is read or any weight allocated.

`inventory(files, config)` routes every stored tensor (k3core.model.loader.route), checks its shape and dtype
against what the config expects, finds tensors stored twice (in two files, or two spellings of one weight),
and counts what is missing, expert by expert. All problems are reported together in one CheckpointError
sentence naming the files and tensors; only a checkpoint that passes is read.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from k3core.config import ModelConfig
from k3core.model.safetensors_file import CheckpointError, SafetensorsFile, TensorInfo
from k3core.model.weights import expected_tensors, is_routed_expert

if TYPE_CHECKING:
    from k3core.model.loader import Route

MAX_REPORTED_PROBLEMS = 5
_PAIR = ("weight_packed", "weight_scale")


def shape_text(shape: tuple[int, ...] | torch.Size) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


@dataclass
class Stored:
    """One stored tensor that the model uses: where it is, what its header says, where it goes."""
    name: str
    file: SafetensorsFile
    info: TensorInfo
    route: "Route"


@dataclass
class Problems:
    lines: list[str] = field(default_factory=list)
    extra: int = 0                       # problems counted but not spelled out (e.g. thousands of missing experts)

    def add(self, line: str) -> None:
        self.lines.append(line)

    def raise_if_any(self, path: Path) -> None:
        total = len(self.lines) + self.extra
        if total:
            shown = "; ".join(self.lines[:MAX_REPORTED_PROBLEMS])
            more = f" (and {total - MAX_REPORTED_PROBLEMS} more)" if total > MAX_REPORTED_PROBLEMS else ""
            raise CheckpointError(f"checkpoint {path} does not match the model config: {total} problem(s): "
                                  f"{shown}{more}; check that config.json belongs to these weights")


def expert_shape(config: ModelConfig, part: str, field_name: str) -> tuple[int, ...]:
    """The stored shape of one expert's w1/w3/w2 tensor (dense, packed or scale)."""
    inner, width = config.moe_intermediate_size, config.expert_width
    rows, cols = (width, inner) if part == "w2" else (inner, width)
    return {"weight": (rows, cols), "weight_packed": (rows, cols // 2), "weight_scale": (rows, cols // 32)}[field_name]


def _a_log_shapes(config: ModelConfig) -> set[tuple[int, ...]]:
    heads = config.kda_num_heads
    return {(heads,), (1, 1, heads, 1), (max(heads, config.kda_head_dim),)}


def inventory(path: Path, files: list[SafetensorsFile], config: ModelConfig) -> list[Stored]:
    """The stored tensors the model uses, in file order; CheckpointError listing every problem otherwise."""
    from k3core.model.loader import route
    expected = expected_tensors(config)
    problems = Problems()
    where: dict[str, SafetensorsFile] = {}
    covered: dict[str, str] = {}                                  # canonical name -> stored name
    experts: dict[tuple[str, int, str], set[str]] = {}            # (prefix, expert, part) -> fields present
    out: list[Stored] = []

    def cover(target: str, stored: str, file: SafetensorsFile) -> None:
        if target in covered:
            problems.add(f"unexpected {stored} in {file.path.name}: a second tensor for {target} "
                         f"(already given by {covered[target]})")
        covered[target] = stored

    for file in files:
        for name, info in file.tensors.items():
            if name in where:
                problems.add(f"duplicate {name}: stored in both {where[name].path.name} and {file.path.name}")
                continue
            where[name] = file
            r = route(name, config, expected)
            if r is None:
                problems.add(f"unexpected {name} in {file.path.name}")
                continue
            if r.kind == "ignore":
                continue
            label = name if r.target == name else f"{name} (as {r.target})"
            want_float = True
            if r.kind == "direct":
                spec = expected[r.target]
                ok_shape, want, want_float = info.shape == spec.shape, spec.shape, spec.kind != "uint8"
                targets = [r.target]
            elif r.kind == "a_log":
                ok_shape, want, targets = info.shape in _a_log_shapes(config), (config.kda_num_heads,), [r.target]
            elif r.kind == "conv_qkv":
                want = (3 * config.kda_proj_size, 1, config.conv_kernel_size)
                ok_shape, targets = info.shape == want, [f"{r.target}{p}_conv1d.weight" for p in "qkv"]
            elif r.kind == "quantize":
                packed = expected[r.target + "_packed"].shape
                want = (*packed[:-1], packed[-1] * 2)
                ok_shape, targets = info.shape == want, [r.target + "_packed", r.target + "_scale"]
            else:                                                  # one expert's w1/w3/w2 field
                want = expert_shape(config, r.part, r.field)
                ok_shape, want_float, targets = info.shape == want, r.field == "weight", []
            if not ok_shape:
                problems.add(f"mis-shaped {label}: got {shape_text(info.shape)}, expected {shape_text(want)} "
                             f"in {file.path.name}")
                continue
            if want_float != info.dtype.is_floating_point or (not want_float and info.dtype != torch.uint8):
                problems.add(f"mis-typed {label} in {file.path.name}: stored as {info.dtype}, expected "
                             + ("a float dtype" if want_float else "uint8 (MXFP4 codes or scales)"))
                continue
            for target in targets:
                cover(target, name, file)
            if r.kind == "expert":
                fields = experts.setdefault((r.target, r.expert, r.part), set())
                fields.add(r.field)
            out.append(Stored(name, file, info, r))

    _expert_problems(experts, config, problems)
    per_expert = {prefix for prefix, _, _ in experts}
    for name, spec in expected.items():
        if name in covered:
            continue
        if is_routed_expert(name) and name.rsplit(".", 1)[0] in per_expert:
            continue                                               # checked expert by expert
        problems.add(f"missing {name} {shape_text(spec.shape)}")
    problems.raise_if_any(path)
    return out


def _expert_problems(experts: dict[tuple[str, int, str], set[str]], config: ModelConfig,
                     problems: Problems) -> None:
    """Every expert of every per-expert MoE layer has w1, w3 and w2, each dense or as a complete MXFP4 pair."""
    budget = MAX_REPORTED_PROBLEMS
    for prefix in sorted({p for p, _, _ in experts}):
        for expert in range(config.num_experts):
            for part in ("w1", "w3", "w2"):
                fields = experts.get((prefix, expert, part), set())
                if fields == {"weight"} or fields == set(_PAIR):
                    continue
                if "weight" in fields:
                    line = f"conflicting {prefix}.{expert}.{part}: both a dense weight and MXFP4 halves"
                else:
                    half = " (the other half of an MXFP4 pair)" if fields else ""
                    line = f"missing {prefix}.{expert}.{part}{half}"
                if budget > 0:
                    problems.add(line)
                    budget -= 1
                else:
                    problems.extra += 1
