"""Provider selection, the `python -m k3core.backends` command, vendor packages on a machine without GPUs, the
grouped-GEMM adapter (checked on the CPU, where torch also runs `_grouped_mm`) and graph capture's CPU error."""
from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import k3core.backend as backend_module
from k3core.backend import NoProviderError, OpSpec, Provider, register, select_ops
from k3core.config import ModelConfig
from k3core.ops import OP_NAMES

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
TINY = ModelConfig.preset("k3-tiny")


@pytest.fixture
def fresh_registry(monkeypatch):
    """An empty registry in which "cuda" counts as loaded, so only the providers a test registers exist."""
    monkeypatch.setattr(backend_module, "_REGISTRY", {name: [] for name in OP_NAMES})
    monkeypatch.setattr(backend_module, "_LOADED_BACKENDS", {"cuda"})


def _fill_other_ops(skip: str) -> None:
    for op in OP_NAMES:
        if op != skip:
            register(Provider(op, f"cuda.fake.{op}", "cuda", 1, backend_module.OPS[OP_NAMES.index(op)].reference))


def test_highest_priority_provider_without_reasons_wins(fresh_registry):
    _fill_other_ops("rms_norm")
    target = "kernels.torch.norm:rms_norm"
    register(Provider("rms_norm", "cuda.low", "cuda", 5, target))
    register(Provider("rms_norm", "cuda.high_but_unsupported", "cuda", 100, target,
                      reasons_unsupported=lambda spec: ["head dim not supported"]))
    register(Provider("rms_norm", "cuda.mid", "cuda", 50, target))
    register(Provider("rms_norm", "cuda.unavailable", "cuda", 200, target, available=lambda: "package not installed"))
    table = select_ops("cuda", OpSpec(TINY, torch.float32, CPU), fallback_to_reference=False)
    choice = table.choices["rms_norm"]
    assert choice.provider == "cuda.mid"
    assert [r.provider for r in choice.rejected] == ["cuda.unavailable", "cuda.high_but_unsupported"]
    assert "head dim not supported" in table.describe() and "package not installed" in table.describe()


def test_error_lists_every_rejection(fresh_registry):
    _fill_other_ops("mla_decode")
    target = "kernels.torch.mla:mla_decode"
    register(Provider("mla_decode", "cuda.a", "cuda", 10, target, reasons_unsupported=lambda s: ["dtype float64"]))
    register(Provider("mla_decode", "cuda.b", "cuda", 20, target, available=lambda: "no CUDA device"))
    with pytest.raises(NoProviderError) as info:
        select_ops("cuda", OpSpec(TINY, torch.float64, CPU), fallback_to_reference=False)
    assert "cuda.a: dtype float64" in str(info.value) and "cuda.b: no CUDA device" in str(info.value)


def _cli(*args: str, interpret: bool = False) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-m", "k3core.backends", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("vendor, reason", [("cuda", "no CUDA device"), ("rocm", "no ROCm device")])
def test_cli_on_cpu_rejects_every_vendor_provider_and_shows_the_fallback(vendor, reason):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = _cli("--backend", vendor, "--model", "k3-tiny")
    chosen = [line.split("->")[1].strip() for line in out.splitlines() if "->" in line]
    assert len(chosen) == len(OP_NAMES) and all(name.startswith("torch.") for name in chosen)
    rejected = [line for line in out.splitlines() if "rejected" in line]
    assert all(line.split("rejected ")[1].startswith(f"{vendor}.") for line in rejected)
    triton_lines = [line for line in rejected if f"{vendor}.triton." in line]
    assert len(triton_lines) == len(OP_NAMES) - 1 and all(reason in line for line in triton_lines)
    assert f"{vendor}.torch_device.sample" in out and f"fallback to the torch reference for {len(OP_NAMES)} of {len(OP_NAMES)}" in out
    assert "device: no GPU visible" in out


def test_cli_torch_backend_and_interpreted_triton():
    out = _cli("--backend", "torch", "--model", "kimi-linear-48b")
    assert "rejected" not in out and out.count("-> torch.") == len(OP_NAMES)
    bf16 = _cli("--backend", "cuda", "--model", "k3-tiny", interpret=True)
    assert "under TRITON_INTERPRET=1 gives wrong results" in bf16
    fp32 = _cli("--backend", "cuda", "--model", "k3-tiny", "--dtype", "fp32", interpret=True)
    assert "-> cuda.triton.rms_norm" in fp32


