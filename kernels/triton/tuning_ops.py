"""Per-vendor launch parameters (block sizes, warps, stages) of the MLA, MoE, AttnRes and norm kernels.

Three targets: `nvidia` (sm90 and later: tl.dot tiles >= 16, 32-lane warps), `amd` (CDNA: 64-lane wavefronts, so
half the warps of NVIDIA for the same tile, and fewer pipeline stages because LDS is smaller) and `interpreter`
(TRITON_INTERPRET=1 on the CPU: the smallest tiles that tl.dot accepts, since every program runs in numpy).
The choice depends on the tensor's device, never on an environment if-chain per kernel.
"""
from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch


def target(device: torch.device) -> str:
    """`interpreter`, `nvidia` or `amd` for tensors on `device`."""
    if device.type == "cpu" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return "interpreter"
    return "amd" if getattr(torch.version, "hip", None) else "nvidia"


@functools.lru_cache(maxsize=None)
def num_compute_units(device_index: int) -> int:
    """SMs (NVIDIA) or CUs (AMD); split-KV decode sizes its grid from this."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def compute_units(device: torch.device) -> int:
    if target(device) == "interpreter":
        return 4
    return num_compute_units(device.index if device.index is not None else torch.cuda.current_device())


class RowConfig(NamedTuple):
    """One program per row (norms, activation, AttnRes, routing)."""
    num_warps: int


def row_config(device: torch.device, block_width: int) -> RowConfig:
    if target(device) == "interpreter":
        return RowConfig(num_warps=1)
    lanes = 64 if target(device) == "amd" else 32
    # about 8 elements per lane keeps a whole row in registers without spilling
    warps = max(1, min(16, block_width // (8 * lanes)))
    return RowConfig(num_warps=warps)


def attn_res_config(device: torch.device, block_width: int) -> RowConfig:
    """The AttnRes read walks up to 9 candidates per row with a reduction after each load: fewer warps per row let
    more rows (and so more loads) be in flight per SM. 4 warps for a 7168-wide row streamed at 73% of copy bandwidth on
    an H200, 16 warps at 53%."""
    if target(device) == "interpreter":
        return RowConfig(num_warps=1)
    lanes = 64 if target(device) == "amd" else 32
    return RowConfig(num_warps=max(1, min(8, block_width // (64 * lanes))))


class AttentionConfig(NamedTuple):
    block_m: int       # query rows (prefill) or heads (decode) per program
    block_n: int       # keys per inner step
    num_warps: int
    num_stages: int


def mla_prefill_config(device: torch.device, head_dim_qk: int, element_size: int = 2) -> AttentionConfig:
    kind = target(device)
    if kind == "interpreter":
        return AttentionConfig(block_m=16, block_n=16, num_warps=1, num_stages=1)
    if element_size > 2:
        # float32 tiles take twice the shared memory: 128x64 tiles in 3 stages asked for 295 KB at 192-wide q/k on
        # an H200 (limit 227 KB). Half-height query blocks and two stages fit on sm90 and CDNA alike.
        return AttentionConfig(block_m=64, block_n=32, num_warps=4, num_stages=2 if kind != "amd" else 1)
    if kind == "amd":
        return AttentionConfig(block_m=128, block_n=64, num_warps=4, num_stages=1)
    # 192-wide q/k: 128x64 tiles with 8 warps keep two wgmma groups busy without spilling on sm90
    return AttentionConfig(block_m=128, block_n=64 if head_dim_qk <= 256 else 32, num_warps=8, num_stages=3)


def mla_decode_config(device: torch.device, num_heads: int) -> AttentionConfig:
    kind = target(device)
    if kind == "interpreter":
        return AttentionConfig(block_m=16, block_n=16, num_warps=1, num_stages=1)
    # block_m = heads per program: all heads of a block share each KV tile. Few heads (tensor-parallel ranks) make
    # the op memory bound, and 16 x 32 tiles on 4 warps with about 2 programs per SM streamed fastest on an H200
    # (1.3 TB/s at B=1, 128K; 2.0 TB/s at B=128, 2K). With 64+ heads it turns compute bound (~180 FLOP per byte)
    # and wider head blocks with 8 warps win.
    if kind == "amd":
        return AttentionConfig(block_m=16, block_n=32, num_warps=4, num_stages=1)
    if num_heads <= 16:
        return AttentionConfig(block_m=16, block_n=32, num_warps=4, num_stages=2)
    return AttentionConfig(block_m=32 if num_heads <= 32 else 64, block_n=32, num_warps=8, num_stages=2)


class GemmConfig(NamedTuple):
    block_m: int       # routed token rows per program (all of one expert)
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def moe_gemm_config(device: torch.device, num_rows: int) -> GemmConfig:
    kind = target(device)
    if kind == "interpreter":
        return GemmConfig(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1)
    # decode-sized batches route few rows per expert: a small block_m wastes less padding
    block_m = 16 if num_rows <= 256 else 64
    if kind == "amd":
        return GemmConfig(block_m=block_m, block_n=64, block_k=64, num_warps=4, num_stages=1)
    return GemmConfig(block_m=block_m, block_n=128, block_k=64, num_warps=4 if block_m == 16 else 8, num_stages=3)


def _let_interpreter_index_size_one_arrays() -> None:
    """Triton 3.6's interpreter holds every scalar as a 1-element numpy array and converts loop bounds with
    int(array), which numpy >= 2.4 refuses for arrays with ndim > 0; so `range(0, n)` with a runtime n fails under
    TRITON_INTERPRET=1. Convert through .item() instead (a no-op outside the interpreter)."""
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return
    from triton.runtime import interpreter
    original = interpreter._patch_lang_tensor
    if getattr(original, "_k3core_index_fix", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._k3core_index_fix = True
    interpreter._patch_lang_tensor = patched


_let_interpreter_index_size_one_arrays()
