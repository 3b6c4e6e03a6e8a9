"""ForwardBatch: what the engine hands the network for one step, and where the sequence state lives.

A step runs any mix of sequences, each with `prefix_len` tokens already in its state (KDA slot and MLA pages)
and some new tokens. All index tensors are built once here on the host side and moved to the device together,
so the network does no host work per layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from k3core.transfer import index_tables


class StateViews(Protocol):
    """Per-layer views of the sequence state (the unified pool implements this)."""

    def kda_state(self, kda_layer: int) -> torch.Tensor: ...     # [num_slot_positions, H, V, K] float32
    def conv_state(self, kda_layer: int) -> torch.Tensor: ...    # [num_slot_positions, K_conv - 1, C]
    def mla_kv(self, mla_layer: int) -> torch.Tensor: ...        # [num_page_positions, page_size, D_latent]


@dataclass(frozen=True)
class SeqWork:
    """One sequence's share of a step."""
    new_token_ids: Sequence[int]
    prefix_len: int                  # tokens already in the KDA slot and the MLA pages
    slot_position: int               # KDA slot position (pool index)
    page_positions: Sequence[int] | torch.Tensor   # MLA page positions covering prefix_len + new tokens
    want_logits: str = "last"        # "last" | "all" | "none"
    # (n, slot position): after its first n new tokens (1 <= n <= len(new_token_ids), increasing), copy the
    # sequence's KDA state (recurrent + conv tail) into that slot position, a slot the cache will own; slot -1:
    # copy nothing, only cut the KDA chunks there (the cut points of a run must not depend on cache room)
    snapshots: Sequence[tuple[int, int]] = ()


@dataclass(frozen=True)
class FutureTokens:
    """Input tokens a step takes from the device rather than from the host: new token `positions[i]` of the batch
    (a flat index over every sequence's new tokens) is `source[rows[i]]`, an id sampled by the previous step that the
    host has not read yet (overlapped steps). Their entries in SeqWork.new_token_ids are placeholders."""
    source: torch.Tensor             # [R] int64 on the device
    positions: Sequence[int]
    rows: Sequence[int]


@dataclass(frozen=True)
class SnapshotBatch:
    """The step's KDA snapshots (SeqWork.snapshots of every sequence, by sequence then position)."""
    lengths: list[list[int]]         # host: per sequence, the new-token counts to cut at (the op's lists)
    rows: torch.Tensor               # [S] int64 row of the op's checkpoint_states each snapshot takes
    seq: torch.Tensor                # [S] int64 sequence of the batch each snapshot belongs to
    num_new: torch.Tensor            # [S] int64 n: the sequence's new tokens before the snapshot
    slot: torch.Tensor               # [S] int64 slot position the snapshot goes to

    @property
    def num_snapshots(self) -> int:
        return int(self.slot.shape[0])


@dataclass(frozen=True)
class ForwardBatch:
    token_ids: torch.Tensor          # [T] int64
    cu_seqlens: torch.Tensor         # [B+1] int32, new tokens
    cu_seqlens_k: torch.Tensor       # [B+1] int32, prefix + new tokens
    prefix_lens: torch.Tensor        # [B] int32
    seq_lens: torch.Tensor           # [B] int32, prefix + new
    has_initial_state: torch.Tensor  # [B] bool
    slot_positions: torch.Tensor     # [B] int64
    page_table: torch.Tensor         # [B, max_pages] int32
    new_page: torch.Tensor           # [T] int64 page position of each new token
    new_offset: torch.Tensor         # [T] int64 offset in its page
    key_page: torch.Tensor           # [Tk] int64 page position of every key (prefix + new) of every sequence
    key_offset: torch.Tensor         # [Tk] int64
    logit_rows: torch.Tensor         # [R] int64 rows of T whose logits are returned
    page_size: int                   # tokens per physical page on this rank
    num_seqs: int
    is_decode: bool                  # every sequence feeds exactly one token on top of a non-empty prefix
    # decode context parallelism: this rank keeps tokens i with i % dcp_size == dcp_rank (all None when dcp_size 1)
    dcp_size: int = 1
    new_owned_rows: torch.Tensor | None = None      # [T_own] rows of T whose latent this rank stores
    local_seq_lens: torch.Tensor | None = None      # [B] int32 tokens of each sequence stored here
    key_gather_index: torch.Tensor | None = None    # [Tk] rows of the DCP-gathered local keys, in global order
    # CPU copies of cu_seqlens(_k) and slot_positions: the prefill ops plan on the host, and reading a device
    # tensor there waits for the GPU to drain (per layer). None where no prefill op runs (captured decode graphs).
    cu_seqlens_host: torch.Tensor | None = None
    cu_seqlens_k_host: torch.Tensor | None = None
    slot_positions_host: torch.Tensor | None = None
    snapshots: SnapshotBatch | None = None          # KDA states the step copies out (prefill steps only)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


