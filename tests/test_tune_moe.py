"""tools/tune/tune_moe.py under the interpreter (tiny grid, CPU): every config is checked before it is timed, a wrong or
failing config is reported and never timed, and the results files and paste lines come out. Also the
torch._grouped_mm provider at T=1 with experts that receive no rows, and the shape of the MoE tuning table."""
from __future__ import annotations

import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from tools.tune import tune_moe
from kernels.torch import moe as ref_moe
from kernels.triton import moe_experts, tuning_ops

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke sweep runs on the CPU interpreter")


def test_smoke_sweep_checks_times_and_writes(tmp_path, capsys):
    assert tune_moe.main(["--smoke", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "tune_moe-cpu-smoke.json").read_text())
    shapes = {s["name"]: s for s in payload["shapes"]}
    assert set(shapes) == {"prefill", "decode"}
    for shape in shapes.values():
        trials = shape["trials"]
        # the interpreter's default (block_m 16, 32x32 tiles: not in the grid) for both GEMMs, then 2 block_m x 3 tiles
        # x 2 GEMMs and the fused gate/up tile at both block_m (gate/up only), every one checked (error recorded) and
        # timed, except the two-half tile at block_m 16 (8-row halves), skipped with its reason
        timed = [t for t in trials if t["status"] == "ok"]
        skipped = [t for t in trials if t["status"] == "skipped"]
        assert len(timed) == 14 and all(t["ms"] > 0 for t in timed)
        assert sum(t["block_m"] == 16 and t["tile"][:2] == [32, 32] for t in timed) == 2
        assert len(skipped) == 2 and all(t["block_m"] == 16 and "8 rows" in t["reason"] for t in skipped)
        assert sum(t["tile"][4] == 2 and t["tile"][5] for t in timed) == 2        # two-half, descriptor tiles
        fused = [t for t in trials if t["tile"][6]]
        assert len(fused) == 2 and all(t["gemm"] == "gate_up" and t["status"] == "ok" for t in fused)
        assert all(t["error"] is not None and t["error"] <= tune_moe.FP32_STATE_TOL for t in timed)
        assert shape["best"]["block_m"] in tune_moe.SMOKE_BLOCK_MS
        assert shape["best"]["ms"] <= shape["default_ms"]
        assert set(shape["whole_ms"]) == {"moe_experts (triton, current default)", "grouped_mm provider"}
    assert (tmp_path / "tune_moe-cpu-smoke.md").read_text().startswith("# MoE expert GEMM sweep")
    printed = capsys.readouterr().out
    assert printed.count("paste: \"interpreter\": MoeGemmConfig(block_m=") == 2


def test_a_wrong_kernel_is_reported_and_not_timed(tmp_path, monkeypatch):
    real_down = moe_experts.down

    def off_by_a_bit(*args, **kwargs):
        return real_down(*args, **kwargs) * 1.01          # 1% off: far outside the float32 tolerance
    monkeypatch.setattr(moe_experts, "down", off_by_a_bit)
    assert tune_moe.main(["--smoke", "--only", "decode", "--out", str(tmp_path)]) == 1
    shape = json.loads((tmp_path / "tune_moe-cpu-smoke.json").read_text())["shapes"][0]
    down = [t for t in shape["trials"] if t["gemm"] == "down" and t["status"] != "skipped"]   # (8-row halves)
    assert down and all(t["status"] == "wrong" and t["ms"] is None and "rel err" in t["reason"] for t in down)
    assert shape["best"] is None
    assert not any("moe_experts" in label for label in shape["whole_ms"]), "a wrong op must not be timed"


def test_a_config_that_raises_is_a_result(tmp_path, monkeypatch):
    real_gate_up = moe_experts.gate_up

    def refuse_wide_tiles(*args, **kwargs):
        if args[-1].block_n == 32:
            raise RuntimeError("out of resources: shared memory\nsecond line")
        return real_gate_up(*args, **kwargs)
    monkeypatch.setattr(moe_experts, "gate_up", refuse_wide_tiles)
    assert tune_moe.main(["--smoke", "--only", "decode", "--out", str(tmp_path)]) == 0
    trials = json.loads((tmp_path / "tune_moe-cpu-smoke.json").read_text())["shapes"][0]["trials"]
    failed = [t for t in trials if t["status"] == "error"]
    assert {(t["gemm"], t["tile"][0]) for t in failed} == {("gate_up", 32)}
    assert all(t["reason"] == "RuntimeError: out of resources: shared memory" for t in failed)


@pytest.mark.parametrize("value", ["12", "a,b", "64,40", ","])
def test_block_ms_option_refuses_bad_values(value, tmp_path):
    with pytest.raises(SystemExit, match="--block-ms"):
        tune_moe.main(["--smoke", "--block-ms", value, "--out", str(tmp_path)])


def test_block_ms_option_limits_the_sweep(tmp_path):
    assert tune_moe.main(["--smoke", "--only", "decode", "--block-ms", "32", "--out", str(tmp_path)]) == 0
    trials = json.loads((tmp_path / "tune_moe-cpu-smoke.json").read_text())["shapes"][0]["trials"]
    # the default (block_m 16 under the interpreter) is always measured, the grid only at 32
    assert {t["block_m"] for t in trials} == {16, 32} and sum(t["block_m"] == 16 for t in trials) == 2


