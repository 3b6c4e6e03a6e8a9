"""A safetensors file read by k3core itself: the header checked in full before any tensor byte is read, and a tensor
(or one slice of it) read with positioned reads into a fresh tensor, so that a rank reads only what it owns.

The format: 8 bytes little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets: [begin,
end]}, "__metadata__": {...}}, then the data; offsets count from the end of the header. Nothing in the file is
executed: the header is JSON, the data raw bytes. Every defect (a short file, a header length past the end, JSON
that is not a table of tensors, a dtype torch cannot hold, offsets that disagree with the shape or run past the
end of the file, a name given twice) raises CheckpointError naming the file and, where there is one, the tensor.

Memory: `read(name, index)` allocates the result only; a slice across rows of a larger tensor reads whole rows in
blocks of at most `BLOCK_BYTES` (or one contiguous run per row when runs are long), never the whole tensor.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import NamedTuple

import torch

MAX_HEADER_BYTES = 100 << 20            # the safetensors reference limit: a larger header is a corrupt length
BLOCK_BYTES = 16 << 20                  # staging for reads of a few columns out of many rows
_LONG_RUN_BYTES = 64 << 10              # a contiguous run at least this long is read straight into the result

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("F8_E4M3", "float8_e4m3fn"),
                     ("F8_E5M2", "float8_e5m2"), ("F8_E8M0", "float8_e8m0fnu")):
    if hasattr(torch, _attr):
        DTYPES[_name] = getattr(torch, _attr)


class CheckpointError(RuntimeError):
    """A checkpoint cannot be loaded; the message names the file (and the tensor) at fault and what to do."""


class TensorInfo(NamedTuple):
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int                          # absolute byte offset in the file
    nbytes: int


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} appears twice")
        out[key] = value
    return out


class SafetensorsFile:
    """One open safetensors file: `tensors` (name -> TensorInfo) from the checked header, `read()` for data."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as exc:
            raise CheckpointError(f"{self.path} cannot be opened ({exc.strerror}); check that the file exists "
                                  "and is readable") from None
        try:
            self.tensors = self._read_header()
        except BaseException:
            self.close()
            raise

    def _fail(self, why: str) -> CheckpointError:
        return CheckpointError(f"{self.path} is not a valid safetensors file: {why}; re-download or rewrite it")

    def _read_header(self) -> dict[str, TensorInfo]:
        size = os.fstat(self._fd).st_size
        if size < 8:
            raise self._fail(f"it has {size} bytes, fewer than the 8-byte header length")
        length = int.from_bytes(os.pread(self._fd, 8, 0), "little")
        if length > MAX_HEADER_BYTES or 8 + length > size:
            raise self._fail(f"its header length says {length} bytes but the file has {size - 8} after it")
        raw = os.pread(self._fd, length, 8)
        try:
            header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
        except (UnicodeDecodeError, ValueError) as exc:
            raise self._fail(f"its header is not JSON ({str(exc).splitlines()[0]})") from None
        if not isinstance(header, dict):
            raise self._fail("its header is not a JSON object")
        data_start, data_size = 8 + length, size - 8 - length
        tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            tensors[name] = self._entry(name, entry, data_start, data_size)
        return tensors

    def _entry(self, name: str, entry: object, data_start: int, data_size: int) -> TensorInfo:
        def bad(why: str) -> CheckpointError:
            return self._fail(f"tensor {name} {why}")
        if not isinstance(entry, dict):
            raise bad("has a header entry that is not an object")
        dtype = DTYPES.get(entry.get("dtype"))  # type: ignore[arg-type]
        if dtype is None:
            raise bad(f"has dtype {entry.get('dtype')!r}, which k3core cannot read")
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise bad(f"has shape {shape!r}, not a list of non-negative integers")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise bad(f"has data_offsets {offsets!r}, not [begin, end] with 0 <= begin <= end")
        element = dtype.itemsize
        nbytes = math.prod(shape) * element
        if offsets[1] - offsets[0] != nbytes:
            raise bad(f"has shape {shape} of {dtype} ({nbytes} bytes) but data_offsets span "
                      f"{offsets[1] - offsets[0]} bytes")
        if offsets[1] > data_size:
            raise bad(f"ends at data byte {offsets[1]} but the file holds {data_size} data bytes (truncated)")
        return TensorInfo(dtype, tuple(shape), data_start + offsets[0], nbytes)

    # ---- data ---------------------------------------------------------------------------------------------------
    def read(self, name: str, index: tuple[slice, ...] = ()) -> torch.Tensor:
        """`tensor[index]` as a new contiguous CPU tensor; `index` has step-1 slices, at most one of them partial."""
        info = self.tensors[name]
        shape = info.shape
        spans = [s.indices(d)[:2] for s, d in zip(index, shape)] + [(0, d) for d in shape[len(index):]]
        partial = [dim for dim, ((lo, hi), d) in enumerate(zip(spans, shape)) if (lo, hi) != (0, d)]
        if len(partial) > 1:
            raise ValueError(f"reading {name} sliced in dimensions {partial}: only one may be partial")
        out_shape = tuple(hi - lo for lo, hi in spans)
        element = info.dtype.itemsize
        out = torch.empty(math.prod(out_shape) * element, dtype=torch.uint8)
        if not partial:
            self._pread_into(out, info.begin, name)
        else:
            dim = partial[0]
            lo, hi = spans[dim]
            outer = math.prod(shape[:dim])
            row = shape[dim] * math.prod(shape[dim + 1:]) * element       # bytes of one outer index
            run = (hi - lo) * math.prod(shape[dim + 1:]) * element        # bytes wanted of it
            start = lo * math.prod(shape[dim + 1:]) * element
            if outer == 1 or run >= _LONG_RUN_BYTES:
                for o in range(outer):
                    self._pread_into(out[o * run:(o + 1) * run], info.begin + o * row + start, name)
            else:
                per_block = max(1, BLOCK_BYTES // max(row, 1))
                staging = torch.empty(min(per_block, outer) * row, dtype=torch.uint8)
                for first in range(0, outer, per_block):
                    count = min(per_block, outer - first)
                    block = staging[:count * row]
                    self._pread_into(block, info.begin + first * row, name)
                    out[first * run:(first + count) * run].view(count, run).copy_(
                        block.view(count, row)[:, start:start + run])
        return out.view(info.dtype).reshape(out_shape) if out.numel() else torch.empty(out_shape, dtype=info.dtype)

    def _pread_into(self, buffer: torch.Tensor, offset: int, name: str) -> None:
        view = memoryview(buffer.numpy()).cast("B")
        done = 0
        while done < len(view):
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got <= 0:
                raise CheckpointError(f"{self.path} ended while reading tensor {name} (the file shrank or is "
                                      "truncated); re-download it")
            done += got

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
