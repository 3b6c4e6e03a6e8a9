"""The PTX pair decode of the MXFP4 swap kernel (`_ASM_PAIR_DECODE`: the `asm_decode` tiles, sm_90's defaults).

No GPU runs here, so the asm text itself is executed by a small interpreter of the instructions it uses (mov, cvt,
prmt, shl, and, or, mul.rn.bf16x2, with PTX's semantics) on every byte and on the scale bytes at and around the E8M0
extremes, and compared bit for bit with the float64 reference (`k3core.model.mxfp4`) rounded to bf16: a wrong
shift, mask, byte selector or operand number fails here. What it cannot check is the hardware (e.g. that bf16x2
multiplies keep subnormals); the GPU sweep checks every asm tile against float64 and the extremes before timing it.
"""
from __future__ import annotations

import re

import pytest
import torch
import triton
import triton.language as tl

from k3core.model.mxfp4 import _code_table, _scale_table
from kernels.triton import moe_mxfp4
from kernels.triton.moe_mxfp4_operands import (
    _ASM_PAIR_DECODE,
    _ASM_PAIR_DECODE_FOLDED,
    FOLD_MAX_SCALE,
    _e8m0_bf16_bits,
    _e8m0_bf16_folded_bits,
)

MASK32 = 0xFFFFFFFF


def _bf16_to_float(bits: int) -> float:
    return torch.tensor([bits - (1 << 16) if bits & 0x8000 else bits], dtype=torch.int16).view(torch.bfloat16).double().item()


def _float_to_bf16(value: float) -> int:
    return torch.tensor([value], dtype=torch.float64).to(torch.bfloat16).view(torch.int16).item() & 0xFFFF


def _operand(token: str, regs: dict[str, int]) -> int:
    token = token.strip()
    if token.startswith("0x"):
        return int(token, 16)
    return int(token) if token.isdigit() else regs[token]


def run_ptx(text: str, regs: dict[str, int]) -> dict[str, int]:
    """Execute the asm's instructions on 32-bit registers (`$n` and its .reg names)."""
    body = text.split("{", 1)[1].rsplit("}", 1)[0]
    for statement in filter(None, (s.strip() for s in body.split(";"))):
        if statement.startswith(".reg"):
            continue
        op, args = statement.split(None, 1)
        dst, *src = [a.strip() for a in args.split(",")]
        vals = [_operand(s, regs) for s in src]
        if op == "mov.b32":
            out = vals[0]
        elif op == "cvt.u32.u16":            # zero-extend the 16-bit operand
            out = vals[0] & 0xFFFF
        elif op == "shl.b32":
            out = (vals[0] << vals[1]) & MASK32
        elif op == "shr.b32":                # logical
            out = vals[0] >> vals[1]
        elif op == "mul.lo.u32":             # the low 32 bits of the product
            out = (vals[0] * vals[1]) & MASK32
        elif op == "and.b32":
            out = vals[0] & vals[1]
        elif op == "or.b32":
            out = vals[0] | vals[1]
        elif op == "prmt.b32":               # default mode: byte i of d = byte sel_i of the 8-byte {b, a}
            pool = vals[0] | (vals[1] << 32)
            out = 0
            for i in range(4):
                selector = (vals[2] >> (4 * i)) & 0xF
                byte = (pool >> (8 * (selector & 7))) & 0xFF
                if selector & 8:             # sign-replicate mode bit
                    byte = 0xFF if byte & 0x80 else 0
                out |= byte << (8 * i)
        elif op == "mul.rn.bf16x2":          # two bf16 products, round to nearest even, subnormals kept
            out = 0
            for half in (0, 16):
                a = _bf16_to_float((vals[0] >> half) & 0xFFFF)
                b = _bf16_to_float((vals[1] >> half) & 0xFFFF)
                out |= _float_to_bf16(a * b) << half
        else:
            raise AssertionError(f"the interpreter does not know {op!r}: extend it with the PTX semantics")
        regs[dst] = out
    return regs


