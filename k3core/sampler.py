"""The batched sampler: one call per step turns the batch's logits into token ids on the device.

`Sampler.sample` builds the step's host tables (one integer and one float copy to the device), then launches
device work only: the allowed-token mask, a grammar's token bitmask (structured outputs: `GrammarMask`, bits
unpacked on the device), logit_bias, min_tokens, penalties, the `sample` op (temperature,
top-k/top-p/min-p, a seeded draw that depends on the row's own seed and output position only) and the logprobs
of the raw model distribution. Nothing in it reads device values back. The one host synchronisation of a step is
`DeviceSample.result()`, which waits for the copy that `start_copy()` queued.

Penalties read per-request token counts that the sampler keeps on the device and updates from the ids it has just
sampled, so a caller's output list may end with placeholders for ids it has not read back yet.

An engine uses it as:
    sampler = Sampler(vocab_size, device, eos_token_ids, ops)
    sampler.add_request(request_id, params, prompt_token_ids)         # when the request arrives
    step = sampler.sample(logits, [SampleRow(request_id, params, output_token_ids, prompt_token_ids), ...])
    step.start_copy()                                                 # then prepare the next step on the host
    host = step.result()                                              # ids and logprobs: the one sync
    sampler.remove_request(request_id)                                # when it finishes or is aborted
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from k3core.sampling_params import INT64_MAX, INT64_MIN, SamplingParams
from k3core.structured.matchers import GrammarMask, unpack_bitmask
from k3core.transfer import index_tables

NEG_INF = float("-inf")


@dataclass(frozen=True)
class SampleRow:
    """One row of the logits a step samples."""
    request_id: str
    params: SamplingParams
    output_token_ids: Sequence[int]          # the output so far (placeholders -1 allowed: only counted)
    prompt_token_ids: Sequence[int]
    allowed_token_mask: torch.Tensor | None = None   # [V] bool, None = every token allowed


@dataclass
class HostSample:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]  # per row: None without logprobs; else {sampled id: lp, top-n id: lp}


@dataclass
class _RequestState:
    seed: int                                # int64, the draw's key
    count_slot: int | None                   # row of the token-count buffers (penalties only)


class DeviceSample:
    """A step's sampled ids (and logprobs) on the device; `result()` brings them to the host."""

    def __init__(self, token_ids: torch.Tensor, logprob_rows: list[int], logprob_counts: list[int],
                 logprob_ids: torch.Tensor | None, logprob_values: torch.Tensor | None) -> None:
        self.token_ids = token_ids                       # [R] int64 on the device
        self._num_rows = token_ids.shape[0]
        self._logprob_rows = logprob_rows                # rows that asked for logprobs
        self._logprob_counts = logprob_counts            # their top-n
        # [R + L * n_max] int64: the sampled ids, then each logprob row's top ids; values [L * (1 + n_max)]
        self._ids = token_ids if logprob_ids is None else torch.cat([token_ids, logprob_ids.reshape(-1)])
        self._values = None if logprob_values is None else logprob_values.reshape(-1)
        self._event = None
        self._copied = False

    def start_copy(self) -> None:
        """Queue a non-blocking copy into pinned host memory and record an event after it (on CPU: nothing)."""
        if self._copied:
            return
        self._copied = True
        if self._ids.device.type != "cuda":
            return
        self._ids = _to_pinned(self._ids)
        if self._values is not None:
            self._values = _to_pinned(self._values)
        self._event = torch.cuda.Event()
        self._event.record()

    def result(self) -> HostSample:
        """Wait for the copy (the step's one synchronisation) and return host values."""
        self.start_copy()
        if self._event is not None:
            self._event.synchronize()
        ids = self._ids.tolist()
        token_ids = ids[: self._num_rows]
        logprobs: list[dict[int, float] | None] = [None] * self._num_rows
        if self._logprob_rows:
            values = self._values.tolist()
            num_top = (len(ids) - self._num_rows) // len(self._logprob_rows)
            for index, (row, count) in enumerate(zip(self._logprob_rows, self._logprob_counts)):
                base = index * (1 + num_top)
                entry = {token_ids[row]: values[base]}
                top_ids = ids[self._num_rows + index * num_top: self._num_rows + index * num_top + count]
                entry.update(zip(top_ids, values[base + 1: base + 1 + count]))
                logprobs[row] = entry
        return HostSample(token_ids, logprobs)


