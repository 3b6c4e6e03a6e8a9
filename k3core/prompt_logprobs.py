"""Prompt logprobs: the logprob of every prompt token given the tokens before it, read off a prefill's logits.

A request with `SamplingParams.prompt_logprobs` (N top alternatives per position, 0 = the prompt token's own only)
has its prefill chunks return the logits of every position, not only the last. The logits at position p score
prompt token p + 1, so position 0 has no logprob (None) and the last prompt position's logits are the sampler's.
Each step reduces its prompt rows on the device (log-softmax, the prompt token's logprob and rank, the top N) and
copies only those small results to the host; the [T, V] logits of a chunk never outlive its step.

The prefix cache holds states, never logits: positions it would serve were not computed by this request. So a
request that still needs prompt logprobs reads a cached prefix only as deep as the positions the prompt-logprob
store (`k3core.prompt_logprob_store`) already knows for its prompt, and from position 0 (with the checkpoint
positions an empty cache would give) when it knows none; it only adds to the cache as any request does; existing
entries are never written (copy-on-write, duplicates freed).

Results are stored by position, so a request retracted mid-prefill and recomputed from 0 simply writes the same
positions again.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from k3core.transfer import index_tables

__all__ = ["PromptLogprobs", "PromptRows", "DevicePromptLogprobs", "prompt_positions", "score_prompt_rows"]


@dataclass
class PromptLogprobs:
    """One prompt's logprobs by position; position 0 (no prefix) and positions not computed yet are None."""
    entries: list[dict[int, float] | None]   # {prompt token: logprob, top-N ids: logprob}
    ranks: list[int | None]                  # the prompt token's rank, 1 = most likely (1 + tokens strictly above)

    @classmethod
    def empty(cls, num_prompt_tokens: int) -> "PromptLogprobs":
        return cls([None] * num_prompt_tokens, [None] * num_prompt_tokens)

    @property
    def complete(self) -> bool:
        return all(entry is not None for entry in self.entries[1:])


@dataclass(frozen=True)
class PromptRows:
    """Rows of a step's logits that score tokens of one prompt: row first_row + i is position positions[i]."""
    prompt_token_ids: Sequence[int]
    target: PromptLogprobs                   # where the host results go
    positions: range                         # positions p whose logits score prompt token p + 1
    first_row: int
    num_top: int


def prompt_positions(prompt_len: int, wants: bool, start: int, num_tokens: int) -> range:
    """The positions among [start, start + num_tokens) whose logits score a prompt token (all but the last
    prompt position), or none when the request does not want them (`wants`)."""
    if not wants:
        return range(0)
    return range(start, max(start, min(start + num_tokens, prompt_len - 1)))


class DevicePromptLogprobs:
    """A step's prompt-row results on the device; `result()` brings them to the host and stores them."""

    def __init__(self, parts: list[PromptRows], chosen: torch.Tensor, ranks: torch.Tensor,
                 top_ids: torch.Tensor, top_values: torch.Tensor):
        self.parts = parts
        self._tensors = [chosen, ranks, top_ids, top_values]   # [N] f32, [N] i64, [N, K] i64, [N, K] f32
        self._event = None
        self._copied = False

    def start_copy(self) -> None:
        """Queue non-blocking copies into pinned host memory (on CPU: nothing), so that reading waits for them only."""
        if self._copied:
            return
        self._copied = True
        if self._tensors[0].device.type != "cuda":
            return
        pinned = []
        for tensor in self._tensors:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            pinned.append(host)
        self._tensors = pinned
        self._event = torch.cuda.Event()
        self._event.record()

    def result(self) -> None:
        """Wait for the copies and write each position's entry and rank into its request's PromptLogprobs."""
        self.start_copy()
        if self._event is not None:
            self._event.synchronize()
        chosen, ranks, top_ids, top_values = (t.tolist() for t in self._tensors)
        row = 0
        for part in self.parts:
            for position in part.positions:
                token_id = part.prompt_token_ids[position + 1]
                entry = {token_id: chosen[row]}
                entry.update(zip(top_ids[row][:part.num_top], top_values[row][:part.num_top]))
                part.target.entries[position + 1] = entry
                part.target.ranks[position + 1] = ranks[row]
                row += 1


def score_prompt_rows(logits: torch.Tensor, parts: list[PromptRows]) -> DevicePromptLogprobs:
    """Log-softmax the prompt rows of a step's logits [R, V] and keep, per row, the prompt token's logprob, its
    rank and the top max(num_top) alternatives; device work only."""
    rows = [part.first_row + i for part in parts for i in range(len(part.positions))]
    targets = [part.prompt_token_ids[p + 1] for part in parts for p in part.positions]
    row_index, target_index = index_tables([rows, targets], logits.device, torch.int64)
    logprobs = torch.log_softmax(logits.index_select(0, row_index).float(), dim=-1)    # [N, V]
    chosen = logprobs.gather(1, target_index[:, None])                                  # [N, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1                                         # [N]
    num_top = min(max(part.num_top for part in parts), logprobs.shape[-1])
    top = torch.topk(logprobs, num_top, dim=-1)                                         # [N, K]
    return DevicePromptLogprobs(parts, chosen[:, 0], ranks, top.indices, top.values)
