"""Request: one generation request and the sequence state it holds while it runs."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from k3core.prompt_logprobs import PromptLogprobs
from k3core.sampling_params import SamplingParams

# An output token sampled by a step still running on the device (overlapped steps); replaced by its id once the
# host reads it. Only ever the last entries of `output_token_ids`; `Request.num_unresolved` counts them.
UNRESOLVED_TOKEN = -1


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None    # filled by position while the prompt runs (when asked for)
    num_known_prompt_logprobs: int = 0     # prompt positions 0..n-1 whose logprobs came from the store at arrival
    status: Status = Status.WAITING
    finish_reason: str | None = None

    # sequence state, all released on finish, retraction or abort
    working_slot: int | None = None          # SlotHandle of the KDA working slot
    page_handles: list[int] = field(default_factory=list)   # MLA pages covering the fed tokens, in order
    owned_pages: set[int] = field(default_factory=set)      # the subset this request owns (the rest: the tree's)
    num_computed_tokens: int = 0             # tokens already fed into the slot and pages
    num_cached_tokens: int = 0               # of the prompt, served from the prefix cache at admission
    cache_node: Any = None                   # locked radix node of the hit (None when no hit)
    checkpoint_positions: list[int] = field(default_factory=list)   # pending snapshot positions
    num_retractions: int = 0
    num_unresolved: int = 0                  # trailing UNRESOLVED_TOKEN entries of output_token_ids
    text: str = ""
    first_token_time: float | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list (a decode step reads one token)."""
        prompt = len(self.prompt_token_ids)
        if start >= prompt:
            return self.output_token_ids[start - prompt: end - prompt]
        return self.all_token_ids[start:end]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether the prompt's logits must still be computed here: asked for, and no token sampled yet (a request
        retracted later recomputes its prompt without them)."""
        return self.prompt_logprobs is not None and not self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens still to feed before the next sample (the whole rest of the prompt, or the last sampled token)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_pending_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED
