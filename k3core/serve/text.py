"""Text on the HTTP side: chat messages to token ids, and token texts for logprobs.

Streamed output text comes from the engine (k3core.stop): each event carries a delta with stop strings cut.

The chat template is the tokenizer's (`k3core.tokenizer`): the checkpoint's own when it ships one, else the
documented plain template `<|role|>\n{content}\n` per message followed by `<|assistant|>\n`.
"""
from __future__ import annotations

from typing import Any, Sequence

from k3core.serve.protocol import ChatMessage


def render_plain(messages: Sequence[ChatMessage]) -> str:
    """The plain template, for a tokenizer object without `apply_chat_template` (same text as k3core.tokenizer's)."""
    return "".join(f"<|{m.role}|>\n{m.content}\n" for m in messages) + "<|assistant|>\n"


def chat_prompt_ids(tokenizer: Any, messages: Sequence[ChatMessage]) -> list[int]:
    """Token ids of the conversation with an open assistant turn."""
    if not callable(getattr(tokenizer, "apply_chat_template", None)):
        return list(tokenizer.encode(render_plain(messages)))
    rendered = tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in messages])
    if isinstance(rendered, str):
        return list(tokenizer.encode(rendered))
    return [int(t) for t in rendered]


def token_text(tokenizer: Any, token_id: int) -> str:
    """The text of one token for logprobs. A token that shows as nothing or as part of a character (special ids,
    a lone UTF-8 byte) is written `token_id:N`, so that distinct tokens never share a key in `top_logprobs`."""
    text = tokenizer.decode([token_id])
    return text if text and "\ufffd" not in text else f"token_id:{token_id}"
