"""The plain chat template, for presets and checkpoints that ship no template of their own:

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n

one `<|role|>\\n{content}\\n` block per message, then `<|assistant|>\\n` to prompt the reply. It is text, encoded like
any other text (the tokenizer adds the bos id when the model has one).
"""
from __future__ import annotations

from typing import Sequence

__all__ = ["plain_chat_text"]


def plain_chat_text(messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """`messages` ({"role", "content"} with text content) in the plain template; with `add_generation_prompt` the
    text ends with the open assistant turn."""
    blocks = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
    return "".join(blocks) + ("<|assistant|>\n" if add_generation_prompt else "")
