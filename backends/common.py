"""Shared by the NVIDIA and AMD backends: device facts, and the Triton providers both vendors register.

Every function here is safe to call on a machine with no GPU and no triton: availability is answered with a
sentence, never an exception, and nothing vendor-specific is imported at module level.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Callable

import torch

from k3core.backend import OpSpec, Provider, register

# Triton kernel of every op, "module:function" (same signature as the op in k3core.ops).
TRITON_TARGETS: dict[str, str] = {
    "rms_norm": "kernels.triton.norm:rms_norm",
    "gated_rms_norm": "kernels.triton.norm:gated_rms_norm",
    "glu_activation": "kernels.triton.activation:glu_activation",
    "kda_gate": "kernels.triton.kda_gate:kda_gate",
    "short_conv_prefill": "kernels.triton.conv:short_conv_prefill",
    "short_conv_decode": "kernels.triton.conv:short_conv_decode",
    "kda_prefill": "kernels.triton.kda_prefill:kda_prefill",
    "kda_decode": "kernels.triton.kda_decode:kda_decode",
    "mla_prefill": "kernels.triton.mla_prefill:mla_prefill",
    "mla_decode": "kernels.triton.mla_decode:mla_decode",
    "moe_route": "kernels.triton.moe_route:moe_route",
    "moe_experts": "kernels.triton.moe_experts:moe_experts",
    "moe_experts_mxfp4": "kernels.triton.moe_mxfp4:moe_experts_mxfp4",
    "attn_res_read": "kernels.triton.attn_res:attn_res_read",
}
# `sample` has no Triton kernel: its torch reference runs on the GPU as it is (see `register_torch_device_sample`).

TRITON_PRIORITY = 100
VENDOR_LIBRARY_PRIORITY = 50      # below our Triton kernels until a GPU conformance report promotes it
TORCH_DEVICE_PRIORITY = 10        # the torch reference running on the GPU; above the CPU-oriented fallback (0)

GPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ---- device facts ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceFacts:
    vendor: str                      # "nvidia" | "amd"
    name: str
    arch: str                        # "sm_90" or "gfx942"
    compute_capability: tuple[int, int]
    multiprocessor_count: int        # SMs (NVIDIA) or CUs (AMD)
    shared_memory_per_block: int     # bytes (opt-in maximum where the driver reports it)
    warp_size: int                   # 32 on NVIDIA, 64 on CDNA
    total_memory: int                # bytes
    source: str                      # where the facts came from

    def describe(self) -> str:
        return (f"{self.vendor} {self.name} ({self.arch}): {self.multiprocessor_count} "
                f"{'SMs' if self.vendor == 'nvidia' else 'CUs'}, warp {self.warp_size}, "
                f"{self.shared_memory_per_block // 1024} KiB shared memory per block, "
                f"{self.total_memory / 2**30:.1f} GiB [{self.source}]")


def is_hip_build() -> bool:
    return bool(getattr(torch.version, "hip", None))


def device_facts(index: int = 0) -> DeviceFacts | None:
    """Facts about GPU `index` from torch's device properties, or None when no GPU is visible."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(index)
    hip = is_hip_build()
    arch = getattr(props, "gcnArchName", "").split(":")[0] if hip else f"sm_{props.major}{props.minor}"
    shared = (getattr(props, "shared_memory_per_block_optin", 0) or getattr(props, "shared_memory_per_block", 0)
              or _shared_memory_from_vendor_python(index, hip))
    return DeviceFacts(
        vendor="amd" if hip else "nvidia", name=props.name, arch=arch or "unknown",
        compute_capability=(props.major, props.minor), multiprocessor_count=props.multi_processor_count,
        shared_memory_per_block=int(shared), warp_size=int(getattr(props, "warp_size", 64 if hip else 32)),
        total_memory=int(props.total_memory), source="torch.cuda.get_device_properties")


def _shared_memory_from_vendor_python(index: int, hip: bool) -> int:
    """Older torch builds do not report shared memory; cuda-python / hip-python do when installed (else 0)."""
    try:
        if hip and importlib.util.find_spec("hip") is not None:
            from hip import hip as hip_runtime  # type: ignore[import-not-found]
            err, value = hip_runtime.hipDeviceGetAttribute(
                hip_runtime.hipDeviceAttribute_t.hipDeviceAttributeMaxSharedMemoryPerBlock, index)
            return int(value)
        if not hip and importlib.util.find_spec("cuda") is not None:
            from cuda.bindings import runtime  # type: ignore[import-not-found]
            err, value = runtime.cudaDeviceGetAttribute(
                runtime.cudaDeviceAttr.cudaDevAttrMaxSharedMemoryPerBlockOptin, index)
            return int(value)
    except Exception:  # a version without these names: the fact is simply unknown
        return 0
    return 0