def _to_pinned(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


@dataclass
class _StepTables:
    """Host lists of one step, in row order unless named otherwise."""
    temperature: list[float] = field(default_factory=list)
    top_k: list[int] = field(default_factory=list)
    top_p: list[float] = field(default_factory=list)
    min_p: list[float] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    bias_rows: list[int] = field(default_factory=list)
    bias_ids: list[int] = field(default_factory=list)
    bias_values: list[float] = field(default_factory=list)
    banned_rows: list[int] = field(default_factory=list)       # min_tokens: (row, id) set to -inf
    banned_ids: list[int] = field(default_factory=list)
    penalty_rows: list[int] = field(default_factory=list)
    penalty_slots: list[int] = field(default_factory=list)
    presence: list[float] = field(default_factory=list)
    frequency: list[float] = field(default_factory=list)
    repetition: list[float] = field(default_factory=list)
    logprob_rows: list[int] = field(default_factory=list)
    logprob_counts: list[int] = field(default_factory=list)
    drawn_rows: list[int] = field(default_factory=list)           # rows that are not greedy
    draw_groups: dict[int, list[int]] = field(default_factory=dict)   # filter width -> its drawn rows
    group_rows: list[int] = field(default_factory=list)           # the groups' rows, one group after another


_DEVICE_INTS = ("top_k", "seeds", "positions", "bias_rows", "bias_ids", "banned_rows", "banned_ids", "penalty_rows",
                "penalty_slots", "logprob_rows", "group_rows")
_DEVICE_FLOATS = ("temperature", "top_p", "min_p", "bias_values", "presence", "frequency", "repetition")


class _DeviceTables(NamedTuple):
    """The step's host tables on the device (int64, then float32), views of two copies."""
    top_k: torch.Tensor
    seeds: torch.Tensor
    positions: torch.Tensor
    bias_rows: torch.Tensor
    bias_ids: torch.Tensor
    banned_rows: torch.Tensor
    banned_ids: torch.Tensor
    penalty_rows: torch.Tensor
    penalty_slots: torch.Tensor
    logprob_rows: torch.Tensor
    group_rows: torch.Tensor
    temperature: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    bias_values: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor


class Sampler:
    """Samples every row of a step in one batched call. Owns each request's draw seed and, for requests with
    penalties, its token counts on the device. Rules: `add_request` before a request's first row, `remove_request`
    when it finishes (frees its device state); one request at most once per `sample` call."""

    def __init__(self, vocab_size: int, device, eos_token_ids: set[int], ops=None) -> None:
        if ops is None:
            from k3core.backend import reference_ops
            ops = reference_ops()
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.eos_token_ids = frozenset(t for t in eos_token_ids if 0 <= t < vocab_size)
        self._sample_op = ops.sample
        self._requests: dict[str, _RequestState] = {}
        self._output_counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=self.device)   # [S, V]
        self._prompt_seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=self.device)      # [S, V]
        self._free_slots: list[int] = []

    # ---- requests -----------------------------------------------------------------------------------------
    def add_request(self, request_id: str, params: SamplingParams, prompt_token_ids) -> None:
        if request_id in self._requests:
            raise ValueError(f"sampler: request {request_id!r} was added twice; remove it first")
        outside = [t for t in params.logit_bias if t >= self.vocab_size]
        if outside:
            raise ValueError(f"logit_bias names token ids {outside[:5]} outside the vocabulary (size "
                             f"{self.vocab_size}); use ids below {self.vocab_size}")
        seed = params.seed
        if seed is None:                        # torch's global CPU generator: torch.manual_seed replays it
            seed = int(torch.randint(INT64_MIN, INT64_MAX, (), dtype=torch.int64))
        slot = None
        if params.uses_penalties:
            slot = self._take_slot()
            prompt = [t for t in prompt_token_ids if 0 <= t < self.vocab_size]
            (ids,) = index_tables([prompt], self.device, torch.int64)
            self._output_counts[slot].zero_()
            self._prompt_seen[slot].zero_()
            self._prompt_seen[slot, ids] = True
        self._requests[request_id] = _RequestState(seed, slot)

    def remove_request(self, request_id: str) -> None:
        """Forget a request and free its device state (unknown ids: nothing to do)."""
        state = self._requests.pop(request_id, None)
        if state is not None and state.count_slot is not None:
            self._free_slots.append(state.count_slot)

    def recount(self, request_id: str, prompt_token_ids, output_token_ids) -> None:
        """Rebuild a request's penalty counts from its tokens (after a failed step was rolled back, the counts may
        hold ids that were sampled but then dropped). Requests without penalties keep no counts: nothing to do."""
        state = self._requests.get(request_id)
        if state is None or state.count_slot is None:
            return
        slot = state.count_slot
        prompt = [t for t in prompt_token_ids if 0 <= t < self.vocab_size]
        output = [t for t in output_token_ids if 0 <= t < self.vocab_size]
        prompt_ids, output_ids = index_tables([prompt, output], self.device, torch.int64)
        self._prompt_seen[slot].zero_()
        self._prompt_seen[slot, prompt_ids] = True
        self._output_counts[slot].zero_()
        self._output_counts[slot].index_add_(0, output_ids, torch.ones_like(output_ids, dtype=torch.int32))

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def _take_slot(self) -> int:
        if not self._free_slots:
            old = self._output_counts.shape[0]
            new = max(4, 2 * old)
            self._output_counts = torch.cat([self._output_counts, self._output_counts.new_zeros(new - old,
                                                                                                 self.vocab_size)])
            self._prompt_seen = torch.cat([self._prompt_seen, self._prompt_seen.new_zeros(new - old,
                                                                                           self.vocab_size)])
            self._free_slots.extend(range(new - 1, old - 1, -1))
        return self._free_slots.pop()

    # ---- one step -----------------------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, rows: Sequence[SampleRow],
               grammar: GrammarMask | None = None) -> DeviceSample:
        """logits [R, V] (any float dtype, on the device), one row per SampleRow in order -> DeviceSample.
        Device work only; the host tables go over in two non-blocking copies (three with a grammar mask)."""
        host, dev = self._tables(logits, rows)
        x = self._processed(logits, rows, host, dev, grammar)                          # [R, V] float32
        groups = host.draw_groups                                                      # filter width -> rows
        if len(groups) == 1 and len(next(iter(groups.values()))) == len(rows):
            (width,) = groups
            token_ids = self._sample_op(x, dev.temperature, dev.top_k, dev.top_p, dev.min_p, dev.seeds,
                                        dev.positions, width)                          # [R] int64
        else:           # a row's draw depends on its own values only, so each group is sampled on its own
            token_ids = x.argmax(dim=-1)                                               # greedy rows: first maximum
            start = 0
            for width, group in groups.items():
                index = dev.group_rows[start: start + len(group)]
                start += len(group)
                token_ids.index_copy_(0, index, self._sample_op(
                    x[index], dev.temperature[index], dev.top_k[index], dev.top_p[index], dev.min_p[index],
                    dev.seeds[index], dev.positions[index], width))
        if host.penalty_rows:
            flat = dev.penalty_slots * self.vocab_size + token_ids[dev.penalty_rows]   # [P] into counts.view(-1)
            ones = torch.ones(len(host.penalty_rows), dtype=torch.int32, device=self.device)
            self._output_counts.view(-1).index_add_(0, flat, ones)
        logprob_ids = logprob_values = None
        if host.logprob_rows:
            logprob_ids, logprob_values = _logprobs(logits[dev.logprob_rows], token_ids[dev.logprob_rows],
                                                    max(host.logprob_counts))
        return DeviceSample(token_ids, host.logprob_rows, host.logprob_counts, logprob_ids, logprob_values)

    def processed_logits(self, logits: torch.Tensor, rows: Sequence[SampleRow],
                         grammar: GrammarMask | None = None) -> torch.Tensor:
        """The logits the draw of `sample` would see for these rows [R, V] float32, without sampling (state is
        not changed): allowed-token mask, grammar mask, logit_bias, min_tokens, then the penalties."""
        host, dev = self._tables(logits, rows)
        return self._processed(logits, rows, host, dev, grammar)

    def _tables(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> tuple[_StepTables, _DeviceTables]:
        if logits.dim() != 2 or logits.shape[0] != len(rows) or logits.shape[1] != self.vocab_size:
            raise ValueError(f"sampler: logits of shape {tuple(logits.shape)} for {len(rows)} rows; need "
                             f"[{len(rows)}, {self.vocab_size}]")
        host = _StepTables()
        vocab = self.vocab_size
        for row, item in enumerate(rows):
            state = self._requests.get(item.request_id)
            if state is None:
                raise KeyError(f"sampler: request {item.request_id!r} has no state; call add_request first")
            params = item.params
            host.temperature.append(params.temperature)
            if not params.greedy:
                host.drawn_rows.append(row)
            host.top_k.append(params.top_k if params.top_k < vocab else 0)
            host.top_p.append(params.top_p)
            host.min_p.append(params.min_p)
            host.seeds.append(state.seed)
            num_output = len(item.output_token_ids)
            host.positions.append(num_output)
            for token_id, bias in params.logit_bias.items():
                host.bias_rows.append(row)
                host.bias_ids.append(token_id)
                host.bias_values.append(bias)
            if num_output < params.min_tokens:
                banned = {t for t in params.stop_token_ids if t < vocab}
                if not params.ignore_eos:
                    banned |= self.eos_token_ids
                host.banned_rows.extend([row] * len(banned))
                host.banned_ids.extend(sorted(banned))
            if state.count_slot is not None:
                host.penalty_rows.append(row)
                host.penalty_slots.append(state.count_slot)
                host.presence.append(params.presence_penalty)
                host.frequency.append(params.frequency_penalty)
                host.repetition.append(params.repetition_penalty)
            if params.logprobs is not None:
                host.logprob_rows.append(row)
                host.logprob_counts.append(params.logprobs)
        host.draw_groups = _draw_groups(host, vocab)
        host.group_rows = [row for group in host.draw_groups.values() for row in group]
        ints = index_tables([getattr(host, name) for name in _DEVICE_INTS], self.device, torch.int64)
        floats = index_tables([getattr(host, name) for name in _DEVICE_FLOATS], self.device, torch.float32)
        return host, _DeviceTables(*ints, *floats)

    def _processed(self, logits: torch.Tensor, rows: Sequence[SampleRow], host: _StepTables,
                   dev: _DeviceTables, grammar: GrammarMask | None = None) -> torch.Tensor:
        masked = [row for row, item in enumerate(rows) if item.allowed_token_mask is not None]
        changes = masked or grammar is not None or host.bias_rows or host.banned_rows or host.penalty_rows
        x = logits.to(torch.float32)                                                    # [R, V]
        if changes:                                                                     # a private dense copy
            x = x.clone(memory_format=torch.contiguous_format) if x is logits else x.contiguous()
        if masked:
            allowed = torch.ones_like(x, dtype=torch.bool)                              # [R, V]
            on_host = [row for row in masked if rows[row].allowed_token_mask.device.type == "cpu"]
            copied = index_tables([rows[row].allowed_token_mask for row in on_host], self.device, torch.bool)
            for row, mask in zip(on_host, copied):
                allowed[row] = mask
            for row in masked:
                if row not in on_host:
                    allowed[row] = rows[row].allowed_token_mask
            x.masked_fill_(~allowed, NEG_INF)
        vocab = self.vocab_size
        if grammar is not None:
            bits, grammar_rows = index_tables([grammar.bitmask, grammar.rows], self.device, torch.int32)
            grammar_rows = grammar_rows.long()                                          # [G]
            refused = ~unpack_bitmask(bits.view(len(grammar.rows), -1), vocab)          # [G, V]
            x.index_copy_(0, grammar_rows, x.index_select(0, grammar_rows).masked_fill_(refused, NEG_INF))
        if host.bias_rows:
            x.view(-1).index_add_(0, dev.bias_rows * vocab + dev.bias_ids, dev.bias_values)
        if host.banned_rows:
            x.view(-1).index_fill_(0, dev.banned_rows * vocab + dev.banned_ids, NEG_INF)
        if host.penalty_rows:
            counts = self._output_counts[dev.penalty_slots]                             # [P, V] int32
            in_output = counts > 0
            seen = self._prompt_seen[dev.penalty_slots] | in_output
            part = x[dev.penalty_rows]                                                  # [P, V]
            rep = dev.repetition[:, None]
            part = torch.where(seen, torch.where(part > 0, part / rep, part * rep), part)
            part = part - dev.frequency[:, None] * counts - dev.presence[:, None] * in_output
            x.index_copy_(0, dev.penalty_rows, part)
        return x


def filter_width(top_k: Sequence[int], top_p: Sequence[float], min_p: Sequence[float], greedy: Sequence[bool],
                 vocab_size: int) -> int:
    """The `filter_width` the `sample` op needs for these rows: 0 when no sampled row filters, the largest top_k
    when every filtering row has one, else the whole vocabulary (a top-p or min-p row without top_k sorts it)."""
    return max((_row_width(k, p, m, vocab_size) for k, p, m, g in zip(top_k, top_p, min_p, greedy) if not g),
               default=0)


def _row_width(top_k: int, top_p: float, min_p: float, vocab_size: int) -> int:
    if 0 < top_k < vocab_size:
        return top_k
    return 0 if top_p >= 1.0 and min_p <= 0.0 else vocab_size


def _draw_groups(host: _StepTables, vocab_size: int) -> dict[int, list[int]]:
    """The rows that draw (not greedy), grouped so that rows without filters never pay a sort and top-k rows never
    pay a full one: unfiltered rows (width 0), top-k rows (width = the group's largest top_k), the rest (V)."""
    groups: dict[int, list[int]] = {}
    widths: dict[int, int] = {}
    for row in host.drawn_rows:
        width = _row_width(host.top_k[row], host.top_p[row], host.min_p[row], vocab_size)
        kind = width if width in (0, vocab_size) else -1
        groups.setdefault(kind, []).append(row)
        widths[kind] = max(widths.get(kind, 0), width)
    return {widths[kind]: rows for kind, rows in groups.items()}


def _logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Of the raw model distribution: (top ids [L, n] int64, values [L, 1 + n] float32: the sampled token's
    logprob, then the top n)."""
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)                  # [L, V]
    sampled = logprobs.gather(1, token_ids[:, None])                                # [L, 1]
    if num_top == 0:
        return token_ids.new_zeros(token_ids.shape[0], 0), sampled
    top = torch.topk(logprobs, min(num_top, logprobs.shape[-1]), dim=-1)
    return top.indices, torch.cat([sampled, top.values], dim=-1)
