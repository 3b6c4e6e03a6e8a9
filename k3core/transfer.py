"""Host-built integer tables sent to the device in one copy that does not wait for the GPU.

A plain `torch.tensor(values, device="cuda")` (or `.to("cuda")` of a pageable tensor) waits for the stream to drain
first, so a step that builds its metadata that way leaves the GPU idle while the host catches up. Here every table
goes into one pinned buffer and one non-blocking copy; torch's caching host allocator keeps the buffer alive until
the copy has run, so the caller may drop its host lists at once.

Each table starts a multiple of 16 bytes into the buffer (the one before it padded): Triton specialises a pointer
argument on whether it is 16-byte aligned, so views at offsets that followed the batch's sizes gave one kernel a new
compile for each alignment pattern a batch happened to have (the H200 serving run found 6 such compiles after warm-up, on int32 slot,
chunk and checkpoint tables).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

ALIGN_BYTES = 16               # every table's start, from the buffer's (which the allocators align further)


def index_tables(parts: Sequence[Sequence[int] | torch.Tensor], device: torch.device | str,
                 dtype: torch.dtype = torch.int32) -> list[torch.Tensor]:
    """One 1-D tensor of `dtype` on `device` per part (views of a single allocation), in order. A part may be a
    list of ints or a CPU tensor of any integer or bool dtype (flattened)."""
    pieces = [p.reshape(-1).to(dtype) if isinstance(p, torch.Tensor) else torch.tensor(list(p), dtype=dtype)
              for p in parts]
    align = max(1, ALIGN_BYTES // torch.empty(0, dtype=dtype).element_size())
    padded, offsets, offset = [], [], 0
    for piece in pieces:
        offsets.append(offset)
        padded.append(piece)
        pad = -piece.numel() % align
        if pad:
            padded.append(torch.zeros(pad, dtype=dtype))
        offset += piece.numel() + pad
    host = torch.cat(padded) if padded else torch.zeros(0, dtype=dtype)
    device = torch.device(device)
    if device.type == "cuda":
        host = host.pin_memory()
    packed = host.to(device, non_blocking=True)
    return [packed[start: start + piece.numel()] for start, piece in zip(offsets, pieces)]