def test_import_k3core_and_backends_does_not_import_triton_or_vendor_packages():
    code = ("import sys, k3core, k3core.backend, k3core.backends, backends.cuda, backends.rocm\n"
            "from k3core.backend import load_backend\n"
            "load_backend('cuda'); load_backend('rocm')\n"
            "bad = [m for m in ('triton', 'flashinfer', 'aiter') if m in sys.modules]\n"
            "assert not bad, bad\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_rocm_selects_with_reasons_without_an_amd_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    table = select_ops("rocm", OpSpec(TINY, torch.bfloat16, CPU))
    rejected = {r.provider: r.reasons for c in table.choices.values() for r in c.rejected}
    assert {"rocm.aiter.mla_decode", "rocm.aiter.moe_experts", "rocm.triton.kda_prefill"} <= set(rejected)
    assert all(reasons and all(reasons) for reasons in rejected.values())


def test_reasons_name_the_shape_dtype_and_interpreter(monkeypatch):
    from backends.common import triton_reasons
    from backends.cuda import flashinfer_mla, grouped_mm
    from backends.rocm import aiter_ops
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert any("float64" in r for r in triton_reasons(OpSpec(TINY, torch.float64, CPU)))
    assert any("device is CPU" in r for r in triton_reasons(OpSpec(TINY, torch.float32, CPU)))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_reasons(OpSpec(TINY, torch.float32, CPU)) == []
    assert "TRITON_INTERPRET" in triton_reasons(OpSpec(TINY, torch.bfloat16, CPU))[0]
    gpu = torch.device("cuda")
    assert any("512 + 64" in r for r in flashinfer_mla.reasons(OpSpec(TINY, torch.bfloat16, gpu)))
    assert not any("512" in r for r in flashinfer_mla.reasons(OpSpec(ModelConfig.preset("k3"), torch.bfloat16, gpu)))
    assert any("bfloat16 only" in r for r in grouped_mm.reasons(OpSpec(TINY, torch.float32, gpu)))
    assert any("situ" in r for r in aiter_ops.moe_reasons(OpSpec(TINY, torch.bfloat16, gpu)))


@pytest.mark.parametrize("label", ["silu-T15-E4-k2", "situ-EP-T65-E4-k3", "empty-batch"])
def test_grouped_mm_adapter_matches_the_oracle_on_cpu(label):
    """The adapter's sorting, offsets, expert-parallel masking and float32 sum, checked where no GPU exists."""
    from conformance.cases import CASES
    from conformance.runner import run_case
    case = next(c for c in CASES if c.op == "moe_experts" and c.label == label)
    adapter = Provider("moe_experts", "cuda.grouped_mm.moe_experts(cpu)", "cuda", 0,
                       "backends.cuda.grouped_mm:moe_experts")
    seed = random.SystemRandom().randrange(2**31)
    result = run_case(case, adapter, torch.float32, CPU, seed)
    assert result.status == "passed", (seed, result.reason, [c.detail for c in result.checks])


def test_graph_capture_on_cpu_says_why():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from backends import cuda, rocm
    from backends.common_graphs import GraphCaptureUnavailable
    for vendor in (cuda, rocm):
        with pytest.raises(GraphCaptureUnavailable, match="needs a CUDA or ROCm GPU"):
            vendor.graph_runner(lambda x: x * 2, buckets=[1, 8])


def test_device_facts_on_cpu_is_none():
    from backends.common import device_facts
    assert (device_facts() is None) == (not torch.cuda.is_available())


def test_falling_back_to_a_reference_is_said_out_loud(caplog):
    """A vendor backend that cannot serve an op runs the torch reference under the reference's own name and warns."""
    import logging

    import torch

    from k3core.backend import OpSpec, select_ops
    from k3core.config import ModelConfig
    spec = OpSpec(ModelConfig.preset("k3-tiny"), torch.bfloat16, torch.device("cpu"))   # bf16: never interpreted
    with caplog.at_level(logging.WARNING, logger="k3core.backend"):
        table = select_ops("cuda", spec)
    assert table.choices["kda_prefill"].provider == "torch.kda_prefill"
    assert any("torch reference runs instead" in r.message and "kda_prefill" in r.message for r in caplog.records)
