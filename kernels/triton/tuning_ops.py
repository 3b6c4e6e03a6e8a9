"""Per-vendor launch parameters (block sizes, warps, stages) of the MLA, MoE, AttnRes and norm kernels.

Three targets: `nvidia` (sm90 and later: tl.dot tiles >= 16, 32-lane warps), `amd` (CDNA: 64-lane wavefronts, so
half the warps of NVIDIA for the same tile, and fewer pipeline stages because LDS is smaller) and `interpreter`
(TRITON_INTERPRET=1 on the CPU: the smallest tiles that tl.dot accepts, since every program runs in numpy).
The choice depends on the tensor's device, never on an environment if-chain per kernel.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from typing import Iterator, NamedTuple

import torch


class AssumedDevice(NamedTuple):
    """A GPU that the launch parameters are chosen for although no such GPU is present (offline compiles)."""
    vendor: str              # "nvidia" | "amd"
    arch: str                # "sm_90", "gfx942", ...
    compute_units: int       # SMs or CUs


_ASSUMED: contextvars.ContextVar[AssumedDevice | None] = contextvars.ContextVar("assumed_device", default=None)


@contextlib.contextmanager
def assume_device(device: AssumedDevice) -> Iterator[None]:
    """Inside this block every launch parameter (target, architecture, compute units) is chosen as for `device`,
    whatever device the tensors are on. This is how `backends.offline` captures the launches a GPU would get from
    CPU tensors and compiles them for that GPU; nothing may run a kernel inside it."""
    token = _ASSUMED.set(device)
    try:
        yield
    finally:
        _ASSUMED.reset(token)


def assumed_device() -> AssumedDevice | None:
    return _ASSUMED.get()


def target(device: torch.device) -> str:
    """`interpreter`, `nvidia` or `amd` for tensors on `device`."""
    assumed = _ASSUMED.get()
    if assumed is not None:
        return assumed.vendor
    if device.type == "cpu" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return "interpreter"
    return "amd" if getattr(torch.version, "hip", None) else "nvidia"


@functools.lru_cache(maxsize=None)
def num_compute_units(device_index: int) -> int:
    """SMs (NVIDIA) or CUs (AMD); split-KV decode sizes its grid from this."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def compute_units(device: torch.device) -> int:
    assumed = _ASSUMED.get()
    if assumed is not None:
        return assumed.compute_units
    if target(device) == "interpreter":
        return 4
    return num_compute_units(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _device_arch(device_index: int) -> str:
    props = torch.cuda.get_device_properties(device_index)
    if getattr(torch.version, "hip", None):
        return props.gcnArchName.split(":")[0]          # "gfx942:sramecc+:xnack-" -> "gfx942"
    return f"sm_{props.major}{props.minor}"


def current_arch() -> str:
    """The architecture kernels are launched for: the assumed device's, else the current GPU's ("sm_90",
    "gfx942"), else "interpreter" (no GPU, or TRITON_INTERPRET=1)."""
    assumed = _ASSUMED.get()
    if assumed is not None:
        return assumed.arch
    if os.environ.get("TRITON_INTERPRET", "0") == "1" or not torch.cuda.is_available():
        return "interpreter"
    return _device_arch(torch.cuda.current_device())


def nvidia_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) of the NVIDIA GPU kernels are launched for: the assumed device's, else `device`'s."""
    assumed = _ASSUMED.get()
    if assumed is not None and assumed.arch.startswith("sm_"):
        digits = assumed.arch.removeprefix("sm_")
        return int(digits[:-1]), int(digits[-1])
    return torch.cuda.get_device_capability(device)


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
    if target(device) == "amd":
        # 64 elements per lane (2 wavefronts for an 8192-wide block) spill 2 VGPRs in bf16 and 60 in float32 on
        # gfx942 and gfx950 (offline compile, Triton 3.6.0); 16 per lane (8 wavefronts) use ~150 and spill none.
        return RowConfig(num_warps=max(1, min(16, block_width // (16 * 64))))
    return RowConfig(num_warps=max(1, min(8, block_width // (64 * 32))))


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


class MlaDecodeConfig(NamedTuple):
    """Launch parameters of split-KV MLA decode (kernels/triton/mla_decode.py)."""
    block_h: int             # heads per program: all heads of a block share each KV tile
    block_n: int             # cache entries per inner step
    num_warps: int
    num_stages: int
    programs_per_unit: int   # split-KV: split the context until there are about this many programs per SM/CU
    tiles: str               # "page": one page id per tile, rows addressed from one base (needs block_n | page);
                             # "gather": one page id per entry (any page size)
    merge_splits: int = 1    # LSE merge: splits combined per step (a power of two)
    merge_block_v: int = 0   # LSE merge: value columns per program (0: all of them)
    split_policy: str = "cover"   # "cover": at least programs_per_unit programs per SM/CU; "waves": the split count
                                  # whose programs finish soonest in whole waves (mla_decode.choose_num_splits)


MLA_DECODE_TILES = ("page", "gather")
MLA_DECODE_SPLIT_POLICIES = ("cover", "waves")
# Shape classes of the tuning tables: (largest batch of the class or None for "and above", class name).
MLA_DECODE_BATCH_CLASSES = ((4, "batch 1-4"), (32, "batch 5-32"), (None, "batch 33+"))
KDA_DECODE_BATCH_CLASSES = ((16, "seqs 1-16"), (128, "seqs 17-128"), (512, "seqs 129-512"), (None, "seqs 513+"))

# NVIDIA, <= 16 heads (a TP8 rank of K3: 12 heads, 576-wide latent, page 64). The values measured before the
# tuning sweep existed: 16 x 32 tiles on 4 warps with about 2 programs per SM (1.3 TB/s at B=1, 128K; 1.6 TB/s at
# B=64, 8K on an H200). Paste the winners of `python -m tools.tune.tune_decode` here, one line per class.
_MLA_DECODE_NVIDIA: dict[str, MlaDecodeConfig] = {
    # Since q is read per tile (kernels/triton/mla_decode.py: no longer 144 registers a thread) 32-entry tiles on 4
    # warps run two programs per SM without spilling, and win at every batch in a scratch A/B on the H200 (three
    # alternating graph timings each, against the 64-entry / 8-warp tiles of the same kernel and of the one before):
    # B=1 x 128K 73.2% of copy (69.4% before), B=8 x 32K 85.1% (78.8%), B=64 x 8K 90.9% (85.0%). Before that:
    # bench/results/archive/tune-decode-b1-nvidia-h200.md (68.8% at B=1 with one program per SM and one merge step
    # per 32 columns) and archive/tune-decode-waves-nvidia-h200.md (B=8 79.3%, B=64 85.4% with the "waves" split
    # count)
    "batch 1-4": MlaDecodeConfig(block_h=16, block_n=32, num_warps=4, num_stages=3, programs_per_unit=2,
                                 tiles="page", merge_splits=256, merge_block_v=32),
    "batch 5-32": MlaDecodeConfig(block_h=16, block_n=32, num_warps=4, num_stages=3, programs_per_unit=2,
                                  tiles="page", merge_splits=32, merge_block_v=64, split_policy="waves"),
    "batch 33+": MlaDecodeConfig(block_h=16, block_n=32, num_warps=4, num_stages=3, programs_per_unit=2,
                                 tiles="page", merge_splits=1, merge_block_v=0, split_policy="waves"),
}


def shape_class(classes: tuple[tuple[int | None, str], ...], size: int) -> str:
    """The name of the first class whose bound is >= size (None: no bound)."""
    return next(name for bound, name in classes if bound is None or size <= bound)


def mla_decode_config(device: torch.device, num_heads: int, batch: int = 1, page_size: int = 64,
                      element_size: int = 2) -> MlaDecodeConfig:
    """Tiles per target, shape class and cache element size. "page" tiles need block_n to divide the page size;
    where it does not, this returns the same config with "gather" tiles (the kernel is chosen here, never inside the
    launch)."""
    kind = target(device)
    if kind == "interpreter":
        config = MlaDecodeConfig(block_h=16, block_n=16, num_warps=1, num_stages=1, programs_per_unit=2,
                                 tiles="page", merge_splits=2)
    elif kind == "amd":
        config = MlaDecodeConfig(block_h=16, block_n=32, num_warps=4, num_stages=1, programs_per_unit=2,
                                 tiles="gather")
    elif num_heads <= 16:
        config = _MLA_DECODE_NVIDIA[shape_class(MLA_DECODE_BATCH_CLASSES, batch)]
        if element_size > 2:
            # A float32 cache (the conformance path) doubles every stage's shared memory: the bf16 tables' 64-entry
            # tiles in 3 stages asked for 336 KB on an H200 (limit 227 KB); 32-entry tiles in 2 stages take 147 KB.
            config = config._replace(block_n=min(config.block_n, 32), num_stages=min(config.num_stages, 2))
    else:
        # With 64+ heads the op turns compute bound (~180 FLOP per byte) and wider head blocks with 8 warps win.
        config = MlaDecodeConfig(block_h=32 if num_heads <= 32 else 64, block_n=32, num_warps=8, num_stages=2,
                                 programs_per_unit=2, tiles="gather")
    if config.tiles == "page" and page_size % config.block_n != 0:
        config = config._replace(tiles="gather")
    return config


class KdaDecodeConfig(NamedTuple):
    """Launch parameters of KDA decode (kernels/triton/kda_decode.py): one program per (value block, head, seq)."""
    block_v: int             # value rows of the [V, K] state per program: V / block_v programs per (seq, head)
    num_warps: int


# NVIDIA, K = V = 128 (K3). block_v 32 on 4 warps is the value used before the sweep (72% of copy at N=64, 83% at
# N=256 on an H200); paste the winners of `python -m tools.tune.tune_decode --only kda` here.
_KDA_DECODE_NVIDIA: dict[str, KdaDecodeConfig] = {
    # bench/results/archive/tune-decode-nvidia-h200.md: one warp per 8 value rows won at every N (65.5% of copy at
    # N=16, 78.4% at 64, 89.2% at 256, 93.3% at 1024; block_v 32 / 4 warps gave 52.9 / 72.3 / 82.3 / 86.8%).
    # Later sweeps (archive/tune-decode-waves and -merge, graphs of >= 8 calls) kept it: 82.4-83.2% at N=64, against
    # block_v 4, 2 warps, streaming cache hints and programmatic dependent launch, none better beyond noise. A
    # persistent kernel (4-16 programs per SM striding over the tiles, each loading its next tile while it steps the
    # current one) lost at every N (tune-decode-persistent-nvidia-h200.md: 82.1% at best against 83.4% at N=64).
    "seqs 1-16": KdaDecodeConfig(block_v=8, num_warps=1),
    "seqs 17-128": KdaDecodeConfig(block_v=8, num_warps=1),
    "seqs 129-512": KdaDecodeConfig(block_v=8, num_warps=1),
    "seqs 513+": KdaDecodeConfig(block_v=8, num_warps=1),
}


def kda_decode_config(device: torch.device, num_seqs: int) -> KdaDecodeConfig:
    kind = target(device)
    if kind == "interpreter":
        return KdaDecodeConfig(block_v=16, num_warps=1)
    if kind == "amd":
        return KdaDecodeConfig(block_v=32, num_warps=2)     # 64-lane wavefronts: half the warps of NVIDIA
    return _KDA_DECODE_NVIDIA[shape_class(KDA_DECODE_BATCH_CLASSES, num_seqs)]


class GemmConfig(NamedTuple):
    """Launch parameters of one MoE GEMM kernel (the row block is shared: see MoeGemmConfig)."""
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    # 2 or 3: the program's block_m rows are that many sub-blocks (each a power of two of >= 16 rows) that share
    # each weight tile, the trailing ones skipped when they hold only padding. About 146 rows per expert at K3
    # prefill: 128-row blocks in two halves take two weight passes and three 64-row products (64-row blocks take
    # three passes, 128-row blocks without halves compute 256 rows); 192-row blocks in three take one pass and the
    # same three products.
    sub_blocks: int = 1
    # weight tiles through a tensor descriptor (the TMA copy engine, NVIDIA sm90+) instead of pointer tiles
    weight_desc: bool = False
    # gate/up only: one dot per sub-block and K step over a [block_k, 2 * block_n] weight operand (the gate columns,
    # then the matching up columns) instead of two dots of block_n: the x tile is read from shared memory once per
    # K step instead of twice, and each MMA is twice as wide (m64n128k16 wgmma at block_n 64). The down GEMM has one
    # weight operand and refuses it.
    fused_gate_up: bool = False


class MoeGemmConfig(NamedTuple):
    block_m: int          # routed token rows per program, all of one expert; one row layout serves both GEMMs
    gate_up: GemmConfig   # x W13^T with the GLU fused, column blocks over the expert width I
    down: GemmConfig      # hidden W2^T, column blocks over the latent width D


# Shape classes by routed rows (tokens x top_k): decode batches route few rows per expert, where a small block_m
# wastes less padding. The tuner's decode shape (64 tokens x top-16 = 1024 rows) has a class of its own.
MOE_GEMM_ROW_CLASSES = ((256, "rows 1-256"), (2048, "rows 257-2048"), (None, "rows 2049+"))

# NVIDIA (sm90+), the values used before the tuning sweep existed. Paste the lines `python -m tools.tune.tune_moe`
# prints here, one per class.
_MOE_GEMM_NVIDIA: dict[str, MoeGemmConfig] = {
    "rows 1-256": MoeGemmConfig(block_m=16, gate_up=GemmConfig(block_n=128, block_k=64, num_warps=4, num_stages=3),
                                down=GemmConfig(block_n=128, block_k=64, num_warps=4, num_stages=3)),
    # the first MoE sweep (tune_moe-nvidia-h200.md in git before f67c61b): 1.12x the old default at 64 tokens x
    # top-16; still the best in bench/results/tune_moe-decode-nvidia-h200.md (f644e33)
    "rows 257-2048": MoeGemmConfig(block_m=16, gate_up=GemmConfig(block_n=64, block_k=128, num_warps=4, num_stages=3),
                                   down=GemmConfig(block_n=128, block_k=128, num_warps=8, num_stages=3)),
    # bench/results/archive/tune_moe-nvidia-h200.md (f644e33): two-half 128-row blocks with descriptor weight tiles,
    # 3.42 ms for the pair at 1024 tokens x top-16 against 3.88 for the 64-row pointer tiles before (1.14x);
    # torch._grouped_mm's pair 2.91 ms in the same run. archive/tune_moe-fused-nvidia-h200.md (76b3590 + fused form):
    # gate/up as one dot over 128 gate + 128 up columns on 8 warps, 2.06 ms against 2.16 for two dots of 64 on 4
    # (pair 3.27 ms, grouped_mm 2.93); the down tile kept (its sub-block choice flips between runs by ~2%).
    # bench/results/tune_moe-sub3-nvidia-h200.md (two runs on two machines): 192-row blocks as three 64-row
    # sub-blocks on 16 warps, so that an expert's ~146 rows read its weights once per column block: gate/up 1.92 /
    # 2.02 ms against 2.19 / 2.25 for the 128-row tile above, down level (1.22 / 1.21 against 1.18 / 1.23); the
    # pair 1.07x / 1.08x faster; torch._grouped_mm's pair still takes 0.89x / 0.91x of our time
    "rows 2049+": MoeGemmConfig(block_m=192, gate_up=GemmConfig(block_n=128, block_k=64, num_warps=16, num_stages=3,
                                                                sub_blocks=3, weight_desc=True, fused_gate_up=True),
                                down=GemmConfig(block_n=256, block_k=64, num_warps=16, num_stages=4, sub_blocks=3,
                                                weight_desc=True)),
}


# float32 experts are a conformance path, not a fast one: the bf16 tables' tiles can need twice the shared memory in
# float32 (block_n 256 asked for 288 KiB on an H200, limit 227 KiB), so float32 gets small tiles that fit anywhere.
_FLOAT32_GEMM_TILE = GemmConfig(block_n=64, block_k=32, num_warps=4, num_stages=2)


def moe_gemm_config(device: torch.device, num_rows: int, element_size: int = 2) -> MoeGemmConfig:
    """The MoE expert GEMM launch parameters for `num_rows` routed rows (tokens x top_k) on `device`."""
    kind = target(device)
    if kind == "interpreter":
        # the interpreter's cost is per program and op: 32-wide tiles ran k3-tiny's experts 2x faster than 16-wide
        # (the cuda op table's engine tests); 16-wide multi-step tiles are checked by tune_moe's smoke sweep
        tile = GemmConfig(block_n=32, block_k=32, num_warps=1, num_stages=1)
        return MoeGemmConfig(block_m=16, gate_up=tile, down=tile)
    if element_size > 2:
        block_m = 16 if num_rows <= 256 else 64
        return MoeGemmConfig(block_m=block_m, gate_up=_FLOAT32_GEMM_TILE, down=_FLOAT32_GEMM_TILE)
    if kind == "amd":
        tile = GemmConfig(block_n=64, block_k=64, num_warps=4, num_stages=1)     # 64-lane wavefronts, smaller LDS
        return MoeGemmConfig(block_m=16 if num_rows <= 256 else 64, gate_up=tile, down=tile)
    return _MOE_GEMM_NVIDIA[shape_class(MOE_GEMM_ROW_CLASSES, num_rows)]
