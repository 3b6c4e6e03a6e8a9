"""Where one step's GPU time goes: kernel time per kernel name under torch.profiler (CUPTI), grouped and ranked.

bench.model_bench profiles the BS=1 graph-replayed decode with it, to say where the time of a missed target goes.
The kernels of a replayed CUDA graph are traced one by one, so the table is the graph's
own kernels; the sum of their times against the step's wall time says how much of the step the GPU sat idle
between kernels (launch gaps inside the graph, dependencies).
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch

# first matching pattern wins (lower-case substrings of the kernel name)
GROUPS = (("gemm (cuBLAS/CUTLASS)", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitk")),
          ("moe (Triton experts, bookkeeping, combine)", ("moe", "gate_up_", "_down_kernel", "down_gemv", "down_swap",
                                                          "down_gluon", "down_wgmma", "_combine_kernel",
                                                          "group_pairs")),
          ("kda + short conv", ("kda", "conv")),
          ("mla", ("mla",)),
          ("attn_res", ("attn_res",)),
          ("norm", ("norm",)),
          ("torch elementwise/reduce/copy", ("elementwise", "reduce", "copy", "fill", "index", "gather", "scatter",
                                             "cat", "at::native")))


def group_of(name: str) -> str:
    lowered = name.lower()
    for group, patterns in GROUPS:
        if any(p in lowered for p in patterns):
            return group
    return "other"


def rank(kernels: list[tuple[str, float]], steps: int, step_ms: float | None, top: int = 12) -> dict:
    """kernels: (name, microseconds) of every kernel launch over `steps` steps -> per-step totals by name and by
    group, the top names, and the busy share of the step's wall time when step_ms is given."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, us in kernels:
        by_name[name][0] += us
        by_name[name][1] += 1
    total_us = sum(us for us, _ in by_name.values()) / steps
    rows = sorted(({"kernel": name, "group": group_of(name), "us_per_step": us / steps, "calls_per_step": n / steps,
                    "share": (us / steps) / total_us if total_us else 0.0} for name, (us, n) in by_name.items()),
                  key=lambda r: -r["us_per_step"])
    groups: dict[str, float] = defaultdict(float)
    for r in rows:
        groups[r["group"]] += r["us_per_step"]
    result = {"steps": steps, "kernel_us_per_step": total_us, "launches_per_step": len(kernels) / steps,
              "top": rows[:top],
              "groups": sorted(({"group": g, "us_per_step": us, "share": us / total_us if total_us else 0.0}
                                for g, us in groups.items()), key=lambda r: -r["us_per_step"])}
    if step_ms:
        result["step_ms"] = step_ms
        result["busy_share"] = total_us / (step_ms * 1e3)
    return result


def profile_kernels(fn: Callable[[], object], device: torch.device, steps: int = 10,
                    step_ms: float | None = None, top: int = 12) -> dict:
    """Run fn() `steps` times under the profiler (after one warm-up call) and rank its CUDA kernels."""
    if device.type != "cuda":
        raise ValueError("profile_kernels traces CUDA kernels; this device is " + device.type)
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize(device)
    kernels = [(e.name, e.time_range.elapsed_us()) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))]
    if not kernels:
        raise RuntimeError("the profiler traced no CUDA kernels (is CUPTI available?)")
    return rank(kernels, steps, step_ms, top)


def markdown(profile: dict, title: str) -> list[str]:
    busy = (f"; kernels busy {100 * profile['busy_share']:.0f}% of the {profile['step_ms']:.3f} ms step"
            if "busy_share" in profile else "")
    lines = [f"{title}: {profile['kernel_us_per_step']:.0f} us of kernels and {profile['launches_per_step']:.0f} "
             f"launches per step{busy} (torch.profiler, {profile['steps']} steps).", "",
             "| group | us per step | share of kernel time |", "|---|---|---|"]
    lines += [f"| {g['group']} | {g['us_per_step']:.0f} | {100 * g['share']:.1f}% |" for g in profile["groups"]]
    lines += ["", "| kernel | group | us per step | calls per step | share |", "|---|---|---|---|---|"]
    lines += [f"| `{r['kernel'][:70]}` | {r['group']} | {r['us_per_step']:.1f} | {r['calls_per_step']:.0f} | "
              f"{100 * r['share']:.1f}% |" for r in profile["top"]]
    return lines
