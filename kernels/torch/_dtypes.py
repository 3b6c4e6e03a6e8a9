"""The one rule every reference follows for its internal precision."""
from __future__ import annotations

import torch


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 when any floating input is float64 (the oracle mode), otherwise float32.

    bfloat16 and float16 inputs are upcast so the references never round an intermediate result.
    """
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def float32_unless_float64(dtype: torch.dtype) -> torch.dtype:
    """The dtype of an output the op table pins to float32: float64 stays float64 so the oracle loses nothing."""
    return torch.float64 if dtype == torch.float64 else torch.float32
