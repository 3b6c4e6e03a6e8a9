"""The graph-capturable decode step: no host reads, padding rows write only scratch, same logits as the model path.

No GPU here, so nothing is captured: the step runs eagerly under a guard that makes every host read of a tensor
raise, and is called twice on static buffers updated in place, exactly as GraphRunner's replay feeds it.
"""
from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch

from k3core import LLM
from k3core.model.batch import SeqWork, build_forward_batch
from k3core.model.graph_decode import GraphDecode, pack_decode_inputs

HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy")
PAGE_SIZE = 16
BUCKET = 8
# The same float32 kernels on the same rows; only the batch around them (padding rows, page-table width, so the
# MLA split count and the MoE row blocks) differs, which reorders float32 sums: ~1e-6 relative, not 1e-2.
LOGIT_TOL = 1e-4
STATE_TOL = 1e-5


class HostReadError(AssertionError):
    pass


@contextlib.contextmanager
def forbid_host_reads():
    """Every torch.Tensor host read raises, except from inside Triton's CPU interpreter (which stands in for the
    GPU here and must read its arguments); kernel wrappers in kernels/triton are checked like everything else."""
    import triton
    triton_dir = os.path.dirname(triton.__file__)
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def guarded(name, original):
        def method(self, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if not caller.startswith(triton_dir):
                raise HostReadError(f"torch.Tensor.{name} read a tensor on the host (called from {caller})")
            return original(self, *args, **kwargs)
        return method

    for name, original in originals.items():
        setattr(torch.Tensor, name, guarded(name, original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def test_guard_catches_host_reads():
    x = torch.ones(2)
    with forbid_host_reads():
        for read in (lambda: x[0].item(), lambda: x.tolist(), lambda: bool(x[0]), lambda: int(x[0]),
                     lambda: x.nonzero(), lambda: x.cpu()):
            with pytest.raises(HostReadError):
                read()
    assert x.tolist() == [1.0, 1.0]                  # restored


@pytest.fixture(scope="module")
def llm():
    # The cuda backend's op table (Triton kernels, interpreted on the CPU in float32): the ops a graph captures.
    model = LLM("k3-tiny", backend="cuda", device="cpu", dtype="float32", seed=5, prefix_cache=False,
                memory_bytes=4 << 20)
    assert model.ops.choices["kda_decode"].provider.startswith("cuda.triton"), model.ops.describe()
    return model


def _random_sequences(pool, prefix_lens: list[int], generator: torch.Generator):
    """Allocate a slot and pages per sequence and fill the state and the cached latents with random values."""
    sequences = []
    for prefix in prefix_lens:
        slot = pool.alloc_slot()
        pages = pool.alloc_pages(-(-(prefix + 2) // PAGE_SIZE))     # room for two decode steps
        sequences.append((pool.slot_position(slot), pool.page_positions(pages)))
    layout = pool.layout
    for slot_position, page_positions in sequences:
        for layer in range(layout.num_kda_layers):
            state = pool.kda_state(layer)
            state[slot_position] = torch.randn(state.shape[1:], generator=generator) * 0.3
            conv = pool.conv_state(layer)
            conv[slot_position] = torch.randn(conv.shape[1:], generator=generator)
        for layer in range(layout.num_mla_layers):
            kv = pool.mla_kv(layer)
            kv[page_positions.long()] = torch.randn(len(page_positions), *kv.shape[1:], generator=generator)
    return sequences


def _work(sequences, prefix_lens, token_ids):
    return [SeqWork([token], prefix, slot, pages) for (slot, pages), prefix, token
            in zip(sequences, prefix_lens, token_ids)]


def _arena_outside_scratch(pool, graph: GraphDecode) -> torch.Tensor:
    """The whole arena as float32 (every state dtype is float32 in this test) with the scratch slot's and the
    scratch page's bytes cut out (slot position i starts at byte i * slot_bytes, page position p at p * page_bytes)."""
    layout = pool.layout
    keep = torch.ones(pool.capacity_bytes, dtype=torch.bool)
    slot = pool.slot_position(graph.scratch.slot)
    page = int(pool.page_positions([graph.scratch.page])[0])
    keep[slot * layout.slot_bytes:(slot + 1) * layout.slot_bytes] = False
    keep[page * layout.page_bytes:(page + 1) * layout.page_bytes] = False
    return pool.arena.view(torch.float32)[keep.view(-1, 4).all(dim=1)].clone()


def _relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.double() - expected.double()).abs().max() / expected.double().abs().max())


def test_step_on_static_buffers_matches_the_model_path(llm):
    network, pool = llm.network, llm.engine.pool
    generator = torch.Generator().manual_seed(17)
    graph = GraphDecode(network, pool, max_context=64, buckets=[BUCKET])
    # Mixed batch: a page filled exactly (15 -> 16 tokens), a new page started (16 -> 17), one token of context,
    # pages crossed between the two steps (31 -> 32 -> 33), a long-ish sequence.
    prefix_lens = [15, 16, 1, 31, 40]
    sequences = _random_sequences(pool, prefix_lens, generator)
    vocab = llm.config.vocab_size
    first = _work(sequences, prefix_lens, torch.randint(0, vocab, (5,), generator=generator).tolist())
    # second step: every sequence one token further, one has left the batch, and the rows come in another order
    order = [3, 0, 4, 1]
    second = _work([sequences[i] for i in order], [prefix_lens[i] + 1 for i in order],
                   torch.randint(0, vocab, (4,), generator=generator).tolist())

    before = pool.arena.clone()
    expected = []
    for work in (first, second):
        expected.append(network.forward(build_forward_batch(work, PAGE_SIZE, "cpu"), pool).clone())
    expected_state = _arena_outside_scratch(pool, graph)

    pool.arena.copy_(before)
    static = [t.clone() for t in graph.pack([], BUCKET)]                 # what capture would make static
    for work, want in zip((first, second), expected):
        for buffer, new in zip(static, graph.pack(work, BUCKET)):
            buffer.copy_(new)                                            # what replay's input copy does
        with forbid_host_reads():
            logits = graph.step(*static)
        assert logits.shape == (BUCKET, vocab)
        got = logits[: len(work)]
        assert torch.isfinite(got).all()
        assert _relative(got, want) < LOGIT_TOL, _relative(got, want)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    got_state = _arena_outside_scratch(pool, graph)                     # padding wrote nowhere else
    assert torch.equal(got_state == 0, expected_state == 0)
    assert (got_state - expected_state).abs().max() <= STATE_TOL * expected_state.abs().max()
    graph.close()
    pool.check_invariants()


def test_eager_run_pads_to_the_bucket_and_matches_unpadded(llm):
    network, pool = llm.network, llm.engine.pool
    generator = torch.Generator().manual_seed(3)
    prefix_lens = [17, 5, 33]
    sequences = _random_sequences(pool, prefix_lens, generator)
    work = _work(sequences, prefix_lens, [7, 8, 9])
    graph = GraphDecode(network, pool, max_context=48, buckets=[1, 4])
    before = pool.arena.clone()
    unpadded = graph.run_eager(work, num_rows=3).clone()
    pool.arena.copy_(before)
    padded = graph.run_eager(work)                                      # bucket 4: one padding row
    assert _relative(padded, unpadded) < LOGIT_TOL
    graph.close()


def test_pack_points_padding_at_scratch_and_rejects_non_decode_work():
    pages = torch.tensor([9, 4], dtype=torch.int32)
    work = [SeqWork([5], 17, 2, pages)]
    inputs = pack_decode_inputs(work, num_rows=3, max_pages=4, page_size=16, scratch_slot_position=0,
                                scratch_page_position=99)
    assert inputs.token_ids.tolist() == [5, 0, 0]
    assert inputs.slot_positions.tolist() == [2, 0, 0]
    assert inputs.seq_lens.tolist() == [18, 1, 1]
    assert inputs.page_table.tolist() == [[9, 4, 99, 99], [99] * 4, [99] * 4]
    assert inputs.new_page.tolist() == [4, 99, 99] and inputs.new_offset.tolist() == [1, 0, 0]
    with pytest.raises(ValueError, match="exactly one token"):
        pack_decode_inputs([SeqWork([1, 2], 3, 0, pages)], 1, 4, 16, 0, 99)
    with pytest.raises(ValueError, match="larger max_context"):
        pack_decode_inputs([SeqWork([1], 40, 0, torch.arange(3))], 1, 2, 16, 0, 99)
    with pytest.raises(ValueError, match="do not fit"):
        pack_decode_inputs(work * 2, 1, 4, 16, 0, 99)


def test_capture_needs_a_gpu(llm):
    from backends.common_graphs import GraphCaptureUnavailable
    from backends.cuda import graph_runner
    graph = GraphDecode(llm.network, llm.engine.pool, max_context=32, buckets=[1])
    with pytest.raises(GraphCaptureUnavailable):
        graph.capture(graph_runner)
    with pytest.raises(RuntimeError, match="before capture"):
        graph.run([])
    graph.close()