@triton.jit
def _scale_bits_kernel(scale_ptr, out_ptr, FOLDED: tl.constexpr):
    offsets = tl.arange(0, 256)
    scale = tl.load(scale_ptr + offsets)
    if FOLDED:
        tl.store(out_ptr + offsets, _e8m0_bf16_folded_bits(scale))
    else:
        tl.store(out_ptr + offsets, _e8m0_bf16_bits(scale))


def _all_scale_bits(folded: bool = False) -> list[int]:
    """The kernel's own `_e8m0_bf16_bits` (or `_e8m0_bf16_folded_bits`) on every scale byte (int32 only, so the
    interpreter runs it exactly)."""
    out = torch.zeros(256, dtype=torch.int32)
    _scale_bits_kernel[(1,)](torch.arange(256, dtype=torch.int32), out, FOLDED=folded)
    return out.tolist()


FOLD_SCALES = (0, 1, 2, 64, 100, 119, 126, 127, FOLD_MAX_SCALE)       # every scale the folded decode may see ends


@pytest.mark.parametrize("folded", [False, True], ids=["two-multiplies", "folded"])
def test_every_byte_and_extreme_scale_decodes_to_the_reference_bit_for_bit(folded):
    codes = _code_table(torch.device("cpu"), torch.float64)
    scales = _scale_table(torch.device("cpu"), torch.float64)
    extremes = FOLD_SCALES if folded else (0, 1, 2, 100, 126, 127, 128, 200, 252, 253, 254, 255)
    scale_bits = _all_scale_bits(folded)
    text = (_ASM_PAIR_DECODE_FOLDED if folded else _ASM_PAIR_DECODE).value
    for shift in range(len(extremes)):
        # each of the two elements its own scale byte, so that a swapped scale half shows too
        scale_bytes = [extremes[(shift + i * 5) % len(extremes)] for i in range(2)]
        bits = [scale_bits[b] for b in scale_bytes]
        for first in range(256):                   # every byte in both positions
            packed = [first, (7 * first + 1 + 37 * shift) % 256]
            # bits above the 16-bit operand set, as the 32-bit register behind it may have: the asm must drop them
            regs = run_ptx(text, {"$2": 0xA5C30000 | packed[0] | packed[1] << 8, "$3": bits[0] | bits[1] << 16})
            got_low = [regs["$0"] & 0xFFFF, regs["$0"] >> 16]
            got_high = [regs["$1"] & 0xFFFF, regs["$1"] >> 16]
            for byte, scale_byte, low, high in zip(packed, scale_bytes, got_low, got_high):
                want_low = _float_to_bf16(codes[byte & 15].item() * scales[scale_byte].item())
                want_high = _float_to_bf16(codes[byte >> 4].item() * scales[scale_byte].item())
                assert (low, high) == (want_low, want_high), (scale_byte, byte, hex(low), hex(high),
                                                               hex(want_low), hex(want_high))


def test_e8m0_bf16_bits_are_the_exact_scales():
    """The scale bits the asm is fed (the kernel's `_e8m0_bf16_bits`, run here) are the reference's scales in bf16,
    every byte."""
    scales = _scale_table(torch.device("cpu"), torch.float64)
    for byte, bits in enumerate(_all_scale_bits()):
        assert bits == _float_to_bf16(scales[byte].item()), byte


def test_folded_scale_bits_are_2_to_the_126_times_the_scale():
    """The folded decode's scale operand (`_e8m0_bf16_folded_bits`, run here): 2^126 x the reference's scale,
    exactly, for every byte up to FOLD_MAX_SCALE; one multiply of the folded asm fewer per pair than the other."""
    scales = _scale_table(torch.device("cpu"), torch.float64)
    bits = _all_scale_bits(folded=True)
    for byte in range(FOLD_MAX_SCALE + 1):
        assert bits[byte] == _float_to_bf16(scales[byte].item() * 2.0 ** 126), byte
    count = lambda text: text.count("mul.rn.bf16x2")  # noqa: E731
    assert (count(_ASM_PAIR_DECODE.value), count(_ASM_PAIR_DECODE_FOLDED.value)) == (4, 2)


