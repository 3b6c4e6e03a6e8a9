"""Providers, the registry, and selection with reasons.

A backend ("torch", "cuda", "rocm") is a set of providers per op (the ops and their signatures are in
`k3core.ops`). Each provider declares:

* `available()`: None, or one sentence saying why it cannot run here (package missing, no device, wrong arch);
* `reasons_unsupported(spec)`: the reasons it cannot serve this model/dtype/device (empty list = it can).

For every op the first provider (by priority, highest first) with no reasons wins. Selection happens once,
when the engine starts (`select_ops`), and the result is an `OpTable` the model calls into; `python -m
k3core.backends` prints it with every rejection. Vendor modules are named by dotted path and imported lazily,
so `import k3core` never imports triton or a vendor library.
"""
from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from k3core.config import ModelConfig
from k3core.ops import OP_NAMES, OPS

BACKENDS = ("torch", "cuda", "rocm")
log = logging.getLogger("k3core.backend")


@dataclass(frozen=True)
class OpSpec:
    """What a provider is asked to serve."""
    config: ModelConfig
    dtype: torch.dtype
    device: torch.device


@dataclass
class Provider:
    op: str
    name: str
    backend: str
    priority: int
    target: str                                   # "package.module:function", imported on first use
    available: Callable[[], str | None] = lambda: None
    reasons_unsupported: Callable[[OpSpec], list[str]] = lambda spec: []
    _fn: Callable[..., Any] | None = field(default=None, repr=False)

    def load(self) -> Callable[..., Any]:
        if self._fn is None:
            module_name, _, attr = self.target.partition(":")
            self._fn = getattr(importlib.import_module(module_name), attr)
        return self._fn


_REGISTRY: dict[str, list[Provider]] = {name: [] for name in OP_NAMES}
_LOADED_BACKENDS: set[str] = set()


def register(provider: Provider) -> None:
    if provider.op not in _REGISTRY:
        raise ValueError(f"unknown op {provider.op!r}; ops are: {', '.join(OP_NAMES)}")
    if provider.backend not in BACKENDS:
        raise ValueError(f"unknown backend {provider.backend!r}; choose one of: {', '.join(BACKENDS)}")
    existing = [p for p in _REGISTRY[provider.op] if p.name == provider.name]
    if existing:
        raise ValueError(f"provider {provider.name!r} for op {provider.op!r} is registered twice")
    _REGISTRY[provider.op].append(provider)


def providers(op: str) -> list[Provider]:
    return sorted(_REGISTRY[op], key=lambda p: -p.priority)


def _register_torch_references() -> None:
    for op in OPS:
        register(Provider(op=op.name, name=f"torch.{op.name}", backend="torch", priority=0, target=op.reference))


def load_backend(backend: str) -> None:
    """Import the backend package so that it registers its providers (idempotent)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of: auto, {', '.join(BACKENDS)}")
    if backend in _LOADED_BACKENDS:
        return
    _LOADED_BACKENDS.add(backend)
    if backend == "torch":
        _register_torch_references()
    else:
        importlib.import_module(f"backends.{backend}").register_providers()


def resolve_backend(backend: str) -> str:
    """`auto` picks by the device present: CUDA device -> cuda (or rocm on a HIP build), else torch."""
    if backend != "auto":
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose one of: auto, {', '.join(BACKENDS)}")
        return backend
    if torch.cuda.is_available():
        return "rocm" if getattr(torch.version, "hip", None) else "cuda"
    return "torch"


@dataclass(frozen=True)
class Rejection:
    provider: str
    reasons: tuple[str, ...]


@dataclass(frozen=True)
class OpChoice:
    op: str
    provider: str
    rejected: tuple[Rejection, ...]


class NoProviderError(RuntimeError):
    pass


class OpTable:
    """The chosen provider of every op; the model calls `ops.<name>(...)`."""

    def __init__(self, backend: str, choices: dict[str, OpChoice], functions: dict[str, Callable[..., Any]]):
        self.backend = backend
        self.choices = choices
        self._functions = functions
        for name, fn in functions.items():
            setattr(self, name, fn)

    def describe(self) -> str:
        lines = [f"backend: {self.backend}"]
        for name in OP_NAMES:
            choice = self.choices[name]
            lines.append(f"  {name:<20} -> {choice.provider}")
            for rejection in choice.rejected:
                lines.append(f"  {'':<20}    rejected {rejection.provider}: {'; '.join(rejection.reasons)}")
        return "\n".join(lines)


def select_ops(backend: str, spec: OpSpec, fallback_to_reference: bool = True) -> OpTable:
    """Choose one provider per op, once. With `fallback_to_reference`, an op that no provider of `backend` can
    serve uses the torch reference, and the choice says so with every rejection (never silently)."""
    backend = resolve_backend(backend)
    load_backend(backend)
    if backend != "torch" and fallback_to_reference:
        load_backend("torch")
    choices: dict[str, OpChoice] = {}
    functions: dict[str, Callable[..., Any]] = {}
    for op in OP_NAMES:
        rejected: list[Rejection] = []
        chosen: Provider | None = None
        candidates = [p for p in providers(op) if p.backend == backend]
        if fallback_to_reference and backend != "torch":
            candidates += [p for p in providers(op) if p.backend == "torch"]
        for provider in candidates:
            why_not = provider.available()
            reasons = [why_not] if why_not else list(provider.reasons_unsupported(spec))
            if reasons:
                rejected.append(Rejection(provider.name, tuple(reasons)))
                continue
            chosen = provider
            break
        if chosen is None:
            detail = "; ".join(f"{r.provider}: {', '.join(r.reasons)}" for r in rejected) or "no provider registered"
            raise NoProviderError(f"no provider of backend {backend!r} can serve op {op!r} ({detail})")
        choices[op] = OpChoice(op, chosen.name, tuple(rejected))
        functions[op] = chosen.load()
    fallen_back = [op for op, choice in choices.items() if backend != "torch" and choice.provider.startswith("torch.")]
    if fallen_back:
        log.warning("backend %s: no %s provider can serve %s; the torch reference runs instead "
                    "(`python -m k3core.backends --backend %s` lists every rejection and its reason)",
                    backend, backend, ", ".join(fallen_back), backend)
    return OpTable(backend, choices, functions)


def reference_ops() -> OpTable:
    """The torch references of every op (the oracle)."""
    return select_ops("torch", OpSpec(config=None, dtype=torch.float32, device=torch.device("cpu")))  # type: ignore[arg-type]
