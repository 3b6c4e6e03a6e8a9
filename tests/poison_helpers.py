"""Poisoned allocations for kernel tests (not a test module): an output element a kernel forgets to write fails
the comparison instead of passing on whatever the allocator left there."""
from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def nan_poisoned_allocations():
    """torch.empty / empty_like inside the block return NaN-filled floats (and -123456 integers)."""
    original_empty, original_empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-123456)

    torch.empty = lambda *a, **k: poison(original_empty(*a, **k))
    torch.empty_like = lambda *a, **k: poison(original_empty_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = original_empty, original_empty_like
