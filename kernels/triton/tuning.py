"""Block sizes and warp counts per kernel and vendor, in one place.

AMD CDNA runs 64-lane wavefronts, so the same tile needs half the warps it needs on NVIDIA's 32-lane warps;
everything else (block shapes, the precision of the triangular solve) is chosen here too so that a kernel
file never branches on the vendor itself.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from kernels.triton.tuning_ops import assumed_device, current_arch

VENDORS = ("nvidia", "amd")
# the decode-op tables live in tuning_ops
KINDS = ("kda_gate", "kda_intra", "kda_state", "kda_state_wide", "conv_prefill", "conv_decode")


@dataclass(frozen=True)
class KernelConfig:
    block_t: int = 64          # tokens per program (conv prefill), per chunk (KDA intra), elements / 64 (gate)
    block_c: int = 64          # channels per program (conv), or elements per program (gate)
    block_v: int = 32          # value columns per program for the state kernels (state tile [K, block_v])
    sub_chunk: int = 16        # KDA intra-chunk sub-block: bounds exp of in-block decay (see kda_chunk_intra)
    num_warps: int = 4
    num_stages: int = 1
    # tl.dot input_precision for float32 operands (the triangular solve, W, U0) when the inputs are 16-bit.
    solve_precision: str = "ieee"
    # kda_intra: chunks of 2 * sub_chunk tokens with the lower-bounded gate run as two halves
    # (kda_chunk_intra_two_block_kernel) instead of masked full-chunk tiles; other chunks ignore it
    two_block: bool = False
    # kda_state*: issue the next chunk's loads before this chunk's products (see kda_chunk_state_kernel)
    prefetch: bool = False
    # kda_state*: run the chunks as segments of at least this many, in parallel (kda_chunk_segments); 0 = off. No
    # table entry sets it: on the H200 it lost (1.95 against 1.45 ms at B=1 x 32K,
    # bench/results/archive/tune-prefill-segments-nvidia-h200.md).
    segment_chunks: int = 0


_NVIDIA: dict[str, KernelConfig] = {
    "kda_gate": KernelConfig(block_c=1024, num_warps=4),
    # H200, T=32K bf16: tf32 solve 1.9 ms vs tf32x3 8.0 ms with the same error vs float64 (3.7e-3, set by the
    # bf16 inputs); float32 inputs always get "ieee" (see kda_prefill). 32-token chunks on 4 warps: 0.79-0.80 ms
    # for the pass at 32K tokens against 1.59 (split) and 1.84 (one kernel, 8 warps) with 64-token chunks, which
    # spill (bench.kernel_resources); the state pass then runs twice the steps (bench/results/archive/
    # tune-prefill-chunks-nvidia-h200.md: best sums 2.44 / 1.22 / 1.17 ms at B=1 32K / 8 x 4K / 64 x 512 against
    # 2.53 / 1.93 / 1.88). two_block: 0.61 ms at 32K tokens on 4 warps against 0.76 for the masked form
    # (archive/tune-prefill-two-block-nvidia-h200.md, 77d559e); with its body in use order (095aacb), 0.59 on 2 warps
    # against 0.65 on 4 (archive/tune-prefill-wide128-nvidia-h200.md).
    "kda_intra": KernelConfig(block_t=32, num_warps=2, solve_precision="tf32", two_block=True),
    # 12 heads x 128/16 value blocks = 96 sequential programs per sequence. prefetch (each chunk's loads issued a
    # step ahead): B=1 32K at 32-token chunks 1.46 ms against 1.67 (archive/tune-prefill-prefetch-nvidia-h200.md).
    "kda_state": KernelConfig(block_v=16, num_warps=4, num_stages=2, prefetch=True),
    # When kda_state's programs would not all be resident at once (see kda_prefill's state_config): whole 128-wide
    # value blocks on 8 warps, 0.31 ms at 8 x 4K and 0.26 at 64 x 512 against 0.39 / 0.34 for 64-wide blocks on 4
    # (archive/tune-prefill-wide128-nvidia-h200.md; 0.72 / 0.73 with kda_state's). In the sweeps (Triton 3.6)
    # three configs with num_stages=1 gave WRONG outputs (block_v 16 and 32 on 4 warps, 32 on 8): the float64 check
    # rejected them. Any new entry here must come out of that checked sweep.
    "kda_state_wide": KernelConfig(block_v=128, num_warps=8, num_stages=2, prefetch=True),
    "conv_prefill": KernelConfig(block_t=64, block_c=128, num_warps=4),
    "conv_decode": KernelConfig(block_c=256, num_warps=4),
}

_AMD: dict[str, KernelConfig] = {
    "kda_gate": KernelConfig(block_c=1024, num_warps=2),
    # TODO(measured on MI300): try a faster solve precision than "ieee" once its error is checked there.
    "kda_intra": KernelConfig(block_t=64, num_warps=4, solve_precision="ieee"),
    # Not run on AMD hardware. Until `tools.tune.tune_prefill` runs on an MI-series GPU, these are configs that gave
    # correct outputs under Triton 3.6 on an H200 (bench/results/archive/tune-prefill-*-nvidia-h200.md); the earlier
    # entry, block_v 32 on 4 warps with num_stages=1, was one of the three that gave WRONG outputs there.
    "kda_state": KernelConfig(block_v=32, num_warps=4, num_stages=2),
    "kda_state_wide": KernelConfig(block_v=32, num_warps=4, num_stages=2),
    "conv_prefill": KernelConfig(block_t=64, block_c=128, num_warps=2),
    "conv_decode": KernelConfig(block_c=256, num_warps=2),
}


def detect_vendor() -> str:
    """The assumed device's vendor (`tuning_ops.assume_device`), else 'amd' on a ROCm build of torch, otherwise
    'nvidia' (also used under the CPU interpreter)."""
    assumed = assumed_device()
    if assumed is not None:
        return assumed.vendor
    return "amd" if getattr(torch.version, "hip", None) else "nvidia"


def kernel_config(kind: str, vendor: str | None = None) -> KernelConfig:
    """The launch configuration of one kernel kind on one vendor (detected from torch when None)."""
    vendor = vendor or detect_vendor()
    table = {"nvidia": _NVIDIA, "amd": _AMD}.get(vendor)
    if table is None:
        raise ValueError(f"unknown vendor {vendor!r}; choose one of: {', '.join(VENDORS)}")
    if kind not in table:
        raise ValueError(f"unknown kernel kind {kind!r}; choose one of: {', '.join(KINDS)}")
    return table[kind]


def pow2_at_least(n: int, floor: int = 16) -> int:
    """The smallest power of two >= max(n, floor): tl.dot needs power-of-two tiles of at least 16."""
    p = floor
    while p < n:
        p *= 2
    return p


def is_interpreted() -> bool:
    """True under TRITON_INTERPRET=1 (the CPU interpreter), where a few loop forms must differ."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# ---- fitting to the device ---------------------------------------------------------------------------------
