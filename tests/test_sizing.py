"""Sizing: K3's published figures and hand-computed state sizes, and the capacity formula on a made-up GPU.

Published figures (K3_ARCHITECTURE.md §1.4, §5): 2779.9B total (Hugging Face's count, which also holds the
~0.4B MoonViT vision tower this text-only table does not), ~104B active, 24 x 576 x 2 B of MLA KV per token,
69 x 12 x 128 x 128 x 4 B of KDA state per request per GPU at TP8.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from k3core.config import ModelConfig
from k3core.model.weights import count_parameters
from k3core.sizing import capacity, main as sizing_main, parse_bytes, state_sizes, weight_bytes


@pytest.fixture(scope="module")
def k3():
    return ModelConfig.preset("k3")


def test_k3_parameter_counts(k3):
    count = count_parameters(k3)
    assert count.total == pytest.approx(2779.9e9, rel=0.01)
    assert count.active == pytest.approx(104e9, rel=0.03)
    # routed experts alone: 92 layers x 896 experts x 3 matrices x 3584 x 3072 (§1.4)
    assert count.total - count.active == 92 * (896 - 16) * 3 * 3584 * 3072


def test_k3_state_sizes_at_tp8(k3):
    sizes = state_sizes(k3, tp=8)
    assert sizes.mla_bytes_per_token == 24 * 576 * 2 == 27648            # "27 KB": TP does not split the latent
    assert sizes.kda_state_bytes_per_request == 69 * 12 * 128 * 128 * 4   # ~54 MB
    assert sizes.kda_state_bytes_per_request == pytest.approx(54e6, rel=0.01)
    assert sizes.kda_conv_bytes_per_request == 69 * 3 * (3 * 12 * 128) * 2
    assert state_sizes(k3, tp=8, dcp=8).mla_bytes_per_token == 27648 / 8
    # the whole TP group holds the §5.1 figure: 69 x (96*128*128*4 + 3*36864*2) B ~ 449 MB
    assert 8 * sizes.kda_bytes_per_request == 69 * (96 * 128 * 128 * 4 + 3 * 36864 * 2)


def test_kimi_linear_state_sizes_by_hand():
    config = ModelConfig.preset("kimi-linear-48b")
    sizes = state_sizes(config, tp=2, kv_dtype="fp8", state_dtype="bf16")
    assert sizes.mla_bytes_per_token == 7 * 576 * 1
    assert sizes.kda_state_bytes_per_request == 20 * 16 * 128 * 128 * 2


def test_tp_must_divide_heads(k3):
    with pytest.raises(ValueError, match="tp=5 does not divide the 96 KDA heads"):
        state_sizes(k3, tp=5)


def test_weight_bytes_mxfp4_experts(k3):
    count = count_parameters(k3)
    experts = 92 * 896 * 3 * 3584 * 3072
    fp32_numel = 69 * (3 * 12288 * 4 + 12288 + 96) + 92 * 896      # convs, dt_bias, A_log, router bias
    fp32_numel += 92 * 896 * 7168                                       # the router, held in float32
    want = experts * 4.25 / 8 + (count.total - experts - fp32_numel) * 2 + fp32_numel * 4
    want += 69 * (-(4 * 12288 + 128 + 96) % 128) * 7168 * 2           # KDA's fused rows padded to 128s (32 each)
    assert weight_bytes(k3, expert_format="mxfp4") == pytest.approx(want, rel=1e-12)


def test_capacity_formula_on_round_numbers():
    config = ModelConfig.preset("k3-tiny")
    sizes = state_sizes(config)
    weights = weight_bytes(config)
    gpu = 10e6
    cap = capacity(config, gpu, mem_fraction=0.5, activation_reserve_bytes=1e6, max_requests=3)
    budget = gpu * 0.5 - weights - 1e6 - 3 * sizes.kda_bytes_per_request
    assert cap.kv_budget_bytes == pytest.approx(budget)
    assert cap.tokens == int(budget // sizes.mla_bytes_per_token)
    assert capacity(config, 1e3).tokens == 0                      # weights do not fit: no context, not a negative one


def test_k3_capacity_on_gb300(k3):
    # The write-up reports ~1.5M tokens at TP8 and ~12.2M with DCP8 on 288 GB GPUs; with k3core's stated defaults
    # (90% of memory, 8 GiB activations, 256 KDA slots) the formula gives 1.49M and 11.9M. The DCP8/TP8 ratio is the
    # dcp factor exactly, because DCP splits only the MLA latent.
    tp8 = capacity(k3, parse_bytes("288GB"), tp=8, expert_format="mxfp4")
    dcp8 = capacity(k3, parse_bytes("288GB"), tp=8, dcp=8, expert_format="mxfp4")
    assert tp8.tokens == pytest.approx(1.5e6, rel=0.05)
    assert dcp8.tokens == pytest.approx(12.2e6, rel=0.05)
    assert dcp8.kv_budget_bytes == tp8.kv_budget_bytes


def test_parse_bytes():
    assert parse_bytes("288GB") == 288e9
    assert parse_bytes("80GiB") == 80 * 2 ** 30
    assert parse_bytes("1.5 TB") == 1.5e12
    with pytest.raises(Exception, match="cannot read"):
        parse_bytes("lots")


def test_cli_prints_the_figures(capsys):
    sizing_main(["--model", "k3", "--tp", "8", "--dcp", "8", "--gpu-memory", "288GB"])
    out = capsys.readouterr().out
    assert "total 2779.5B" in out and "active 105.4B" in out
    assert "3456 B" in out and "54.26 MB" in out and "MLA context capacity" in out
    with pytest.raises(SystemExit):
        sizing_main(["--model", "k3", "--tp", "7"])


@pytest.mark.parametrize("module", ["k3core.sizing", "k3core.config"])
def test_documented_command_runs(module):
    # `python -m k3core.sizing` is the command the README gives; `python -m k3core.config` the one issue 24 names
    # (it once exited 0 having printed nothing)
    done = subprocess.run([sys.executable, "-m", module, "--model", "k3", "--tp", "8", "--gpu-memory", "288GB"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "total 2779.5B" in done.stdout and "plan: fits on 288.00 GB GPUs" in done.stdout
