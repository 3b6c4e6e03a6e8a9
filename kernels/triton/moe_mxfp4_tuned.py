"""Tile tables from a file: `K3CORE_MXFP4_TILES=PATH` replaces entries of `MXFP4_TILES_NVIDIA` (and their tail
tiles) with the tiles PATH names by row class, so that a sweep's winners can be benchmarked, conformance-checked and
served before they are pasted into the committed table, on the machine and in the device call that found them
(`bench.moe_mxfp4_sweep` writes moe-mxfp4-winners-<device>.json in this format; `bash scripts/gpu.sh
mxfp4-adopt` uses it), as vLLM reads tuned fused-MoE configs from a folder.

The file: a JSON object from row class (`MXFP4_ROW_CLASSES`) to one tile's `Mxfp4Tile` fields by name (absent
fields take their defaults), optionally with "tail": the tail blocks' tile (`mxfp4_tail_tile`). A class the file
names takes its tile and only its own tail; the other classes keep the committed ones. Every tile passes
`check_tile`; a wrong class, field or option is refused naming the file, and so is the variable on a device whose
calls never read `MXFP4_TILES_NVIDIA` (the interpreter, AMD, the `tl.dot_scaled` arches), rather than ignored.
Results record the variable and the file's content (`k3core.provenance.tuning_overrides`).
"""
from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path

from kernels.triton.moe_mxfp4_tiles import (MXFP4_ROW_CLASSES, MXFP4_TAIL_TILES_NVIDIA, MXFP4_TILES_NVIDIA,
                                            Mxfp4Tile, check_tile)

TILES_ENV = "K3CORE_MXFP4_TILES"


def tile_from_fields(fields: dict, where: str, check: bool = True) -> Mxfp4Tile:
    """An `Mxfp4Tile` from its fields by name (absent ones take their defaults), through `check_tile` unless
    `check` is False (a sweep records a refused tile as its row's error instead); a field that is not a tile's, a
    missing required one or (checked) a refused combination raises ValueError naming `where`."""
    if not isinstance(fields, dict):
        raise ValueError(f"{where}: expected an object of Mxfp4Tile fields, got {fields!r}")
    unknown = sorted(set(fields) - set(Mxfp4Tile._fields))
    if unknown:
        raise ValueError(f"{where}: {', '.join(unknown)} is not an Mxfp4Tile field (fields: "
                         f"{', '.join(Mxfp4Tile._fields)})")
    try:
        tile = Mxfp4Tile(**fields)
        if check:
            check_tile(tile)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    return tile


def entry_tiles(entry: dict, where: str, check: bool = True) -> tuple[Mxfp4Tile, Mxfp4Tile | None]:
    """(tile, tail tile or None) of one entry: a tile's fields, optionally with "tail" (the tail blocks' fields)."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected an object of Mxfp4Tile fields, got {entry!r}")
    tile = tile_from_fields({k: v for k, v in entry.items() if k != "tail"}, where, check)
    tail = tile_from_fields(entry["tail"], f"{where} tail", check) if "tail" in entry else None
    return tile, tail


def read_tiles_file(path: str) -> tuple[dict[str, Mxfp4Tile], dict[str, Mxfp4Tile]]:
    """(tiles, tail tiles) by row class from a tiles file (the module docstring's format)."""
    where = f"{TILES_ENV}={path}"
    try:
        spec = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"{where}: no such file") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{where}: not a readable JSON file ({exc})") from None
    classes = [name for _, name in MXFP4_ROW_CLASSES]
    if not isinstance(spec, dict) or not spec:
        raise ValueError(f"{where}: expected a JSON object from row class ({', '.join(classes)}) to one tile's "
                         f"fields")
    tiles, tails = {}, {}
    for name, entry in spec.items():
        if name not in classes:
            raise ValueError(f"{where}: unknown row class {name!r}; choose from {', '.join(classes)}")
        tiles[name], tail = entry_tiles(entry, f"{where}: {name}")
        if tail is not None:
            tails[name] = tail
    return tiles, tails


@lru_cache(maxsize=4)
def _merged(path: str, stamp: tuple[int, int]) -> tuple[dict[str, Mxfp4Tile], dict[str, Mxfp4Tile]]:
    """The committed tables with the file's classes replaced, read once per version (`stamp`) of the file."""
    tiles, tails = read_tiles_file(path)
    kept_tails = {name: tile for name, tile in MXFP4_TAIL_TILES_NVIDIA.items() if name not in tiles}
    return {**MXFP4_TILES_NVIDIA, **tiles}, {**kept_tails, **tails}


def nvidia_tables() -> tuple[dict[str, Mxfp4Tile], dict[str, Mxfp4Tile]]:
    """`MXFP4_TILES_NVIDIA` and `MXFP4_TAIL_TILES_NVIDIA` with the file's classes replaced, when the variable is
    set; the committed tables otherwise."""
    path = os.environ.get(TILES_ENV)
    if not path:
        return MXFP4_TILES_NVIDIA, MXFP4_TAIL_TILES_NVIDIA
    try:
        stat = os.stat(path)
    except OSError:
        raise ValueError(f"{TILES_ENV}={path}: no such file") from None
    return _merged(path, (stat.st_mtime_ns, stat.st_size))


def refuse_where_unread(where: str) -> None:
    """Raise when the variable is set for a call that never reads `MXFP4_TILES_NVIDIA` (`where` names its
    target): a tuned table that cannot apply is refused, not ignored."""
    path = os.environ.get(TILES_ENV)
    if path:
        raise ValueError(f"{TILES_ENV}={path} replaces MXFP4_TILES_NVIDIA, the tiles of NVIDIA GPUs without "
                         f"tl.dot_scaled (sm_90); this call runs on {where}, which never reads that table: unset "
                         f"{TILES_ENV}")