# LDS per workgroup (AMD) / opt-in shared memory per block (NVIDIA) of the architectures this code is compiled for
# (backends.offline compiles for them). A GPU not named here is asked through torch.
ARCH_SHARED_BYTES = {"gfx942": 64 * 1024, "gfx950": 160 * 1024, "gfx90a": 64 * 1024,
                     "sm_80": 163 * 1024, "sm_90": 227 * 1024, "sm_100": 227 * 1024}
# tl.dot input_precision values each architecture's Triton 3.6 backend accepts for float32 operands: gfx950 rejects
# tf32 (ieee, bf16x3, bf16x6 only), gfx942 and NVIDIA accept it.
ARCH_DOT_PRECISIONS = {"gfx942": ("ieee", "tf32"), "gfx950": ("ieee", "bf16x3", "bf16x6"),
                       "gfx90a": ("ieee",), "interpreter": ("ieee", "tf32", "tf32x3", "bf16x3", "bf16x6")}
NVIDIA_DOT_PRECISIONS = ("ieee", "tf32", "tf32x3")
# The stand-in for a precision an architecture rejects: the cheapest accepted one that is at least as accurate
# (bf16x3 keeps ~16 mantissa bits against tf32's 10).
PRECISION_FALLBACK = {"tf32": ("bf16x3", "ieee"), "tf32x3": ("bf16x6", "ieee"), "bf16x3": ("tf32x3", "ieee"),
                      "bf16x6": ("tf32x3", "ieee")}


