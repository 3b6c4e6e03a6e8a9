"""The decode step in a form a CUDA/HIP graph can capture: static, bucket-padded device inputs and no host reads.

A captured graph replays fixed kernels on fixed addresses, so the step it captures may depend only on tensor
shapes, never on values read back to the host. `GraphDecode` therefore feeds the network six tensors whose batch
dimension is padded to a bucket size (`DecodeInputs`) and whose page table has a fixed width (`max_pages`, the
context capacity the step is built for). Everything the network needs beyond them (cu_seqlens, prefix lengths,
logit rows) is derived on the device from shapes alone.

Padding rows must write nowhere that matters: a decode step writes the KDA state and conv tail of each row's
slot and one MLA latent per row. Padding rows therefore point at a scratch slot and a scratch page that the
pool lends for the step's lifetime (`DecodeScratch`); several padding rows may share them, and what they leave
there is garbage that nothing reads. Every op of the decode path is row-independent, so padding rows never
change a real row's result.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from k3core.memory.layout import PageHandle, SlotHandle
from k3core.model.batch import ForwardBatch, FutureTokens, SeqWork
from k3core.transfer import index_tables


class DecodeInputs(NamedTuple):
    """One decode step's device inputs, batch on dim 0 (the order GraphRunner captures them in)."""
    token_ids: torch.Tensor        # [B] int64, the token each sequence feeds
    slot_positions: torch.Tensor   # [B] int64 KDA slot position
    page_table: torch.Tensor       # [B, max_pages] int32 MLA page positions (unused entries: the scratch page)
    seq_lens: torch.Tensor         # [B] int32, prefix + 1 (padding rows: 1)
    new_page: torch.Tensor         # [B] int64 page position the new latent goes to
    new_offset: torch.Tensor       # [B] int64 offset of the new latent in that page


@dataclass(frozen=True)
class DecodeScratch:
    """A slot and a page that padding rows may overwrite; positions are looked up per step (compaction moves them)."""
    slot: SlotHandle
    page: PageHandle


def reserve_scratch(pool) -> DecodeScratch:
    """Take one slot and one page from `pool` for padding rows and zero both (so padding starts from finite state)."""
    slot = pool.alloc_slot()
    pages = pool.alloc_pages(1) if slot is not None else None
    if slot is None or pages is None:
        if slot is not None:
            pool.free_slot(slot)
        raise ValueError("the pool has no room for the decode graphs' scratch slot and page; give it more memory")
    pool.zero_slot(slot)
    page_position = int(pool.page_positions(pages)[0])
    for mla_layer in range(pool.layout.num_mla_layers):
        pool.mla_kv(mla_layer)[page_position].zero_()
    return DecodeScratch(slot, pages[0])


def release_scratch(pool, scratch: DecodeScratch) -> None:
    pool.free_pages([scratch.page])
    pool.free_slot(scratch.slot)


