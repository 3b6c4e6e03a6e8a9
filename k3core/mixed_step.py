"""A step that holds both prefill chunks and decodes runs as two forwards: the decodes replayed from their captured
graph, the chunks eagerly.

One forward over both would run every decode row through the prefill ops: the KDA chunked prefill gives each
one-token sequence a chunk of its own (its state loaded, updated and stored like a 64-token chunk's) and the MLA
prefill gives it a query tile, so 62 decodes beside a 2048-token chunk cost about as much again as the chunk
(`bench.serving`'s mixed_steps section measures it). Two forwards read the weights twice instead; at prefill sizes
the chunk is compute-bound and the second weight read is the graph-replayed decode step, the cheapest form of it.

The split changes which kernels a decode row runs, not what it computes: the tokens of a request are those the
decode graph gives whenever that request decodes alone, and overlap on or off takes the same path.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from k3core.model.batch import FutureTokens, SeqWork
from k3core.transfer import index_tables


@dataclass(frozen=True)
class MixedSplit:
    """Which sequences of a step decode from the graph and which run eagerly (indices into the step's work)."""
    decode_rows: list[int]
    eager_rows: list[int]


def split_mixed(work: Sequence[SeqWork], graph, future: FutureTokens | None) -> MixedSplit | None:
    """The split of a step with decodes the graph can replay beside work it cannot, or None (run it as one)."""
    decode_rows = [i for i, w in enumerate(work) if graph.accepts([w])]
    if not decode_rows or len(decode_rows) == len(work) or len(decode_rows) > graph.buckets[-1]:
        return None
    decode_set = set(decode_rows)
    eager_rows = [i for i in range(len(work)) if i not in decode_set]
    if future is not None and len(future.positions):
        flat_starts = _flat_starts(work)
        decode_starts = {flat_starts[i] for i in decode_rows}
        if not all(p in decode_starts for p in future.positions):
            return None            # a device-fed token outside the decodes: keep the one-forward path
    return MixedSplit(decode_rows, eager_rows)


def run_split(split: MixedSplit, work: Sequence[SeqWork], future: FutureTokens | None, graph, runner,
              pool) -> torch.Tensor | None:
    """Logits [R, V] of the rows that want them, in `work` order, as one forward over `work` would return them."""
    decode_work = [work[i] for i in split.decode_rows]
    eager_work = [work[i] for i in split.eager_rows]
    decode_future = None
    if future is not None and len(future.positions):
        flat_starts = _flat_starts(work)
        row_of_start = {flat_starts[i]: row for row, i in enumerate(split.decode_rows)}
        decode_future = FutureTokens(future.source, [row_of_start[p] for p in future.positions], list(future.rows))
    decode_logits = graph.run(decode_work, decode_future)         # [D, V], valid until the next replay
    eager_logits = runner.forward(eager_work, pool, None)          # [wanted eager rows, V] or None
    wanted_decode = [row for row, w in enumerate(decode_work) if w.want_logits != "none"]
    # where each row of `work`'s logits sits in cat(wanted decode logits, eager logits): one row for "last", one
    # per new token for "all" (a prompt-logprobs chunk), none for "none"
    place: dict[int, list[int]] = {split.decode_rows[row]: [rank] for rank, row in enumerate(wanted_decode)}
    offset = len(wanted_decode)
    for i in split.eager_rows:
        count = _logit_rows(work[i])
        place[i] = list(range(offset, offset + count))
        offset += count
    order = [rank for i in range(len(work)) for rank in place.get(i, [])]
    if not order:
        return None
    parts = [decode_logits.index_select(0, index_tables([wanted_decode], decode_logits.device, torch.int64)[0])]
    if eager_logits is not None and eager_logits.shape[0]:
        parts.append(eager_logits)
    logits = torch.cat(parts)                                      # [R, V]
    assert logits.shape[0] == len(order), (logits.shape, len(order))
    if order == list(range(len(order))):
        return logits
    return logits.index_select(0, index_tables([order], logits.device, torch.int64)[0])


def _logit_rows(w: SeqWork) -> int:
    return {"none": 0, "last": 1, "all": len(w.new_token_ids)}[w.want_logits]


def _flat_starts(work: Sequence[SeqWork]) -> list[int]:
    starts, flat = [], 0
    for w in work:
        starts.append(flat)
        flat += len(w.new_token_ids)
    return starts
