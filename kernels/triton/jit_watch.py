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
                       _describe(kwargs.get("compile"), kwargs.get("repr", "")))
        seen.append(item)
        if on_compile is not None:
            on_compile(item)
        return previous(*args, **kwargs) if previous is not None else False

    knobs.runtime.jit_cache_hook = hook
    return seen


def _describe(compile_args, triton_repr) -> str:
    """The launch's specialisation, one entry per argument: `name: type` with ` D` where Triton specialised it as a
    multiple of 16, `name=value` for a constexpr or an integer specialised to its value (1). Triton 3.6's own repr
    pairs the parameters with the characters of a string and stops after the first argument; this reads the
    signature, constants and attributes from `compile["specialization_data"]` instead (Triton's repr where there is
    none)."""
    import json
    try:
        data = json.loads(compile_args["specialization_data"])
        constants = {tuple(k): v for k, v in zip(data["constant_keys"], data["constant_vals"])}
        attrs = {tuple(k): v for k, v in zip(data["attrs_keys"], data["attrs_vals"])}
        parts = []
        for i, (name, kind) in enumerate(data["signature"].items()):
            if (i,) in constants:
                value = constants[(i,)]
                parts.append(f"{name}={value['constexpr'] if isinstance(value, dict) else value}")
            else:
                divisible = any(a[0] == "tt.divisibility" for a in attrs.get((i,), []) if isinstance(a, list))
                parts.append(f"{name}: {kind}{' D' if divisible else ''}")
        options = str(triton_repr).split("](", 1)[0] + "]" if "](" in str(triton_repr) else data.get("name", "")
        return f"{options}({', '.join(parts)})"
    except (KeyError, TypeError, ValueError, AttributeError):
        return " ".join(str(triton_repr).split())


def print_compiles() -> list[Compile]:
    """watch_compiles, each compile also printed to stderr as `triton-jit <monotonic> <kernel> <specialization>`."""
    def show(c: Compile) -> None:        # one line each
        print(f"triton-jit {c.when:.3f} {c.kernel} {' '.join(c.specialization.split())}", file=sys.stderr, flush=True)
    return watch_compiles(show)