@pytest.mark.parametrize("text", [_ASM_PAIR_DECODE, _ASM_PAIR_DECODE_FOLDED], ids=["two-multiplies", "folded"])
def test_the_asm_uses_only_the_operands_its_constraints_declare(text):
    """2 outputs ($0, $1: one bf16 pair per tile) and 2 inputs ($2 two bytes, $3 their scales), as the call
    declares."""
    used = set(re.findall(r"\$(\d+)", text.value))
    assert used == {str(i) for i in range(4)}


def test_asm_tiles_are_checked_and_refused_where_they_cannot_run():
    Tile = moe_mxfp4.Mxfp4Tile
    with pytest.raises(ValueError, match="swap kernel"):
        moe_mxfp4.check_tile(Tile(16, 64, 128, 4, 3, asm_decode=True))
    with pytest.raises(ValueError, match="decode of its own"):
        moe_mxfp4.check_tile(Tile(16, 64, 128, 4, 3, swap=True, half_math=True, asm_decode=True))
    with pytest.raises(ValueError, match="gemv"):
        moe_mxfp4.check_tile(Tile(1, 64, 128, 4, 3, gemv=True, asm_decode=True))
    gen = torch.Generator().manual_seed(3)
    experts, dim, inter = 2, 64, 32
    w13p = torch.randint(0, 256, (experts, 2 * inter, dim // 2), dtype=torch.uint8, generator=gen)
    w13s = torch.full((experts, 2 * inter, dim // 32), 127, dtype=torch.uint8)
    w2p = torch.randint(0, 256, (experts, dim, inter // 2), dtype=torch.uint8, generator=gen)
    w2s = torch.full((experts, dim, inter // 32), 127, dtype=torch.uint8)
    x, ids, weights = torch.randn(3, dim), torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1)
    with pytest.raises(ValueError, match="asm_decode is NVIDIA PTX"):
        moe_mxfp4.moe_experts_mxfp4(x.bfloat16(), w13p, w13s, w2p, w2s, weights, ids, "silu", None, None,
                                    tile=Tile(16, 32, 64, 1, 1, swap=True, asm_decode=True))


def test_asm_tiles_compile_for_sm90_without_spills():
    """ptxas accepts the asm (and the folded asm) inside both swap kernels at K3's prefill and decode-batch shapes
    (offline, in a subprocess: conftest.py's TRITON_INTERPRET=1 gives interpreter stand-ins that cannot compile)."""
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    code = textwrap.dedent("""
        import torch
        from backends.offline import capture, compile_launch, offline_target
        from kernels.triton.moe_mxfp4 import Mxfp4Tile, moe_experts_mxfp4
        target = offline_target("sm_90")
        E, D, I, T, K = 8, 3584, 3072, 256, 16
        x = torch.randn(T, D, dtype=torch.bfloat16)
        w13p = torch.zeros(E, 2 * I, D // 2, dtype=torch.uint8); w13s = torch.zeros(E, 2 * I, D // 32, dtype=torch.uint8)
        w2p = torch.zeros(E, D, I // 2, dtype=torch.uint8); w2s = torch.zeros(E, D, I // 32, dtype=torch.uint8)
        ids, wts = torch.randint(0, E, (T, K)), torch.rand(T, K)
        for tile, max_scale in ((Mxfp4Tile(128, 64, 64, 4, 3, swap=True, split_x=True, asm_decode=True), None),
                                (Mxfp4Tile(16, 64, 128, 4, 3, swap=True, asm_decode=True), None),
                                (Mxfp4Tile(16, 64, 128, 4, 3, swap=True, asm_decode=True), 127)):
            with capture(target) as recorder:
                moe_experts_mxfp4(x, w13p, w13s, w2p, w2s, wts, ids, "situ", 4.0, 25.0, tile=tile,
                                  max_scale=max_scale)
            for _, launch in recorder.launches:
                if "swap" in str(launch.fn):
                    result = compile_launch(launch, target)
                    print("ok" if not result.error and result.resources.scratch_bytes == 0 else
                          f"FAIL {result.error or result.resources}")
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root)
    run = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["ok"] * 6, run.stdout[-2000:]
