"""K3CORE_MXFP4_TILES (`kernels.triton.moe_mxfp4_tuned`): a tiles file replaces its classes of the sm_90 table and
nothing else, the op launches what the file names, bad files and a variable that cannot apply are refused by name,
and results record the file they ran with."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
from kernels.triton import moe_mxfp4, moe_mxfp4_tuned  # noqa: E402
from kernels.triton.tuning_ops import AssumedDevice, assume_device  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SM90 = AssumedDevice("nvidia", "sm_90", 132)
CPU = torch.device("cpu")
GLUON_16 = dict(block_m=16, block_n=64, block_k=256, num_warps=4, num_stages=1, swap=True, asm_decode=True,
                presplit=True, stacked=True, gluon=True, stream=True, coalesced_x=True, coalesced_w=True)
SWAP_64 = dict(block_m=64, block_n=64, block_k=256, num_warps=4, num_stages=2, swap=True, asm_decode=True,
               presplit=True, stacked=True)
SWAP_32 = dict(SWAP_64, block_m=32)


def _tile(fields: dict) -> moe_mxfp4.Mxfp4Tile:
    return moe_mxfp4.Mxfp4Tile(**fields)


def test_a_tiles_file_replaces_its_classes_and_nothing_else(tmp_path, monkeypatch):
    path = tmp_path / "winners.json"
    path.write_text(json.dumps({"decode_batch": GLUON_16, "prefill": dict(SWAP_64, tail=SWAP_32)}))
    committed = dict(moe_mxfp4.MXFP4_TILES_NVIDIA)
    monkeypatch.setenv("K3CORE_MXFP4_TILES", str(path))
    with assume_device(SM90):
        assert moe_mxfp4.mxfp4_tile(CPU, 16 * 64, 112, 2, torch.bfloat16, (3584, 3072)) == _tile(GLUON_16)
        prefill = moe_mxfp4.mxfp4_tile(CPU, 16384, 112, 2, torch.bfloat16, (3584, 3072))
        assert prefill == _tile(SWAP_64)
        assert moe_mxfp4.mxfp4_tail_tile(CPU, prefill, 16384, 112, torch.bfloat16) == _tile(SWAP_32)
        for pairs, row_class in ((16, "decode_thin"), (16 * 16, "decode"), (112 * 40, "mid")):
            assert moe_mxfp4.mxfp4_tile(CPU, pairs, 112, 2, torch.bfloat16) == committed[row_class]
        # the stand-ins still apply to the file's gluon tile: other widths and fp16 take the class's swap tile
        swap = moe_mxfp4.SWAP_TILES_NVIDIA["decode_batch"]
        assert moe_mxfp4.mxfp4_tile(CPU, 16 * 64, 112, 2, torch.bfloat16, (3584, 3072 + 32)) == swap
        # a rewritten file is read again, and an unset variable gives the committed table back
        path.write_text(json.dumps({"decode_batch": dict(GLUON_16, coalesced_w=False, half_blocks=True)}))
        os.utime(path, ns=(1, 1))
        assert moe_mxfp4.mxfp4_tile(CPU, 16 * 64, 112, 2, torch.bfloat16).half_blocks
        assert moe_mxfp4.mxfp4_tail_tile(CPU, prefill, 16384, 112, torch.bfloat16) is None
        monkeypatch.delenv("K3CORE_MXFP4_TILES")
        assert moe_mxfp4.mxfp4_tile(CPU, 16 * 64, 112, 2, torch.bfloat16) == committed["decode_batch"]
    assert moe_mxfp4.MXFP4_TILES_NVIDIA == committed                         # never written into


@pytest.mark.parametrize("content, message", [
    ({"decode_huge": GLUON_16}, "unknown row class 'decode_huge'"),
    ({"decode": dict(GLUON_16, block_q=3)}, "block_q is not an Mxfp4Tile field"),
    ({"decode": {"block_m": 16}}, "missing 4 required"),
    ({"decode": dict(GLUON_16, coalesced_x=False)}, "coalesced_w reorders x"),        # check_tile's rule
    ({"decode": [GLUON_16]}, "expected an object of Mxfp4Tile fields"),            # a --tiles list, not a tile
    ({"prefill": dict(SWAP_64, tail=dict(SWAP_32, tail_m=8))}, "prefill tail: .*tail_m"),
    ([], "expected a JSON object from row class"),
    ("not json", "not a readable JSON file"),
    (None, "no such file"),
])
def test_a_bad_tiles_file_is_refused_naming_the_variable_and_the_fault(tmp_path, monkeypatch, content, message):
    path = tmp_path / "tiles.json"
    if content is not None:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    monkeypatch.setenv("K3CORE_MXFP4_TILES", str(path))
    with assume_device(SM90), pytest.raises(ValueError, match=message) as raised:
        moe_mxfp4.mxfp4_tile(CPU, 16 * 16, 112, 2, torch.bfloat16)
    assert f"K3CORE_MXFP4_TILES={path}" in str(raised.value)


@pytest.mark.parametrize("device, where", [(None, "runs on interpreter"),
                                           (AssumedDevice("amd", "gfx942", 304), "runs on amd \\(gfx942\\)"),
                                           (AssumedDevice("nvidia", "sm_100", 148), "runs on nvidia \\(sm_100\\)")])
def test_the_variable_is_refused_where_the_table_is_never_read(tmp_path, monkeypatch, device, where):
    path = tmp_path / "winners.json"
    path.write_text(json.dumps({"decode": GLUON_16}))
    monkeypatch.setenv("K3CORE_MXFP4_TILES", str(path))
    with pytest.raises(ValueError, match=f"replaces MXFP4_TILES_NVIDIA.*{where}.*unset K3CORE_MXFP4_TILES"):
        if device is None:
            moe_mxfp4.mxfp4_tile(CPU, 16, 112, 2, torch.bfloat16)
        else:
            with assume_device(device):
                moe_mxfp4.mxfp4_tile(CPU, 16, 112, 2, torch.bfloat16)


def test_the_op_launches_the_files_tile_on_sm90(tmp_path):
    """Through the op (offline sm_90 capture, in a subprocess with the variable in its environment, as a server
    would have it): the 64-token call launches the Gluon kernels with the file's layout options, where the committed
    decode_batch tile is the swap kernel."""
    assert not moe_mxfp4.MXFP4_TILES_NVIDIA["decode_batch"].gluon
    path = tmp_path / "winners.json"
    path.write_text(json.dumps({"decode_batch": GLUON_16}))
    code = textwrap.dedent("""
        import torch
        from backends.offline import capture, offline_target
        from kernels.triton.moe_mxfp4 import moe_experts_mxfp4
        E, D, I, K, T = 112, 3584, 3072, 16, 64
        w13 = (torch.empty(E, 2 * I, D // 2, dtype=torch.uint8), torch.empty(E, 2 * I, D // 32, dtype=torch.uint8))
        w2 = (torch.empty(E, D, I // 2, dtype=torch.uint8), torch.empty(E, D, I // 32, dtype=torch.uint8))
        with capture(offline_target("sm_90")) as recorder:
            moe_experts_mxfp4(torch.empty(T, D, dtype=torch.bfloat16), *w13, *w2, torch.full((T, K), 1 / K),
                              torch.arange(T * K).view(T, K) % E, "situ", 4.0, 25.0, max_scale=120)
        for _, launch in recorder.launches:
            named = {launch.fn.arg_names[p[0]]: v for p, v in launch.constexprs.items()}
            print(launch.kernel, named.get("BLOCK_M"), named.get("COALESCED_X"), named.get("COALESCED_W"))
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), K3CORE_MXFP4_TILES=str(path))
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    launched = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert launched["gate_up_gluon_kernel"] == launched["down_gluon_kernel"] == "16 True True", launched


def test_results_record_the_tiles_file_they_ran_with(tmp_path, monkeypatch):
    from conformance.report import environment as conformance_environment
    from k3core.provenance import TUNING_VARIABLES, tuning_overrides
    assert moe_mxfp4_tuned.TILES_ENV in TUNING_VARIABLES
    monkeypatch.delenv("K3CORE_MXFP4_TILES", raising=False)
    assert tuning_overrides() == {} and "tuning_overrides" not in conformance_environment()
    path = tmp_path / "winners.json"
    path.write_text(json.dumps({"decode": GLUON_16}))
    monkeypatch.setenv("K3CORE_MXFP4_TILES", str(path))
    record = conformance_environment()["tuning_overrides"]["K3CORE_MXFP4_TILES"]
    assert record["path"] == str(path) and record["content"] == {"decode": GLUON_16}
    assert "MXFP4_TILES_NVIDIA" in record["replaces"]