def test_fits_skips_configs_that_cannot_run():
    assert tune_moe.fits("down", 64, (128, 64, 8, 3, 1, False), 232448, 2) == ""
    assert "shared memory" in tune_moe.fits("gate_up", 128, (256, 128, 8, 4, 1, False), 232448, 2)
    assert "spill" in tune_moe.fits("gate_up", 128, (256, 32, 4, 3, 2, True), 232448, 2)
    assert "16" in tune_moe.fits("down", 16, (64, 64, 4, 3, 2, False), 232448, 2)
    # 192 rows run only as three 64-row sub-blocks: 192 or 96-row sub-blocks are no tl.arange
    assert tune_moe.fits("down", 192, (256, 64, 16, 3, 3, True), 232448, 2) == ""
    assert "power of two" in tune_moe.fits("down", 192, (256, 64, 16, 3, 2, True), 232448, 2)
    assert "power of two" in tune_moe.fits("down", 192, (128, 64, 8, 3, 1, True), 232448, 2)
    # the fused gate/up tile has one [block_k, 2 * block_n] weight tile and one [sub, 2 * block_n] accumulator per
    # sub-block: the bytes and registers of the two-dot form's two, so the same verdicts
    for tile in ((128, 64, 8, 3, 1, True), (256, 128, 8, 4, 1, False), (256, 32, 4, 3, 2, True)):
        assert tune_moe.fits("gate_up", 128, (*tile, True), 232448, 2) == tune_moe.fits("gate_up", 128, tile,
                                                                                        232448, 2)
    assert tune_moe.fits("gate_up", 128, (128, 64, 8, 3, 1, True, True), 232448, 2) == ""


def test_nvidia_table_has_one_config_per_row_class():
    names = [name for _, name in tuning_ops.MOE_GEMM_ROW_CLASSES]
    assert list(tuning_ops._MOE_GEMM_NVIDIA) == names
    assert tuning_ops.MOE_GEMM_ROW_CLASSES[-1][0] is None
    assert tuning_ops.shape_class(tuning_ops.MOE_GEMM_ROW_CLASSES, 64 * 16) == "rows 257-2048"
    assert tuning_ops.shape_class(tuning_ops.MOE_GEMM_ROW_CLASSES, 1024 * 16) == "rows 2049+"


@pytest.mark.parametrize("num_tokens,expert_offset", [(1, 0), (1, 3), (5, 0)])
def test_grouped_mm_provider_with_idle_experts(num_tokens, expert_offset):
    """T=1 and 5 tokens over 8 local experts at top-2: most experts get no rows (empty groups in offs); with an
    offset some pairs belong to another rank."""
    from backends.cuda.grouped_mm import moe_experts as grouped_mm_experts
    hidden, inter, num_experts, top_k = 32, 16, 8, 2
    x = torch.randn(num_tokens, hidden)
    w13 = torch.randn(num_experts, 2 * inter, hidden) * hidden ** -0.5
    w2 = torch.randn(num_experts, hidden, inter) * inter ** -0.5
    expert_ids = torch.stack([torch.randperm(num_experts + expert_offset)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k)
    out = grouped_mm_experts(x, w13, w2, weights, expert_ids, "situ", 4.0, 25.0, expert_offset)
    expected = ref_moe.moe_experts(x.double(), w13.double(), w2.double(), weights.double(), expert_ids, "situ", 4.0,
                                   25.0, expert_offset)
    # two float32 GEMMs (K = 32 then 16) of unit-scale values and a 2-term float32 sum
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-5)


def test_row_of_pair_inverts_the_sorted_layout():
    """The combine reads each local pair's row through row_of_pair; the tuner checks the GEMMs through it too."""
    num_experts, block_m = 5, 4
    expert_ids = torch.randint(-2, num_experts + 2, (13, 3))          # some pairs on other ranks
    blocks = moe_experts.group_pairs_by_expert(expert_ids, 0, num_experts, block_m)
    flat = expert_ids.reshape(-1)
    local = ((flat >= 0) & (flat < num_experts)).nonzero().flatten()
    assert torch.equal(blocks.sorted_pairs[blocks.row_of_pair[local]], local)
    assert torch.equal(blocks.block_experts[blocks.row_of_pair[local] // block_m], flat[local])


@pytest.mark.parametrize("element_size", [2, 4])
def test_every_nvidia_moe_config_fits_shared_memory_in_its_dtype(monkeypatch, element_size):
    """The tuned bf16 tiles once reached float32 unchanged and asked an H200 for 288 KiB of shared memory."""
    monkeypatch.setattr(tuning_ops, "target", lambda device: "nvidia")
    for rows in (1, 256, 257, 2048, 2049, 16384):
        config = tuning_ops.moe_gemm_config(torch.device("cpu"), rows, element_size)
        for kind, tile in (("gate_up", config.gate_up), ("down", config.down)):
            reason = tune_moe.fits(kind, config.block_m, tuple(tile), 232448, element_size)
            assert reason == "", f"{rows} rows, {kind}, element size {element_size}: {reason}"
            moe_experts._check_tile(tile, config.block_m, kind)      # sub-blocks a power of two of rows
