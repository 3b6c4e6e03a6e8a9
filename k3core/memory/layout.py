"""What one KDA slot and one MLA page hold, and how many bytes each takes in the arena.

A slot is everything a request (or a cached checkpoint) keeps per KDA layer: the recurrent state
`[L_kda, H, V, K]` (state dtype, float32 by default) followed by the short-conv tail `[L_kda, window, C]`
(conv dtype). A page is `page_size` tokens of every MLA layer, page-major: `[L_mla, page_size, D_latent]`.
Both sizes are padded to `ALIGN_BYTES` so that every block starts on a boundary where a float32, bf16 or fp8
view is legal, whatever mix of slots and pages precedes it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, NewType

import torch

if TYPE_CHECKING:
    from k3core.config import ModelConfig

ALIGN_BYTES = 256

SlotHandle = NewType("SlotHandle", int)   # stable id of a KDA slot (all KDA layers' recurrent + conv state)
PageHandle = NewType("PageHandle", int)   # stable id of an MLA page (page_size tokens x all MLA layers)


class PoolError(ValueError):
    """A caller broke the pool's contract (freed a handle twice, passed a handle it does not own)."""


def align_up(num_bytes: int, alignment: int = ALIGN_BYTES) -> int:
    return -(-num_bytes // alignment) * alignment


@dataclass(frozen=True)
class PoolLayout:
    """Sizes of one KDA slot and one MLA page; the pools only ever see these numbers and dtypes."""
    num_kda_layers: int
    kda_heads: int
    kda_head_dim: int
    conv_channels: int
    conv_window: int                 # conv_kernel_size - 1 pre-conv rows kept per layer
    state_dtype: torch.dtype
    conv_dtype: torch.dtype
    num_mla_layers: int
    page_size: int                   # tokens per page
    latent_width: int                # kv_lora_rank + qk_rope_head_dim
    kv_dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_kda_layers", "kda_heads", "kda_head_dim", "conv_channels", "conv_window",
                     "num_mla_layers", "latent_width"):
            if getattr(self, name) < 0:
                raise ValueError(f"PoolLayout.{name} is {getattr(self, name)}; it must be non-negative")
        if self.page_size < 1:
            raise ValueError(f"PoolLayout.page_size is {self.page_size}; a page must hold at least one token")

    @classmethod
    def from_config(cls, config: "ModelConfig", page_size: int, kv_dtype: torch.dtype = torch.bfloat16,
                    conv_dtype: torch.dtype = torch.bfloat16, state_dtype: torch.dtype = torch.float32,
                    tp_size: int = 1) -> "PoolLayout":
        """The layout of one rank: KDA heads (and so the conv channels) split over `tp_size`; the MLA latent
        is shared by all heads and is therefore replicated."""
        if config.kda_num_heads % tp_size:
            raise ValueError(f"tp_size={tp_size} does not divide the {config.kda_num_heads} KDA heads; "
                             "choose a tensor-parallel size that divides it")
        heads = config.kda_num_heads // tp_size
        return cls(
            num_kda_layers=len(config.kda_layer_ids), kda_heads=heads, kda_head_dim=config.kda_head_dim,
            conv_channels=3 * heads * config.kda_head_dim, conv_window=max(config.conv_kernel_size - 1, 0),
            state_dtype=state_dtype, conv_dtype=conv_dtype,
            num_mla_layers=len(config.mla_layer_ids), page_size=page_size,
            latent_width=config.mla_latent_width, kv_dtype=kv_dtype)

    # ---- per-layer pieces (bytes) -----------------------------------------------------------------
    @property
    def state_shape(self) -> tuple[int, int, int]:
        return (self.kda_heads, self.kda_head_dim, self.kda_head_dim)          # [H, V, K]

    @property
    def conv_shape(self) -> tuple[int, int]:
        return (self.conv_window, self.conv_channels)                          # [window, C]

    @property
    def page_shape(self) -> tuple[int, int]:
        return (self.page_size, self.latent_width)                             # [page_size, D_latent]

    @property
    def state_layer_bytes(self) -> int:
        return _numel(self.state_shape) * self.state_dtype.itemsize

    @property
    def conv_layer_bytes(self) -> int:
        return _numel(self.conv_shape) * self.conv_dtype.itemsize

    @property
    def conv_offset(self) -> int:
        """Byte offset of the conv tails inside a slot (after all recurrent states)."""
        return align_up(self.num_kda_layers * self.state_layer_bytes)

    @property
    def page_layer_bytes(self) -> int:
        return _numel(self.page_shape) * self.kv_dtype.itemsize

    # ---- block sizes ------------------------------------------------------------------------------
    @property
    def slot_bytes(self) -> int:
        """Recurrent [L_kda, H, V, K] + conv [L_kda, window, C], padded to ALIGN_BYTES (at least one unit)."""
        return max(align_up(self.conv_offset + self.num_kda_layers * self.conv_layer_bytes), ALIGN_BYTES)

    @property
    def page_bytes(self) -> int:
        """[L_mla, page_size, D_latent], padded to ALIGN_BYTES (at least one unit)."""
        return max(align_up(self.num_mla_layers * self.page_layer_bytes), ALIGN_BYTES)


@dataclass(frozen=True)
class PoolUsage:
    kda_bytes: int
    mla_bytes: int
    free_bytes: int
    capacity_bytes: int
    num_slots: int
    num_pages: int


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


def free_device_bytes(device: torch.device | str) -> int:
    """Bytes free on `device` right now (host memory available for the CPU)."""
    device = torch.device(device)
    if device.type == "cpu":
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    backend = getattr(torch, device.type, None)
    if backend is None or not hasattr(backend, "mem_get_info"):
        raise ValueError(f"cannot query free memory on device type {device.type!r}; "
                         "size the pool with an explicit capacity_bytes instead")
    free, _total = backend.mem_get_info(device)
    return int(free)