# ---- availability ------------------------------------------------------------------------------------------
def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def package_missing(package: str, install_hint: str) -> str | None:
    if importlib.util.find_spec(package) is None:
        return f"{package} is not installed ({install_hint})"
    return None


def vendor_device_missing(vendor: str) -> str | None:
    """None when a GPU of `vendor` ("cuda" or "rocm") is usable through this torch build."""
    hip = is_hip_build()
    if vendor == "cuda" and hip:
        return "this torch is a HIP (ROCm) build, not a CUDA build; use --backend rocm"
    if vendor == "rocm" and not hip:
        return "no ROCm device: this torch is not a HIP build (torch.version.hip is None)"
    if not torch.cuda.is_available():
        return ("no CUDA device is visible (torch.cuda.is_available() is False)" if vendor == "cuda"
                else "no ROCm (HIP) device is visible (torch.cuda.is_available() is False)")
    return None


def triton_available(vendor: str) -> str | None:
    missing = package_missing("triton", "pip install triton")
    if missing:
        return missing
    if triton_interpreted():
        return None      # the interpreter runs the kernels on CPU tensors (float32 only; see triton_reasons)
    return vendor_device_missing(vendor)


def device_reasons(spec: OpSpec, dtypes: tuple[torch.dtype, ...] = GPU_DTYPES) -> list[str]:
    """Reasons shared by every GPU provider: the dtype and the device of the spec."""
    reasons = []
    if spec.dtype == torch.float64:
        reasons.append("dtype float64 is not supported on the GPU path; use --backend torch for float64")
    elif spec.dtype not in dtypes:
        reasons.append(f"dtype {_dtype_name(spec.dtype)} is not supported (supported: "
                       f"{', '.join(_dtype_name(d) for d in dtypes)})")
    if spec.device.type == "cpu":
        reasons.append("device is CPU; this provider needs a GPU")
    return reasons


def triton_reasons(spec: OpSpec) -> list[str]:
    if spec.device.type == "cpu" and triton_interpreted():
        # Interpreted kernels compute with numpy, which has no bfloat16: bf16 results are wrong, not slow.
        if spec.dtype != torch.float32:
            return [f"dtype {_dtype_name(spec.dtype)} under TRITON_INTERPRET=1 gives wrong results (the interpreter "
                    "has no bfloat16/float16 arithmetic); use float32 when interpreting"]
        return []
    reasons = device_reasons(spec)
    if spec.device.type == "cpu":
        reasons[-1] = "device is CPU; Triton kernels need a GPU (or TRITON_INTERPRET=1 in float32 for testing)"
    return reasons


def module_reasons(target: str, spec: OpSpec) -> list[str]:
    """A kernel module may export `reasons_unsupported(spec)` for its own shape limits; a module that cannot be
    imported is itself a reason (the error says why), so selection falls through instead of failing at first call."""
    module_name = target.partition(":")[0]
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        return [f"{module_name} cannot be imported ({type(exc).__name__}: {exc})"]
    if not hasattr(module, target.partition(":")[2]):
        return [f"{target} does not exist"]
    own = getattr(module, "reasons_unsupported", None)
    return list(own(spec)) if callable(own) else []


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---- registration ------------------------------------------------------------------------------------------
def register_triton_providers(vendor: str, op_reasons: dict[str, Callable[[OpSpec], list[str]]] | None = None) -> None:
    """One Triton provider per op, named `<vendor>.triton.<op>`; `op_reasons` adds vendor-specific shape limits."""
    op_reasons = op_reasons or {}
    for op, target in TRITON_TARGETS.items():
        extra = op_reasons.get(op, lambda spec: [])

        def reasons(spec: OpSpec, target: str = target, extra: Callable[[OpSpec], list[str]] = extra) -> list[str]:
            found = triton_reasons(spec) + list(extra(spec))
            return found or module_reasons(target, spec)     # import the kernel only when nothing else rules it out

        register(Provider(op=op, name=f"{vendor}.triton.{op}", backend=vendor, priority=TRITON_PRIORITY,
                          target=target, available=lambda vendor=vendor: triton_available(vendor),
                          reasons_unsupported=reasons))


def register_torch_device_sample(vendor: str) -> None:
    """`sample` on the GPU is the torch reference itself (sorting, cumsum and multinomial are device ops in torch;
    no Triton kernel would beat them by enough to matter at one call per step). It is registered as a device
    provider so the table says honestly that the reference runs on the GPU. Added as CONTRIBUTING.md describes."""
    register(Provider(op="sample", name=f"{vendor}.torch_device.sample", backend=vendor,
                      priority=TORCH_DEVICE_PRIORITY, target="kernels.torch.sampling:sample",
                      available=lambda: vendor_device_missing(vendor),
                      reasons_unsupported=lambda spec: device_reasons(spec)))
