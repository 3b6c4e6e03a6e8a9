"""tools.tune.kernel_profile's ranking: per-step totals, groups and the busy share from a known list of kernel launches
(the profiler capture itself needs CUDA and runs inside bench.model_bench on the GPU)."""
from __future__ import annotations

import pytest
import torch

from tools.tune.kernel_profile import group_of, markdown, profile_kernels, rank


def test_rank_sums_per_step_groups_and_orders_by_time():
    launches = [("nvjet_tst_128x64_bf16", 50.0), ("kda_decode_kernel", 10.0), ("nvjet_tst_128x64_bf16", 30.0),
                ("void at::native::elementwise_kernel<...>", 2.0)] * 2          # two steps
    result = rank(launches, steps=2, step_ms=0.2)
    assert result["kernel_us_per_step"] == pytest.approx(92.0)
    assert result["launches_per_step"] == 4
    top = result["top"][0]
    assert (top["kernel"], top["us_per_step"], top["calls_per_step"]) == ("nvjet_tst_128x64_bf16", 80.0, 2)
    assert [r["us_per_step"] for r in result["top"]] == sorted((r["us_per_step"] for r in result["top"]),
                                                             reverse=True)
    groups = {g["group"]: g["us_per_step"] for g in result["groups"]}
    assert groups == {"gemm (cuBLAS/CUTLASS)": 80.0, "kda + short conv": 10.0,
                      "torch elementwise/reduce/copy": 2.0}
    assert sum(g["share"] for g in result["groups"]) == pytest.approx(1.0)
    assert result["busy_share"] == pytest.approx(92.0 / 200.0)
    text = "\n".join(markdown(result, "decode"))
    assert "46%" in text and "`nvjet_tst_128x64_bf16`" in text


MOE = "moe (Triton experts, bookkeeping, combine)"


@pytest.mark.parametrize("name,group", [("mla_decode_split_kernel", "mla"), ("moe_experts_kernel", MOE),
                                        ("_gate_up_kernel", MOE), ("_group_pairs_kernel", MOE),
                                        ("_short_conv_decode", "kda + short conv"), ("rms_norm_kernel", "norm"),
                                        ("sm90_xmma_gemm_bf16", "gemm (cuBLAS/CUTLASS)"), ("mystery", "other")])
def test_group_of(name, group):
    assert group_of(name) == group


def test_every_moe_kernel_is_grouped_as_moe():
    """The expert kernels' names come from their sources, so a new variant (the Gluon decode was reported as
    'other' on the H100) cannot fall out of the moe group unnoticed."""
    import re
    from pathlib import Path
    names = set()
    for source in Path(__file__).parent.parent.joinpath("kernels", "triton").glob("moe*.py"):
        names |= set(re.findall(r"^def (\w+_kernel)\(", source.read_text(), flags=re.M))
    assert {"gate_up_gluon_kernel", "down_wgmma_kernel", "_down_swap_kernel"} <= names
    assert {name: group_of(name) for name in names} == {name: MOE for name in names}


def test_rank_and_profile_refuse_what_they_cannot_measure():
    with pytest.raises(ValueError, match="steps"):
        rank([], steps=0, step_ms=None)
    with pytest.raises(ValueError, match="CUDA kernels"):
        profile_kernels(lambda: None, torch.device("cpu"))
