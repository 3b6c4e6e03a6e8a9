"""What a finished generation returns: `CompletionOutput`, built by the engine and handed out by `LLM.generate`.

It lives apart from both so the engine does not import the public API module that imports the engine.
"""
from __future__ import annotations

from dataclasses import dataclass

from k3core.prompt_logprobs import PromptLogprobs

__all__ = ["CompletionOutput"]


@dataclass
class CompletionOutput:
    """One request's result: the prompt's token ids, the generated tokens and their detokenized text."""
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]               # generated tokens only
    text: str
    finish_reason: str                 # "stop" | "length" | "abort"
    num_cached_tokens: int = 0
    logprobs: list[dict[int, float]] | None = None   # per generated token: {token id: logprob}, when asked for
    prompt_logprobs: PromptLogprobs | None = None     # per prompt token (the first None), when asked for