def build_forward_batch(work: Sequence[SeqWork], page_size: int, device: torch.device | str,
                        dcp_size: int = 1, dcp_rank: int = 0, future: FutureTokens | None = None) -> ForwardBatch:
    """`page_size` is the physical page of this rank; with DCP a logical page (what the scheduler counts) holds
    page_size * dcp_size tokens, of which this rank stores every dcp_size-th, so local token j of a sequence sits at
    page_table[j // page_size], offset j % page_size, exactly as without DCP.

    Every table is built on the host and reaches the device in two non-blocking copies (int64 and int32), so
    building a batch never waits for the GPU."""
    # one token per sequence on a prefix is a decode step, unless a snapshot (a pipeline micro-batch of a prefill
    # chunk can be one token per sequence too): the prefill ops take the snapshots
    is_decode = bool(work) and all(len(w.new_token_ids) == 1 and w.prefix_len > 0 and not w.snapshots
                                   for w in work)
    logical = page_size * dcp_size
    tokens: list[int] = []
    cu, cu_k = [0], [0]
    prefix, seq_lens, local_lens, slots, logit_rows = [], [], [], [], []
    new_page, new_offset, owned_rows, key_page, key_offset = [], [], [], [], []
    snap_lengths: list[list[int]] = []
    snap_row, snap_seq, snap_num, snap_slot = [], [], [], []
    num_marks = 0
    max_pages = max((len(w.page_positions) for w in work), default=0)
    table = torch.zeros(len(work), max_pages, dtype=torch.int64)
    for b, item in enumerate(work):
        num_new = len(item.new_token_ids)
        total = item.prefix_len + num_new
        if num_new == 0:
            raise ValueError("a sequence in a step must feed at least one new token")
        if len(item.page_positions) * logical < total:
            raise ValueError(f"sequence needs {total} tokens of MLA pages but holds {len(item.page_positions)} "
                             f"pages of {logical}")
        start = len(tokens)
        tokens.extend(int(t) for t in item.new_token_ids)
        cu.append(len(tokens))
        cu_k.append(cu_k[-1] + total)
        prefix.append(item.prefix_len)
        seq_lens.append(total)
        local_lens.append(max(0, (total - dcp_rank + dcp_size - 1) // dcp_size))
        slots.append(item.slot_position)
        pages = torch.as_tensor(item.page_positions).to(torch.int64)                 # list or tensor
        table[b, : len(pages)] = pages
        new_pos = torch.arange(item.prefix_len, total)                      # [num_new]
        mine = new_pos % dcp_size == dcp_rank
        local_index = new_pos[mine] // dcp_size                            # j-th token stored on this rank
        new_page.append(pages[local_index // page_size])
        new_offset.append(local_index % page_size)
        owned_rows.append(start + torch.nonzero(mine).flatten())
        if not is_decode:                                                   # decode reads keys by page table
            key_local = torch.arange(local_lens[-1])                        # [local keys of this sequence]
            key_page.append(pages[key_local // page_size])
            key_offset.append(key_local % page_size)
        if item.want_logits == "all":
            logit_rows.extend(range(start, start + num_new))
        elif item.want_logits == "last":
            logit_rows.append(start + num_new - 1)
        lengths = [n for n, _ in item.snapshots]
        if any(not 0 < n <= num_new for n in lengths) or lengths != sorted(set(lengths)):
            raise ValueError(f"sequence {b} feeds {num_new} tokens but asks for snapshots after {lengths}; give "
                             "increasing counts in 1..num_new")
        snap_lengths.append(lengths)
        for n, slot in item.snapshots:
            if slot >= 0:
                snap_row.append(num_marks)
                snap_seq.append(b)
                snap_num.append(n)
                snap_slot.append(slot)
            num_marks += 1

    def cat(parts):
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)

    long_parts = dict(token_ids=tokens, slot_positions=slots, new_page=cat(new_page), new_offset=cat(new_offset),
                      key_page=cat(key_page), key_offset=cat(key_offset), logit_rows=logit_rows,
                      snap_row=snap_row, snap_seq=snap_seq, snap_num=snap_num, snap_slot=snap_slot,
                      has_initial_state=[p > 0 for p in prefix])
    int_parts = dict(cu_seqlens=cu, cu_seqlens_k=cu_k, prefix_lens=prefix, seq_lens=seq_lens, page_table=table)
    if dcp_size > 1:
        long_parts["new_owned_rows"] = cat(owned_rows)
        int_parts["local_seq_lens"] = local_lens
        if not is_decode:
            long_parts["key_gather_index"] = _dcp_key_order(seq_lens, dcp_size)
    on_device = dict(zip(long_parts, index_tables(list(long_parts.values()), device, torch.int64)))
    on_device.update(zip(int_parts, index_tables(list(int_parts.values()), device, torch.int32)))
    token_ids = on_device["token_ids"]
    if future is not None and len(future.positions):
        positions, rows = index_tables([future.positions, future.rows], device, torch.int64)
        token_ids.index_copy_(0, positions, future.source.index_select(0, rows))
    snapshots = None
    if num_marks:
        snapshots = SnapshotBatch(snap_lengths, on_device["snap_row"], on_device["snap_seq"], on_device["snap_num"],
                                  on_device["snap_slot"])
    dcp_fields = {name: on_device[name] for name in ("new_owned_rows", "local_seq_lens", "key_gather_index")
                  if name in on_device}
    return ForwardBatch(
        token_ids=token_ids,
        cu_seqlens=on_device["cu_seqlens"],
        cu_seqlens_host=torch.tensor(cu, dtype=torch.int32),
        cu_seqlens_k_host=torch.tensor(cu_k, dtype=torch.int32),
        slot_positions_host=torch.tensor(slots, dtype=torch.int64),
        cu_seqlens_k=on_device["cu_seqlens_k"],
        prefix_lens=on_device["prefix_lens"],
        seq_lens=on_device["seq_lens"],
        has_initial_state=on_device["has_initial_state"] != 0,
        slot_positions=on_device["slot_positions"],
        page_table=on_device["page_table"].view(len(work), max_pages),
        new_page=on_device["new_page"],
        new_offset=on_device["new_offset"],
        key_page=on_device["key_page"],
        key_offset=on_device["key_offset"],
        logit_rows=on_device["logit_rows"],
        page_size=page_size,
        num_seqs=len(work),
        is_decode=is_decode,
        dcp_size=dcp_size,
        snapshots=snapshots,
        **dcp_fields,
    )


def _dcp_key_order(seq_lens: list[int], dcp_size: int) -> torch.Tensor:
    """Index into the concatenation [rank 0's local keys, rank 1's, ...] (each rank's keys sequence by sequence)
    that puts every sequence's keys back in position order."""
    local = [[max(0, (n - r + dcp_size - 1) // dcp_size) for n in seq_lens] for r in range(dcp_size)]
    rank_base = [0]
    for r in range(dcp_size):
        rank_base.append(rank_base[-1] + sum(local[r]))
    parts = []
    for b, n in enumerate(seq_lens):
        pos = torch.arange(n)
        owner = pos % dcp_size
        seq_base = torch.tensor([rank_base[r] + sum(local[r][:b]) for r in range(dcp_size)])
        parts.append(seq_base[owner] + pos // dcp_size)
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
