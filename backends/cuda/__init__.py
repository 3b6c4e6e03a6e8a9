"""NVIDIA backend: Triton kernels for every op, plus FlashInfer MLA decode and torch grouped GEMM where present.

`register_providers()` is called once by `k3core.backend.load_backend("cuda")`. Nothing here imports triton or
a vendor library at import time; each provider's `available()` answers in one sentence why it cannot run.
"""
from __future__ import annotations

from k3core.backend import Provider, register

from backends.common import (VENDOR_LIBRARY_PRIORITY, DeviceFacts, device_facts, package_missing,
                             register_torch_device_sample, register_triton_providers, vendor_device_missing)

VENDOR = "cuda"


def _flashinfer_available() -> str | None:
    return package_missing("flashinfer", "pip install flashinfer-python") or vendor_device_missing(VENDOR)


def register_providers() -> None:
    from backends.cuda import flashinfer_mla, grouped_mm  # noqa: PLC0415  (both import vendor code lazily)
    register_triton_providers(VENDOR)
    register_torch_device_sample(VENDOR)
    register(Provider(op="mla_decode", name="cuda.flashinfer.mla_decode", backend=VENDOR,
                      priority=VENDOR_LIBRARY_PRIORITY, target="backends.cuda.flashinfer_mla:mla_decode",
                      available=_flashinfer_available, reasons_unsupported=flashinfer_mla.reasons))
    register(Provider(op="moe_experts", name="cuda.grouped_mm.moe_experts", backend=VENDOR,
                      priority=VENDOR_LIBRARY_PRIORITY, target="backends.cuda.grouped_mm:moe_experts",
                      available=grouped_mm.available, reasons_unsupported=grouped_mm.reasons))


def graph_runner(*args, **kwargs):
    """CUDA graphs for the decode step (see backends.common_graphs.GraphRunner)."""
    from backends.common_graphs import GraphRunner  # noqa: PLC0415
    return GraphRunner(*args, **kwargs)


def facts() -> DeviceFacts | None:
    return device_facts()
