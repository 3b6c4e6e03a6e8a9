"""kernels.triton.jit_watch records Triton compiles through knobs.runtime.jit_cache_hook, chained to any hook
installed before, and tools.jit_misses lists the ones after a marker line."""
from __future__ import annotations

import pytest

from kernels.triton import jit_watch
from tools import jit_misses


def test_hook_records_chains_and_prints_one_line(monkeypatch, capsys):
    knobs = pytest.importorskip("triton").knobs
    calls = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda *a, **k: calls.append(k) or False)
    seen = jit_watch.print_compiles()

    class Fn:
        module, name = "kernels.triton.x", "k"
    assert knobs.runtime.jit_cache_hook(key="k", repr="k[num_warps=4](a: i32,\n b: fp32)", fn=Fn()) is False
    assert [c.kernel for c in seen] == ["kernels.triton.x.k"] and len(calls) == 1       # the old hook still ran
    line = capsys.readouterr().err.strip()
    assert line.startswith("triton-jit ") and line.endswith("k[num_warps=4](a: i32, b: fp32)") and "\n" not in line


def test_jit_misses_counts_compiles_after_the_marker(tmp_path, capsys):
    log = tmp_path / "log"
    log.write_text("triton-jit 1.000 m.a a[](x)\nengine process ready at 2.000\n"
                   "triton-jit 3.000 m.b b[](y)\ntriton-jit 4.000 m.b b[](z)\n")
    assert jit_misses.main([str(log)]) == 0
    out = capsys.readouterr().out
    assert "3 compiles in all" in out and "2 compiles after" in out and "   2 m.b" in out


def test_specialisation_names_every_argument():
    """Triton 3.6's repr stops after the first argument; the description reads the specialisation data Triton
    itself serialises (here made by Triton's own serialiser), which is what tells two compiles of one kernel apart."""
    pytest.importorskip("triton")
    from types import SimpleNamespace

    from triton.runtime.jit import serialize_specialization_data
    import triton.language as tl
    data = serialize_specialization_data(
        "m.kernel", {"x_ptr": "*fp32", "n": "i32", "m": "i32", "BLOCK": "constexpr"},
        {(2,): 1, (3,): tl.constexpr(64)}, {(0,): [["tt.divisibility", 16]]}, SimpleNamespace(num_warps=4), "key")
    text = jit_watch._describe({"specialization_data": data}, "kernel[num_warps=4, num_stages=2](x_ptr: (")
    assert text == "kernel[num_warps=4, num_stages=2](x_ptr: *fp32 D, n: i32, m=1, BLOCK=64)"
    assert jit_watch._describe(None, "a[](x:\n y)") == "a[](x: y)"      # nothing to read: Triton's repr