def shared_memory_limit() -> int | None:
    """Bytes of LDS / shared memory one program may use on the architecture kernels are launched for (None under
    the interpreter, which has no limit)."""
    arch = current_arch()
    if arch == "interpreter":
        return None
    if arch in ARCH_SHARED_BYTES:
        return ARCH_SHARED_BYTES[arch]
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(getattr(props, "shared_memory_per_block_optin", 0) or props.shared_memory_per_block)


def dot_precision(requested: str) -> str:
    """`requested` when the launch architecture accepts it as a tl.dot input_precision, else its stand-in."""
    arch = current_arch()
    accepted = ARCH_DOT_PRECISIONS.get(arch, NVIDIA_DOT_PRECISIONS if arch.startswith("sm_") else ("ieee",))
    if requested in accepted:
        return requested
    return next(p for p in PRECISION_FALLBACK.get(requested, ("ieee",)) if p in accepted)


def state_shared_bytes(chunk: int, block_k: int, block_v: int, num_stages: int, element_size: int) -> int:
    """An upper estimate of kda_chunk_state_kernel's LDS / shared memory: each pipeline stage past the first buffers
    one chunk's W, Qg, Kd [BT, BK], Aqk [BT, BT] and U0 [BT, BV], and the products stage up to three [BT, BV]
    operands. Triton 3.6.0 compiled 30-144 KiB for gfx942 / gfx950 across chunks 32-64, block_v 16-64, bf16 and
    float32 at two stages: each equal to this estimate at 32-token chunks and up to two [BT, BV] tiles below it at
    64 (bench.kernel_resources reports the compiled sizes, and fails on an overrun, so the estimate is checked)."""
    per_stage = 3 * chunk * block_k + chunk * chunk + chunk * block_v
    return (max(1, num_stages - 1) * per_stage + 3 * chunk * block_v) * element_size


def fit_state_config(config: KernelConfig, chunk: int, block_k: int, element_size: int,
                     limit: int | None) -> KernelConfig | None:
    """`config` with block_v halved (down to 16) until the state kernel's estimate fits `limit` bytes, or None when
    no block_v does at this chunk size; `config` itself when there is no limit (the interpreter). float32 starts from half the table's block_v: its state tile then holds the
    bytes of the 16-bit one (at the table's width float32 spilled 130-159 VGPRs on gfx950)."""
    if limit is None:                   # the interpreter: nothing to fit
        return config
    block_v = max(16, config.block_v // 2) if element_size > 2 else config.block_v
    while True:
        if state_shared_bytes(chunk, block_k, block_v, config.num_stages, element_size) <= limit:
            return dataclasses.replace(config, block_v=block_v)
        if block_v <= 16:
            return None
        block_v //= 2


def fit_chunk_size(chunk: int, block_k: int, element_size: int, configs: tuple[KernelConfig, ...]) -> int:
    """The largest power-of-two chunk size <= `chunk` (>= 16) at which every state config in `configs` fits the
    launch architecture's shared memory after `fit_state_config`."""
    limit = shared_memory_limit()
    while chunk > 16 and any(fit_state_config(c, chunk, block_k, element_size, limit) is None for c in configs):
        chunk //= 2
    return chunk
