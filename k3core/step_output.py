"""What a step emits for a request (`StepOutput`) and the rules that finish a request after a sampled token: a
stop token or EOS, a stop string, max_tokens, or the model's context length.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from k3core.prompt_logprobs import PromptLogprobs
from k3core.sched.request import Request
from k3core.stop import OutputText


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    new_logprobs: list[dict[int, float]] = field(default_factory=list)
    new_text: str = ""          # text a client may see now: never part of a stop string, never taken back
    error: str | None = None    # finish_reason "error": what failed while running this request's work
    prompt_logprobs: PromptLogprobs | None = None    # on the request's first output, when asked for


def finish_reason(request: Request, token_id: int, output_text: OutputText, eos_token_ids: set[int],
                  max_context: int) -> str | None:
    """Why the request ends with `token_id` (already appended, resolved), or None: "stop" for a stop token, EOS
    (unless ignore_eos) or a completed stop string; "length" at max_tokens or at `max_context` tokens in all."""
    params = request.params
    if token_id in params.stop_token_ids:
        return "stop"
    if not params.ignore_eos and token_id in eos_token_ids:
        return "stop"
    if output_text.stopped:
        return "stop"
    resolved = len(request.output_token_ids) - request.num_unresolved
    if resolved >= params.max_tokens:
        return "length"
    if request.num_tokens - request.num_unresolved >= max_context:
        return "length"
    return None


def drop_unresolved(request: Request) -> None:
    """Forget tokens a step still in flight samples for a request that ends now (their work is wasted)."""
    if request.num_unresolved:
        del request.output_token_ids[-request.num_unresolved:]
        request.num_unresolved = 0
