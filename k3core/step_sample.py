"""Sampling one step's rows: the sampler's single device call on one device, or on the sampler rank of a parallel
plan with each row isolated, so that a request whose sampling raises fails alone.

`Engine._launch` calls `sample_step` once a step with the logits of the rows that sample ([S, V], in the order of
`requests`). On one device the result is a `DeviceSample` whose host copy has started (read by `Engine._process`);
under a plan every rank gets the sampler rank's `ResolvedSample` (broadcast), already on the host.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from k3core.sampler import DeviceSample, HostSample, SampleRow, Sampler
from k3core.sched.request import UNRESOLVED_TOKEN, Request


@dataclass
class ResolvedSample:
    """A sample already on the host (parallel plans: broadcast from the sampler rank)."""
    host: HostSample
    token_ids: None = None
    failed: dict[int, str] = field(default_factory=dict)     # row -> why sampling it raised (the row's token is junk)

    def result(self) -> HostSample:
        return self.host


def sample_step(logits: torch.Tensor | None, requests: list[Request], sampler: Sampler, constraints, runner,
                single_device: bool) -> DeviceSample | ResolvedSample:
    """The batch's next tokens, sampled on the device in one call (`constraints`: the structured outputs'
    matchers, or None). Under a parallel plan the sampler rank samples and every rank receives the host result
    (no overlap there)."""
    rows = [SampleRow(r.request_id, r.params, r.output_token_ids, r.prompt_token_ids) for r in requests]
    if single_device:
        sample = sample_rows(logits, rows, requests, sampler, constraints)
        sample.start_copy()
        return sample
    resolved = None
    if runner.comm.rank == runner.sampler_rank:    # every rank's matchers accept the broadcast tokens
        resolved = sample_rows_apart(logits, rows, requests, sampler, constraints)
    return runner.comm.broadcast_object(resolved, src=runner.sampler_rank)


def sample_rows_apart(logits: torch.Tensor, rows: list[SampleRow], requests: list[Request], sampler: Sampler,
                      constraints) -> ResolvedSample:
    """The sampler rank's sample of a plan's batch. If sampling the batch raises, each row is sampled alone and
    the rows that still raise are marked failed: every rank receives the marks with the tokens and fails those
    requests only, so a poison request neither desynchronises the ranks nor takes its batch down. A row's draw
    depends on its own seed and position only, so the other rows get the tokens the batch would have given."""
    def host_sample(logits_rows: torch.Tensor, subset: list[SampleRow], subset_requests: list[Request]) -> HostSample:
        sample = sample_rows(logits_rows, subset, subset_requests, sampler, constraints)
        sample.start_copy()
        return sample.result()
    try:
        return ResolvedSample(host_sample(logits, rows, requests))
    except Exception:  # noqa: BLE001 (find the offending rows below; the others are sampled again)
        pass
    token_ids, logprobs, failed = [], [], {}
    for index, row in enumerate(rows):
        try:
            one = host_sample(logits[index: index + 1], [row], [requests[index]])
        except Exception as exc:  # noqa: BLE001 (reported to the request, which fails alone)
            failed[index] = f"sampling this request failed ({type(exc).__name__}: {exc})"
            token_ids.append(UNRESOLVED_TOKEN)
            logprobs.append(None)
            continue
        token_ids.append(one.token_ids[0])
        logprobs.append(one.logprobs[0])
    return ResolvedSample(HostSample(token_ids, logprobs), failed=failed)


def sample_rows(logits: torch.Tensor, rows: list[SampleRow], requests: list[Request], sampler: Sampler,
                constraints) -> DeviceSample:
    """The sampler's call, with the token bitmask of the constrained rows when there are any (a batch without
    them makes the call it made before structured outputs existed: nothing is built)."""
    mask = constraints.bitmask([r.request_id for r in requests]) if constraints else None
    if mask is None:
        return sampler.sample(logits, rows)
    return sampler.sample(logits, rows, mask)
