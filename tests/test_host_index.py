"""kernels.triton.host_index: host-built index tables in one copy, and the batch's host metadata the prefill ops
read instead of device tensors (a device read waits for the GPU to drain, once per layer)."""
from __future__ import annotations

import torch

from k3core.model.batch import SeqWork, build_forward_batch
from kernels.triton.host_index import index_tables


def test_index_tables_round_trip_every_part_including_empty_ones():
    parts = [[0, 5, 9], [], [7], [2**31 - 1, -3]]
    views = index_tables(parts, torch.device("cpu"))
    assert [v.tolist() for v in views] == parts
    assert all(v.dtype == torch.int32 for v in views)
    assert index_tables([[1, 2]], torch.device("cpu"), torch.int64)[0].dtype == torch.int64


def test_forward_batch_carries_host_copies_of_cu_seqlens_and_slots():
    work = [SeqWork([1, 2, 3], 0, 4, [0]), SeqWork([7], 5, 2, [1, 2]), SeqWork([8, 9], 0, 0, [3])]
    batch = build_forward_batch(work, page_size=4, device=torch.device("cpu"))
    assert batch.cu_seqlens_host.device.type == "cpu" and batch.slot_positions_host.device.type == "cpu"
    assert torch.equal(batch.cu_seqlens_host, batch.cu_seqlens.cpu())
    assert torch.equal(batch.slot_positions_host, batch.slot_positions.cpu())
    assert batch.cu_seqlens_host.tolist() == [0, 3, 4, 6] and batch.slot_positions_host.tolist() == [4, 2, 0]
    assert torch.equal(batch.cu_seqlens_k_host, batch.cu_seqlens_k.cpu()) and batch.cu_seqlens_k_host.tolist()[-1] == 11


def test_every_table_starts_16_byte_aligned():
    """Triton specialises pointers on 16-byte alignment: tables at offsets that follow the batch's sizes made new
    compiles after warm-up whenever a batch's sizes changed the pattern (H200 serving run, kda_chunk_state)."""
    for dtype in (torch.int32, torch.int64, torch.int16):
        for sizes in ([3, 1, 5, 2], [1] * 7, [4, 0, 4], [17]):
            parts = [list(range(n)) for n in sizes]
            views = index_tables(parts, torch.device("cpu"), dtype)
            assert [v.tolist() for v in views] == parts
            base = views[0].untyped_storage().data_ptr()
            for v in views:
                assert (v.data_ptr() - base) % 16 == 0, (dtype, sizes)
