"""The streamed Gluon MXFP4 pair on a GPU: its down kernel's folded combine against the plain pair's separate
combine launch, bit for bit, and against the float64 reference.

Needs an NVIDIA sm_90+ GPU (Gluon has no interpreter; `bash scripts/gpu.sh conformance` runs this file);
elsewhere every test here is skipped. The stream tile and its plain twin (stream=False) run the same
decode and MMA code, so their rows are the same bits; the fold sums them in the combine kernel's order, so the
outputs must be equal, not merely close. A foreign expert (expert parallelism), a token count the row blocks do
not divide, repeated calls and a CUDA graph replay check that every column block's last program is found, that it
sees every other program's rows, and that it leaves its counter zero.
"""
from __future__ import annotations

import pytest
import torch

from k3core.model.mxfp4 import max_scale_of, quantize_mxfp4

CUDA = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
pytestmark = pytest.mark.skipif(not CUDA, reason="the Gluon kernels run only on an NVIDIA sm_90+ GPU")

EXPERTS, HIDDEN, INTER, TOP_K = 24, 512, 768, 8          # D and I whole 256-column K steps, as Gluon tiles need
ACT = ("situ", 4.0, 25.0)
MAX_SCALE = [None]                                        # the experts' scale bound, set by the fixture


@pytest.fixture(scope="module")
def experts():
    generator = torch.Generator(device="cuda").manual_seed(7)
    packed = []
    for rows, cols in ((2 * INTER, HIDDEN), (HIDDEN, INTER)):
        values = torch.randn(EXPERTS, rows, cols, generator=generator, device="cuda") * cols ** -0.5
        codes, scale = zip(*(quantize_mxfp4(v) for v in values))
        packed += [torch.stack(codes), torch.stack(scale)]
    MAX_SCALE[0] = max_scale_of(packed[1], packed[3])       # measured once, as the model does at load (a host read)
    return packed


def _tiles():
    """The committed fold_combine tile(s), and the decode class's tile with the fold (its 80-register kernel and
    rows past one an expert), whatever the table says for it."""
    from kernels.triton.moe_mxfp4 import MXFP4_TILES_NVIDIA
    tiles = {name: tile for name, tile in MXFP4_TILES_NVIDIA.items() if tile.fold_combine}
    return {**tiles, "decode with the fold": MXFP4_TILES_NVIDIA["decode"]._replace(stream=True, fold_combine=True)}


def _call(x, experts, weights, ids, tile, offset=0):
    from kernels.triton.moe_mxfp4 import moe_experts_mxfp4
    return moe_experts_mxfp4(x, *experts, weights, ids, *ACT, offset, max_scale=MAX_SCALE[0], tile=tile)


def _problem(tokens: int, seed: int, offset: int = 0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=generator, device="cuda").to(torch.bfloat16)
    span = EXPERTS + (4 if offset else 0)                 # with an offset some ids are another rank's
    ids = torch.rand(tokens, span, generator=generator, device="cuda").topk(TOP_K, dim=-1).indices + offset - (
        2 if offset else 0)
    weights = torch.rand(tokens, TOP_K, generator=generator, device="cuda")
    return x, weights, ids


@pytest.mark.parametrize("tokens,offset", [(1, 0), (3, 0), (9, 0), (16, 0), (5, 40)])
def test_the_folded_combine_is_the_plain_pairs_combine_bit_for_bit(experts, tokens, offset):
    from kernels.triton import moe_mxfp4_stream
    tiles = _tiles()
    assert len(tiles) > 1, "no fold_combine tile in MXFP4_TILES_NVIDIA: the committed table's fold goes untested"
    x, weights, ids = _problem(tokens, seed=tokens + offset, offset=offset)
    for name, tile in tiles.items():
        plain = _call(x, experts, weights, ids, tile._replace(stream=False, fold_combine=False), offset)
        for _ in range(3):                                 # a counter left non-zero would stall or skip a call
            fused = _call(x, experts, weights, ids, tile, offset)
            assert torch.equal(fused, plain), (name, (fused.float() - plain.float()).abs().max())
        moe_mxfp4_stream.check_invariants(x.device)


def test_the_folded_combine_agrees_with_the_float64_reference(experts):
    from kernels.torch.moe_mxfp4 import moe_experts_mxfp4 as reference
    x, weights, ids = _problem(4, seed=11)
    want = reference(x.double().cpu(), *(t.cpu() for t in experts), weights.double().cpu(), ids.cpu(), *ACT)
    for name, tile in _tiles().items():
        got = _call(x, experts, weights, ids, tile).double().cpu()
        error = float((got - want).abs().max() / want.abs().max())
        assert error < 2e-2, (name, error)       # bf16 x and output: the op bench's GPU tolerance


def test_the_folded_combine_replays_in_a_cuda_graph(experts):
    from kernels.triton import moe_mxfp4_stream
    x, weights, ids = _problem(2, seed=5)
    for name, tile in _tiles().items():
        eager = _call(x, experts, weights, ids, tile)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            _call(x, experts, weights, ids, tile)          # warm-up on the capture stream (its own counters)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                out = _call(x, experts, weights, ids, tile)
        torch.cuda.current_stream().wait_stream(stream)
        for _ in range(3):
            out.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, eager), name
        moe_mxfp4_stream.check_invariants(x.device)

