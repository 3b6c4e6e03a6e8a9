"""Text on the HTTP side: token texts for logprobs.

Streamed output text comes from the engine (k3core.stop): each event carries a delta with stop strings cut. Chat
prompts are rendered in `k3core.serve.chat` (the model's chat format, `k3core.chat`).
"""
from __future__ import annotations

from typing import Any


def token_text(tokenizer: Any, token_id: int) -> str:
    """The text of one token for logprobs. A token that shows as nothing or as part of a character (special ids,
    a lone UTF-8 byte) is written `token_id:N`, so that distinct tokens never share a key in `top_logprobs`."""
    text = tokenizer.decode([token_id])
    return text if text and "\ufffd" not in text else f"token_id:{token_id}"
