"""Text on the HTTP side: chat messages to token ids, and streamed tokens back to text without take-backs.

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


class IncrementalText:
    """Turns a growing list of token ids into text deltas that never need to be taken back.

    Two things are held back until more tokens arrive: an unfinished UTF-8 character (the decoder shows it as
    U+FFFD), and the last `len(longest stop) - 1` characters, which might be the start of a stop string that the
    client must never see. When a stop string appears the text is cut just before it and `stopped` is set.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str]):
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""                # the final text so far (up to a stop string)
        self.emitted = 0              # characters of `text` already handed out
        self.stopped = False

    def push(self, token_ids: Sequence[int]) -> str:
        if self.stopped:
            return ""
        self.token_ids.extend(token_ids)
        self.text = self.tokenizer.decode(self.token_ids)
        for stop in self.stop:
            index = self.text.find(stop)
            if index >= 0:
                self.text = self.text[:index]
                self.stopped = True
        if self.stopped:
            return self._take(len(self.text))
        safe = len(self.text.rstrip("\ufffd")) - self.hold
        return self._take(safe)

    def finish(self) -> str:
        """Everything not yet handed out (an unfinished character stays as U+FFFD, as a final decode shows it)."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        if end <= self.emitted:
            return ""
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
