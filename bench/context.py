"""What every benchmark case receives: the device, the dtype, smoke or not, the timer, and random inputs."""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.timing import Timer

BF16_OUTPUT_TOL = 1e-2      # one bf16 rounding of the output (~2e-3 rms) plus fp32-accumulated bf16 products
FP32_STATE_TOL = 1e-4       # float32 arithmetic on the same (bf16-valued) inputs as the float64 reference
SMOKE_TOL = 1e-4            # smoke runs in float32 end to end (tf32 is off in the interpreter)


@dataclass
class BenchContext:
    device: torch.device
    dtype: torch.dtype           # bfloat16 on the GPU, float32 in smoke runs (the interpreter has no bf16)
    smoke: bool
    timer: Timer
    generator: torch.Generator   # CPU generator: the same inputs for a given seed on any device
    repeats: int = 1             # > 1: cases that support it time ours and the anchor alternately this many times

    def randn(self, *shape: int, scale: float = 1.0, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Fresh random values (never zeros: zeros hide unwritten outputs and can run faster than real data)."""
        values = torch.randn(*shape, generator=self.generator, dtype=torch.float32) * scale
        return values.to(device=self.device, dtype=dtype or self.dtype)

    def tolerance(self, gpu_tolerance: float) -> float:
        return SMOKE_TOL if self.smoke else gpu_tolerance


def make_context(smoke: bool, seed: int = 0, repeats: int = 1) -> BenchContext:
    if smoke:
        device, dtype = torch.device("cpu"), torch.float32
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device is visible; run on a GPU, or pass --smoke to check the plumbing "
                             "on the CPU")
        device, dtype = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
        # the float32 math of references and anchors must be float32, not TF32 (torch's default, pinned here)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    generator = torch.Generator().manual_seed(seed)
    if repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {repeats}")
    return BenchContext(device, dtype, smoke, Timer(device), generator, repeats)


def load(target: str):
    """'module:function', imported on use so that a missing kernel fails its own case, not the whole run."""
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def fla_unavailable(ctx: BenchContext) -> str:
    """Why fla cannot be the anchor here ('' when it can)."""
    if ctx.device.type != "cuda":
        return "fla-core runs only on a CUDA device (this smoke run is on the CPU)"
    try:
        importlib.import_module("fla.ops.kda")
    except Exception as exc:
        return (f"fla.ops.kda cannot be imported ({type(exc).__name__}: {str(exc)[:100]}); install "
                ".whl/fla_core-0.6.0-py3-none-any.whl as scripts/gpu.sh kernels does")
    return ""


def require_interpreter(smoke: bool, module: str) -> None:
    """A --smoke run executes Triton kernels on the CPU, which needs TRITON_INTERPRET=1 before Python starts."""
    if smoke and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--smoke runs Triton kernels on the CPU and needs TRITON_INTERPRET=1 set before Python "
                         f"starts: run `TRITON_INTERPRET=1 python -m {module} --smoke`")


def results_dir(out: str | None) -> Path:
    """Where a bench writes: --out, else $OUT (the device tool's folder), else bench/results."""
    return Path(out or os.environ.get("OUT") or Path(__file__).parent / "results")
