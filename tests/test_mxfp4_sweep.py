"""bench/moe_mxfp4_sweep.py runs end to end on the CPU (--smoke): every tile is checked against the float64
reference before it is timed, a tile whose check fails is refused, and the winner is printed as a table line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from bench import moe_mxfp4_sweep  # noqa: E402


def test_smoke_sweep_times_checked_tiles_and_refuses_a_wrong_one(tmp_path, monkeypatch, capsys):
    real = moe_mxfp4_sweep.load

    def load(target):
        fn = real(target)
        if target == "kernels.triton.moe_mxfp4:moe_experts_mxfp4":
            def op(*args, tile, **kw):                                  # the swap tile without split_x is wrong
                out = fn(*args, tile=tile, **kw)
                return torch.zeros_like(out) if tile.swap and not tile.split_x else out
            return op
        return fn

    monkeypatch.setattr(moe_mxfp4_sweep, "load", load)
    monkeypatch.setattr(moe_mxfp4_sweep, "SMOKE_TOKENS", (3,))
    results = moe_mxfp4_sweep.main(["--smoke", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "moe-mxfp4-sweep-smoke.json").read_text())
    assert [r["status"] for r in data["results"]] == ["ok", "check failed", "ok", "ok"] == [r.status for r in results]
    refused = data["results"][1]
    assert refused["tile"][5:7] == [True, False] and refused["ms"] is None and refused["speedup"] is None
    assert all(r["ms"] > 0 and r["error"] <= moe_mxfp4_sweep.SMOKE_TOL for r in data["results"] if r["status"] == "ok")
    winner = data["winners"]["decode"][0]
    assert winner in [r["tile"] for r in data["results"] if r["status"] == "ok"]
    # the winners as a tiles file (K3CORE_MXFP4_TILES, kernels.triton.moe_mxfp4_tuned) and as a --tiles file
    from kernels.triton.moe_mxfp4_tuned import read_tiles_file
    winners_path = tmp_path / "moe-mxfp4-winners-smoke.json"
    tiles, tails = read_tiles_file(str(winners_path))
    assert list(tiles["decode"]) == winner and tails == {}
    assert moe_mxfp4_sweep.tiles_from(str(winners_path))["decode"] == [moe_mxfp4_sweep.Candidate(tiles["decode"])]
    printed = capsys.readouterr().out
    assert "CHECK FAILED" in printed and 'paste: "decode": Mxfp4Tile(block_m=' in printed
    assert data["results"][3]["tile"][9] is True                       # the gemv tile was checked and timed


def test_tiles_file_sweeps_only_its_classes_with_tail_tiles_and_refuses_bad_entries(tmp_path, capsys):
    tile = dict(block_m=16, block_n=32, block_k=64, num_warps=1, num_stages=1, swap=True)
    spec = tmp_path / "tiles.json"
    spec.write_text(json.dumps({"mid": [dict(tile, tail=tile)]}))
    results = moe_mxfp4_sweep.main(["--smoke", "--out", str(tmp_path), "--tiles", str(spec), "--tokens", "2,40"])
    assert [(r.case, r.status) for r in results] == [("prefill T=40", "ok")]    # T=2 is a decode case: not named
    assert results[0].tail == list(moe_mxfp4_sweep.load("kernels.triton.moe_mxfp4:Mxfp4Tile")(**tile))
    printed = capsys.readouterr().out
    assert "+ tail (16, 32, 64" in printed and 'paste into MXFP4_TAIL_TILES_NVIDIA: "mid": Mxfp4Tile(' in printed
    for bad, message in (({"nonsense": []}, "unknown row class 'nonsense'"),
                         ({"mid": [dict(tile, block_q=3)]}, "block_q")):
        spec.write_text(json.dumps(bad))
        with pytest.raises(SystemExit, match=message):
            moe_mxfp4_sweep.main(["--smoke", "--out", str(tmp_path), "--tiles", str(spec)])
    with pytest.raises(SystemExit, match="--tokens"):
        moe_mxfp4_sweep.main(["--smoke", "--out", str(tmp_path), "--tokens", "1,x"])


SWEEPS = Path(__file__).resolve().parent.parent / "bench" / "sweeps"
# Sweep files that record an experiment whose option was since removed (kept as the record of what was timed).
RETIRED_SWEEPS = {"gluon-occupancy.json": "prefetch on a gluon tile (ee75b11, removed after its run)"}


@pytest.mark.parametrize("path", sorted(p.name for p in SWEEPS.glob("*.json")))
def test_every_sweep_file_parses_and_every_tile_passes_the_tile_rules(path):
    """A pending sweep (bench/sweeps/*.json, named in moe_mxfp4_tiles' comments for the next GPU session) with a
    tile the rules refuse would spend device time on an error row: each must load and pass `check_tile`."""
    from kernels.triton.moe_mxfp4 import check_tile
    spec = moe_mxfp4_sweep.tiles_from(str(SWEEPS / path))
    refused = []
    for candidates in spec.values():
        for candidate in candidates:
            for tile in filter(None, (candidate.tile, candidate.tail)):
                try:
                    check_tile(tile)
                except ValueError as exc:
                    refused.append(str(exc))
    assert bool(refused) == (path in RETIRED_SWEEPS), refused[:3]


def test_several_tiles_files_join_per_class_in_order_without_repeats(tmp_path):
    """`--tiles A,B`: one process for two pending sweeps (one device call); a tile named in both files, or twice in
    one, runs once, where it first appeared."""
    tile = dict(block_m=16, block_n=32, block_k=64, num_warps=1, num_stages=1)
    other, third = dict(tile, swap=True), dict(tile, block_m=32)
    (tmp_path / "a.json").write_text(json.dumps({"mid": [tile, other, tile], "decode": [tile]}))
    (tmp_path / "b.json").write_text(json.dumps({"mid": [third, other], "prefill": [dict(tile, tail=tile)]}))
    joined = moe_mxfp4_sweep.tiles_from(f"{tmp_path / 'a.json'},{tmp_path / 'b.json'}")
    make = moe_mxfp4_sweep.load("kernels.triton.moe_mxfp4:Mxfp4Tile")
    assert [c.tile for c in joined["mid"]] == [make(**tile), make(**other), make(**third)]
    assert list(joined) == ["mid", "decode", "prefill"] and joined["prefill"][0].tail == make(**tile)
    with pytest.raises(SystemExit, match="missing.json: no such file"):
        moe_mxfp4_sweep.tiles_from(f"{tmp_path / 'a.json'},{tmp_path / 'missing.json'}")
    (tmp_path / "c.json").write_text("{\"mid\": [")
    with pytest.raises(SystemExit, match="c.json: not JSON"):
        moe_mxfp4_sweep.tiles_from(str(tmp_path / "c.json"))


def test_a_tile_that_ends_the_cuda_context_stops_the_sweep_with_its_results_written(tmp_path, monkeypatch):
    """After a kernel fault every later call of the process fails: the sweep stops at the faulting tile, names it,
    and keeps the rows it finished (here the first smoke tile's), instead of filling the file with error rows."""
    real = moe_mxfp4_sweep.load
    faulted = []

    def load(target):
        fn = real(target)
        if target == "kernels.triton.moe_mxfp4:moe_experts_mxfp4":
            def op(*args, tile, **kw):
                if tile.swap and not tile.split_x:                      # the second smoke tile faults
                    faulted.append(tile)
                    raise RuntimeError("CUDA error: an illegal memory access was encountered")
                return fn(*args, tile=tile, **kw)
            return op
        return fn

    monkeypatch.setattr(moe_mxfp4_sweep, "load", load)
    monkeypatch.setattr(moe_mxfp4_sweep, "_device_lost", lambda device: "AcceleratorError: illegal address"
                        if faulted else "")
    monkeypatch.setattr(moe_mxfp4_sweep, "SMOKE_TOKENS", (3, 40))
    with pytest.raises(SystemExit, match=r"sweep stopped: \(16, .*decode T=3\) ended the CUDA context"):
        moe_mxfp4_sweep.main(["--smoke", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "moe-mxfp4-sweep-smoke.json").read_text())
    assert [(r["case"], r["status"]) for r in data["results"]] == [("decode T=3", "ok"), ("decode T=3", "error")]
    assert "did not run" in data["meta"]["aborted"] and len(faulted) == 1


def test_no_winners_file_while_no_tile_has_passed(tmp_path, monkeypatch):
    """gpu.sh mxfp4-adopt adopts the winners file: when every tile fails its check there is none to adopt, and no
    file (an empty one would only be refused by every call that reads it)."""
    real = moe_mxfp4_sweep.load

    def load(target):
        fn = real(target)
        if target == "kernels.triton.moe_mxfp4:moe_experts_mxfp4":
            return lambda *args, **kw: torch.zeros_like(fn(*args, **kw))
        return fn

    monkeypatch.setattr(moe_mxfp4_sweep, "load", load)
    monkeypatch.setattr(moe_mxfp4_sweep, "SMOKE_TOKENS", (3,))
    results = moe_mxfp4_sweep.main(["--smoke", "--out", str(tmp_path)])
    assert results and all(r.status == "check failed" for r in results)
    assert (tmp_path / "moe-mxfp4-sweep-smoke.json").exists()
    assert not (tmp_path / "moe-mxfp4-winners-smoke.json").exists()
