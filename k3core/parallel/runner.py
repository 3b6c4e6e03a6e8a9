"""ModelRunner: runs one engine step's work through the network, on one device or under a parallel plan.

The engine (scheduler, radix cache, pool bookkeeping) is the same on every rank and makes the same decisions
from the same inputs; the runner is the only part that knows about the plan:
* DCP: each rank builds its batch with its share of the MLA tokens (logical pages of page_size * dcp tokens);
* PP: a prefill step is cut into micro-chunks that flow through the stages, each stage receiving the residual
  stream (and the AttnRes bank) from the previous one and sending it on without waiting, so stage s works on
  chunk c + 1 while stage s + 1 works on chunk c. Only the last stage has logits;
* sampling happens on the first rank of the last stage and the tokens are broadcast to every rank.
"""
from __future__ import annotations

from typing import Sequence

import torch

from k3core.model.batch import FutureTokens, SeqWork, build_forward_batch
from k3core.model.network import Network, Stream
from k3core.parallel.comm import SINGLE, Communicator


class ModelRunner:
    def __init__(self, network: Network, ops, page_size: int, device: torch.device, comm: Communicator = SINGLE,
                 pipeline_chunks: int = 4):
        self.network = network
        self.ops = ops
        self.page_size = page_size                  # physical tokens per page on this rank
        self.device = device
        self.comm = comm
        self.plan = comm.plan
        self.pipeline_chunks = pipeline_chunks
        coords = comm.coords
        self.dcp_size, self.dcp_rank = self.plan.dcp, coords.dcp_rank
        self.stage, self.stage_rank = coords.stage, coords.stage_rank
        self.sampler_rank = (self.plan.pp - 1) * self.plan.stage_size

    @property
    def logical_page_size(self) -> int:
        """Tokens per page as the scheduler and the radix cache count them."""
        return self.page_size * self.plan.dcp

    def forward(self, work: Sequence[SeqWork], state, future: FutureTokens | None = None) -> torch.Tensor | None:
        """Logits [R, V] on the last stage (rows in `work` order), None elsewhere. `future` (one device only): input
        tokens the previous step sampled and the host has not read yet."""
        if future is not None and not self.plan.is_single:
            raise ValueError("device-resolved input tokens (overlapped steps) need the whole model on one device")
        if self.plan.pp == 1:
            return self.network.forward(self._batch(work, future), state)
        micro = [work] if all(len(w.new_token_ids) == 1 for w in work) else _split_work(work, self.pipeline_chunks)
        pending, logits = [], []
        for part in micro:
            batch = self._batch(part)
            stream = None if self.stage == 0 else self._recv_stream(batch)
            out = self.network.forward(batch, state, stream)
            if self.network.last_stage:
                logits.append(out)
            else:
                pending.extend(self._send_stream(out))
        for handle in pending:
            handle.wait()
        if not self.network.last_stage:
            return None
        return torch.cat(logits)[_logit_order(work, micro).to(self.device)]

    # ---- helpers ---------------------------------------------------------------------------------
    def _batch(self, work: Sequence[SeqWork], future: FutureTokens | None = None):
        return build_forward_batch(work, self.page_size, self.device, self.dcp_size, self.dcp_rank, future)

    def _peer(self, stage: int) -> int:
        return stage * self.plan.stage_size + self.stage_rank

    def _send_stream(self, stream: Stream):
        dst = self._peer(self.stage + 1)
        handles = [self.comm.send(stream.live, dst)]
        if stream.bank is not None:
            handles.append(self.comm.send(stream.bank, dst))
        return handles

    def _recv_stream(self, batch) -> Stream:
        src = self._peer(self.stage - 1)
        config = self.network.config
        dtype = _stream_dtype(self.network)
        live = self.comm.recv((batch.num_tokens, config.hidden_size), dtype, self.device, src)
        if not config.attn_res:
            return Stream(live)
        bank = self.comm.recv((batch.num_tokens, config.num_attn_res_blocks, config.hidden_size), dtype,
                              self.device, src)
        first_layer = self.network.layer_ids[0]
        # the stage that ends before `first_layer` has sealed one row per block start it ran
        num_sealed = -(-first_layer // config.attn_res_block_size)
        return Stream(live, bank, num_sealed)


def _stream_dtype(network: Network) -> torch.dtype:
    return network.layers[0].w_input_norm.dtype


def _split_work(work: Sequence[SeqWork], chunks: int) -> list[list[SeqWork]]:
    """Cut every sequence's new tokens into up to `chunks` consecutive pieces; micro-batch k holds piece k."""
    pieces: list[list[SeqWork]] = [[] for _ in range(chunks)]
    for item in work:
        tokens = list(item.new_token_ids)
        size = -(-len(tokens) // chunks)
        starts = list(range(0, len(tokens), size))
        for index, start in enumerate(starts):
            last = index == len(starts) - 1
            piece = tokens[start: start + size]
            snapshots = [(n - start, slot) for n, slot in item.snapshots if start < n <= start + len(piece)]
            pieces[index].append(SeqWork(piece, item.prefix_len + start, item.slot_position, item.page_positions,
                                         item.want_logits if last else "none", snapshots))
    return [p for p in pieces if p]


def _logit_order(work: Sequence[SeqWork], micro: list[list[SeqWork]]) -> torch.Tensor:
    """Index that maps the micro-batches' concatenated logit rows back to `work` order (one row per sequence)."""
    if any(w.want_logits == "all" for w in work):
        raise ValueError("pipeline steps return the last logits of a sequence only")
    position_of = {}
    row = 0
    for part in micro:
        for item in part:
            if item.want_logits != "none":
                position_of[(item.slot_position, item.prefix_len + len(item.new_token_ids))] = row
                row += 1
    wanted = [position_of[(w.slot_position, w.prefix_len + len(w.new_token_ids))] for w in work
              if w.want_logits != "none"]
    return torch.tensor(wanted, dtype=torch.int64)