def pack_decode_inputs(work: Sequence[SeqWork], num_rows: int, max_pages: int, page_size: int,
                       scratch_slot_position: int, scratch_page_position: int) -> DecodeInputs:
    """Host-side packing of decode work into `num_rows` rows (CPU tensors); rows past len(work) are padding.
    Runs every decode step: the per-row work is integer bookkeeping, and the tensors are made once per step."""
    if len(work) > num_rows:
        raise ValueError(f"{len(work)} sequences do not fit a decode step of {num_rows} rows")
    padding = num_rows - len(work)
    seq_lens, needed_pages, page_rows = [], [], []
    for row, item in enumerate(work):
        if len(item.new_token_ids) != 1 or item.prefix_len < 1:
            raise ValueError(f"row {row} feeds {len(item.new_token_ids)} tokens on a prefix of {item.prefix_len}; "
                             "a decode step feeds exactly one token on a non-empty prefix")
        total = item.prefix_len + 1
        needed = -(-total // page_size)
        if len(item.page_positions) < needed:
            raise ValueError(f"row {row} needs {needed} MLA pages for {total} tokens but holds "
                             f"{len(item.page_positions)}")
        if needed > max_pages:
            raise ValueError(f"row {row} has {total} tokens but the decode step was built for at most "
                             f"{max_pages * page_size}; build it with a larger max_context")
        seq_lens.append(total)
        needed_pages.append(needed)
        page_rows.append(torch.as_tensor(item.page_positions)[:needed])
    table = torch.full((num_rows, max_pages), scratch_page_position, dtype=torch.int32)
    if work:
        counts = torch.tensor(needed_pages)
        rows = torch.repeat_interleave(torch.arange(len(work)), counts)                  # [sum(needed)]
        cols = torch.arange(len(rows)) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
        table[rows, cols] = torch.cat(page_rows).to(torch.int32)
    prefix = [n - 1 for n in seq_lens] + [0] * padding
    # the new token's latent goes to the page holding position `prefix` (padding rows: column 0, the scratch page)
    new_page = table[torch.arange(num_rows), torch.tensor([p // page_size for p in prefix])].to(torch.int64)
    return DecodeInputs(
        token_ids=torch.tensor([int(w.new_token_ids[0]) for w in work] + [0] * padding, dtype=torch.int64),
        slot_positions=torch.tensor([int(w.slot_position) for w in work] + [scratch_slot_position] * padding,
                                    dtype=torch.int64),
        page_table=table,
        seq_lens=torch.tensor(seq_lens + [1] * padding, dtype=torch.int32),
        new_page=new_page,
        new_offset=torch.tensor([p % page_size for p in prefix], dtype=torch.int64))


def decode_batch(inputs: DecodeInputs, page_size: int) -> ForwardBatch:
    """A ForwardBatch for one decode token per row, built on the device from the inputs' shapes only."""
    num_rows = inputs.token_ids.shape[0]
    device = inputs.token_ids.device
    rows = torch.arange(num_rows, device=device)                                     # [B]
    seq_lens = inputs.seq_lens
    cu_k = torch.zeros(num_rows + 1, dtype=torch.int32, device=device)
    cu_k[1:] = torch.cumsum(seq_lens, 0)
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    return ForwardBatch(
        token_ids=inputs.token_ids, cu_seqlens=torch.arange(num_rows + 1, dtype=torch.int32, device=device),
        cu_seqlens_k=cu_k, prefix_lens=seq_lens - 1, seq_lens=seq_lens,
        has_initial_state=torch.ones(num_rows, dtype=torch.bool, device=device),
        slot_positions=inputs.slot_positions, page_table=inputs.page_table, new_page=inputs.new_page,
        new_offset=inputs.new_offset, key_page=empty, key_offset=empty, logit_rows=rows, page_size=page_size,
        num_seqs=num_rows, is_decode=True)


class GraphDecode:
    """Decode steps of `network` over `pool`'s state for batches of up to max(buckets) sequences of up to
    `max_context` tokens, replayed from one captured graph per bucket (or run eagerly with the same inputs).

    Rules callers keep: the pool's arena and the weights stay where they are while graphs live; the scratch
    slot and page stay allocated until `close()`; logits returned by `run` are valid until the next `run`."""

    def __init__(self, network, pool, max_context: int, buckets: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
                 scratch: DecodeScratch | None = None):
        if not (network.first_stage and network.last_stage):
            raise ValueError("GraphDecode runs the whole network on one device; pipeline stages decode eagerly")
        self.network = network
        self.pool = pool
        self.page_size = pool.layout.page_size
        self.max_pages = -(-max_context // self.page_size)
        self.buckets = sorted({int(b) for b in buckets})
        self.scratch = scratch if scratch is not None else reserve_scratch(pool)
        self.runner = None

    # ---- the capturable step -------------------------------------------------------------------------
    def step(self, *inputs: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] float32 of every row (padding rows included); no host reads, shapes only."""
        return self.network.forward(decode_batch(DecodeInputs(*inputs), self.page_size), self.pool)

    # ---- host side -------------------------------------------------------------------------------------
    def bucket_for(self, num_seqs: int) -> int:
        for bucket in self.buckets:
            if bucket >= num_seqs:
                return bucket
        raise ValueError(f"{num_seqs} sequences exceed the largest decode bucket {self.buckets[-1]}; run eagerly")

    @property
    def max_context(self) -> int:
        """The most tokens (prefix + the new one) a row of a replayed step may hold: the page table's width."""
        return self.max_pages * self.page_size

    def accepts(self, work: Sequence[SeqWork]) -> bool:
        """Whether `run` can take this step: one token per sequence on a non-empty prefix, no more sequences than
        the largest bucket, every context within `max_context`, at most the last logits of each wanted, and no KDA
        snapshot (a one-token prefill chunk may carry one; only the prefill ops write them)."""
        return (0 < len(work) <= self.buckets[-1]
                and all(len(w.new_token_ids) == 1 and 0 < w.prefix_len < self.max_context and w.want_logits != "all"
                        and not w.snapshots for w in work))

    def pack(self, work: Sequence[SeqWork], num_rows: int) -> DecodeInputs:
        return pack_decode_inputs(work, num_rows, self.max_pages, self.page_size,
                                  self.pool.slot_position(self.scratch.slot),
                                  int(self.pool.page_positions([self.scratch.page])[0]))

    def capture(self, graph_runner: Callable[..., object]) -> None:
        """`graph_runner` is the backend's factory (backends.<vendor>.graph_runner); one graph per bucket."""
        self.runner = graph_runner(self.step, self.buckets, device=self.pool.device)
        self.runner.capture(lambda bucket: self.pack([], bucket))     # all padding: writes scratch only

    def run(self, work: Sequence[SeqWork], future: FutureTokens | None = None) -> torch.Tensor:
        """Logits [len(work), V] from the captured graph of the smallest bucket that holds the batch. The packed
        inputs reach the device in non-blocking copies (the host never waits for the GPU here); `future` replaces
        rows' placeholder tokens by ids sampled on the device (overlapped steps)."""
        if self.runner is None:
            raise RuntimeError("GraphDecode.run before capture(); capture once at start or use run_eager")
        inputs = self.pack(work, self.bucket_for(len(work)))          # every row written: no stale padding
        shapes = [t.shape for t in inputs]
        dtypes = [t.dtype for t in inputs]
        moved = [part.view(shape).to(dtype) for part, shape, dtype in zip(
            index_tables(list(inputs), self.pool.device, torch.int64), shapes, dtypes)]
        if future is not None and len(future.positions):
            rows, picks = index_tables([future.positions, future.rows], self.pool.device, torch.int64)
            moved[0].index_copy_(0, rows, future.source.index_select(0, picks))
        return self.runner.run(*moved)[: len(work)]

    def run_eager(self, work: Sequence[SeqWork], num_rows: int | None = None) -> torch.Tensor:
        """The same step without a graph (padded to `num_rows`, default the bucket): what replay must match."""
        rows = num_rows if num_rows is not None else self.bucket_for(len(work))
        inputs = [t.to(self.pool.device) for t in self.pack(work, rows)]
        return self.step(*inputs)[: len(work)]

    def close(self) -> None:
        self.runner = None
        release_scratch(self.pool, self.scratch)


# ---- what the engine calls -----------------------------------------------------------------------------------
def graph_runner_for(llm, injected: Callable[..., object] | None = None) -> Callable[..., object]:
    """The graph runner of `llm`'s backend (`backends.<name>.graph_runner`), or `injected` (tests); raises when this
    model cannot replay graphs, so that cuda_graphs never quietly runs eagerly."""
    if not llm.plan.is_single:
        raise ValueError(f"cuda_graphs needs the whole model on one device but the plan is {llm.plan}; "
                         "turn cuda_graphs off under a parallel plan")
    if injected is not None:
        return injected
    from backends.common_graphs import GraphCaptureUnavailable
    if not torch.cuda.is_available():
        raise GraphCaptureUnavailable("cuda_graphs needs a CUDA or ROCm GPU and none is visible "
                                      "(torch.cuda.is_available() is False); turn cuda_graphs off")
    backend = llm.ops.backend
    factory = None if backend == "torch" else getattr(importlib.import_module(f"backends.{backend}"),
                                                      "graph_runner", None)
    if factory is None:
        raise ValueError(f"backend {backend!r} cannot capture graphs; choose backend cuda or rocm, or turn "
                         "cuda_graphs off")
    if llm.device.type == "cpu":
        raise ValueError("cuda_graphs needs the model on the GPU (device 'cuda'), not the CPU")
    return factory


def capture_decode_graphs(network, pool, max_context: int, buckets: Sequence[int],
                          graph_runner: Callable[..., object]) -> GraphDecode:
    """Reserve the scratch slot and page and capture one decode graph per bucket; on failure nothing stays
    reserved."""
    graph = GraphDecode(network, pool, max_context, buckets)
    try:
        graph.capture(graph_runner)
    except Exception as exc:
        graph.close()
        from backends.common_graphs import GraphCaptureUnavailable
        if isinstance(exc, (GraphCaptureUnavailable, ValueError)):
            raise
        raise RuntimeError(f"capturing the decode graphs failed ({type(exc).__name__}: {exc}); an op that reads "
                           "tensors on the host cannot be captured (`python -m k3core.backends` lists the chosen "
                           "providers); turn cuda_graphs off to run eagerly") from exc
    return graph
