"""Which Triton kernels compile (or load from the on-disk cache into this process) and when.

Every new specialisation of a `@triton.jit` kernel (new constexprs, dtypes, or an integer argument changing class:
1, a multiple of 16, other) is compiled on its first launch in a process, at a cost of milliseconds (disk cache)
to seconds (a real compile), inside whatever request launched it. The serving warm-up exists to pay those before
/health says ready; `watch_compiles` makes the misses visible: it records each compile with its time, kernel and
specialisation, through Triton's `knobs.runtime.jit_cache_hook` (called on every in-process cache miss).
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Compile:
    when: float          # time.monotonic()
    kernel: str          # module.qualname
    specialization: str  # each argument's type and class (a multiple of 16: "D"), constexprs with their values


def watch_compiles(on_compile: Callable[[Compile], None] | None = None) -> list[Compile]:
    """Start recording compiles into the returned list (and call `on_compile` with each); chains to a hook that
    was installed before. Without Triton: an empty list that stays empty."""
    seen: list[Compile] = []
    try:
        from triton import knobs
    except ImportError:
        return seen
    previous = knobs.runtime.jit_cache_hook

    def hook(*args, **kwargs):
        fn = kwargs.get("fn")
        item = Compile(time.monotonic(), f"{getattr(fn, 'module', '?')}.{getattr(fn, 'name', '?')}",
                       _describe(fn, kwargs.get("key"), kwargs.get("repr", "")))
        seen.append(item)
        if on_compile is not None:
            on_compile(item)
        return previous(*args, **kwargs) if previous is not None else False

    knobs.runtime.jit_cache_hook = hook
    return seen


def _describe(fn, key, triton_repr) -> str:
    """The launch's specialisation, one `name: type class` per argument. Triton 3.6's own `repr` pairs the
    parameters with the characters of its options string (`key[1]`) and so stops after the first argument; the
    per-argument (type, class) pairs are `key[0]`. Triton's repr where the key has another shape."""
    jit_function = getattr(fn, "jit_function", None)
    names = [p.name for p in getattr(jit_function, "params", ())] or getattr(jit_function, "arg_names", None)
    if not names or not isinstance(key, tuple) or not key or not isinstance(key[0], tuple):
        return " ".join(str(triton_repr).split())
    parts = []
    for name, entry in zip(names, key[0]):
        kind, value = entry if isinstance(entry, tuple) and len(entry) == 2 else (entry, None)
        if kind == "constexpr":
            parts.append(f"{name}={value}")
        else:
            parts.append(f"{name}: {kind}{f' {value}' if value not in (None, '') else ''}")
    options = str(triton_repr).split("](", 1)[0] + "]" if "](" in str(triton_repr) else ""
    return f"{options}({', '.join(parts)})"


def print_compiles() -> list[Compile]:
    """watch_compiles, each compile also printed to stderr as `triton-jit <monotonic> <kernel> <specialization>`."""
    def show(c: Compile) -> None:        # one line each
        print(f"triton-jit {c.when:.3f} {c.kernel} {' '.join(c.specialization.split())}", file=sys.stderr, flush=True)
    return watch_compiles(show)
