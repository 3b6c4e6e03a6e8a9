"""AMD backend: Triton kernels for every op (CDNA, wave64), plus aiter MLA decode and fused MoE when installed.

`register_providers()` is called once by `k3core.backend.load_backend("rocm")`. It imports cleanly on a machine
with no AMD GPU and no aiter: every provider is then rejected with its reason. HIP graphs go through the same
`torch.cuda.CUDAGraph` API as CUDA graphs (`graph_runner`).
"""
from __future__ import annotations

from k3core.backend import Provider, register

from backends.common import (VENDOR_LIBRARY_PRIORITY, DeviceFacts, device_facts, package_missing,
                             register_torch_device_sample, register_triton_providers, vendor_device_missing)

VENDOR = "rocm"


def _aiter_available() -> str | None:
    return package_missing("aiter", "install AMD's aiter from github.com/ROCm/aiter") or vendor_device_missing(VENDOR)


def register_providers() -> None:
    from backends.rocm import aiter_ops  # noqa: PLC0415  (imports aiter only when a provider is called)
    register_triton_providers(VENDOR)
    register_torch_device_sample(VENDOR)
    register(Provider(op="mla_decode", name="rocm.aiter.mla_decode", backend=VENDOR,
                      priority=VENDOR_LIBRARY_PRIORITY, target="backends.rocm.aiter_ops:mla_decode",
                      available=_aiter_available, reasons_unsupported=aiter_ops.mla_reasons))
    register(Provider(op="moe_experts", name="rocm.aiter.moe_experts", backend=VENDOR,
                      priority=VENDOR_LIBRARY_PRIORITY, target="backends.rocm.aiter_ops:moe_experts",
                      available=_aiter_available, reasons_unsupported=aiter_ops.moe_reasons))


def graph_runner(*args, **kwargs):
    """HIP graphs for the decode step (see backends.common_graphs.GraphRunner)."""
    from backends.common_graphs import GraphRunner  # noqa: PLC0415
    return GraphRunner(*args, **kwargs)


def facts() -> DeviceFacts | None:
    return device_facts()
