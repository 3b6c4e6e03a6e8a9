"""Hook for model-level conformance (to be filled in by the lead once the model exists).

`compare_logits(run_a, run_b, prompts)` holds two implementations of the same network to each other: each
callable maps a batch of token-id prompts to logits [B, T, V]. Intended use: `LLM(..., backend="cuda")` vs
`LLM(..., backend="torch")` on k3-tiny, and k3core vs transformers' Kimi-Linear on a small random checkpoint.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

LogitsFn = Callable[[list[list[int]]], torch.Tensor]


@dataclass(frozen=True)
class ModelComparison:
    max_abs_logit_error: float
    greedy_agreement: float          # fraction of positions whose argmax matches
    passed: bool


def compare_logits(run_a: LogitsFn, run_b: LogitsFn, prompts: list[list[int]], atol: float,
                   min_greedy_agreement: float = 1.0) -> ModelComparison:
    """Both callables see the same prompts; `atol` must come with its reason at the call site."""
    logits_a, logits_b = run_a(prompts).double().cpu(), run_b(prompts).double().cpu()   # [B, T, V]
    if logits_a.shape != logits_b.shape:
        raise ValueError(f"logit shapes differ: {tuple(logits_a.shape)} vs {tuple(logits_b.shape)}")
    error = float((logits_a - logits_b).abs().max()) if logits_a.numel() else 0.0
    agreement = float((logits_a.argmax(-1) == logits_b.argmax(-1)).double().mean()) if logits_a.numel() else 1.0
    return ModelComparison(error, agreement, error <= atol and agreement >= min_greedy_agreement)
