"""Host-built integer tables sent to the device in one copy that does not wait for the GPU.

A plain `torch.tensor(values, device="cuda")` (or `.to("cuda")` of a pageable tensor) waits for the stream to drain
first, so a step that builds its metadata that way leaves the GPU idle while the host catches up. Here every table
goes into one pinned buffer and one non-blocking copy; torch's caching host allocator keeps the buffer alive until
the copy has run, so the caller may drop its host lists at once.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def index_tables(parts: Sequence[Sequence[int] | torch.Tensor], device: torch.device | str,
                 dtype: torch.dtype = torch.int32) -> list[torch.Tensor]:
    """One 1-D tensor of `dtype` on `device` per part (views of a single allocation), in order. A part may be a
    list of ints or a CPU tensor of any integer or bool dtype (flattened)."""
    pieces = [p.reshape(-1).to(dtype) if isinstance(p, torch.Tensor) else torch.tensor(list(p), dtype=dtype)
              for p in parts]
    host = torch.cat(pieces) if pieces else torch.zeros(0, dtype=dtype)
    device = torch.device(device)
    if device.type == "cuda":
        host = host.pin_memory()
    packed = host.to(device, non_blocking=True)
    views, offset = [], 0
    for piece in pieces:
        views.append(packed[offset: offset + piece.numel()])
        offset += piece.numel()
    return views
