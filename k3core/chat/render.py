"""A chat request to the prompt ids the server runs, in the model's chat format.

The format is chosen from the tokenizer (`chat_format`):
* `"xtml"`: a `kimi_k3` model; rendered by `k3core.chat.xtml` segment by segment;
* `"jinja"`: a checkpoint that ships a jinja chat template (Kimi-Linear, most others); rendered in a sandbox
  (`k3core.chat.templates`), then encoded with special tokens recognised, as Hugging Face does;
* `"plain"`: presets and checkpoints without a template: the plain template of `k3core.chat.plain`.
"""
from __future__ import annotations

from typing import Any, Sequence

from k3core.chat import xtml
from k3core.chat.plain import plain_chat_text
from k3core.chat.templates import render_template

CHAT_FORMATS = ("xtml", "jinja", "plain")


def chat_format(tokenizer: Any) -> str:
    if getattr(tokenizer, "model_type", None) == "kimi_k3":
        return "xtml"
    return "jinja" if getattr(tokenizer, "chat_template", None) else "plain"


def _special_tokens(tokenizer: Any) -> dict[str, str | None]:
    name = getattr(tokenizer, "token_name", None)
    if not callable(name):
        return {}
    eos = getattr(tokenizer, "eos_token_ids", ()) or ()
    return {"bos_token": name(getattr(tokenizer, "bos_token_id", None)) or "",
            "eos_token": (name(eos[0]) if eos else None) or "",
            "pad_token": name(getattr(tokenizer, "pad_token_id", None)) or ""}


def render_messages(tokenizer: Any, messages: Sequence[dict[str, Any]], tools: Sequence[Any] | None = None,
                    thinking: bool = True, thinking_effort: str = xtml.DEFAULT_THINKING_EFFORT,
                    tool_choice: Any = None, response_format: dict[str, Any] | None = None,
                    add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The prompt ids (generation prompt included) that the server runs for this chat request.

    `messages` are OpenAI chat messages (dicts: role, content, name, tool_calls, tool_call_id, reasoning_content).
    `thinking`, `thinking_effort`, `tool_choice` and `response_format` shape an XTML prompt; a jinja template gets
    `tools` and `template_kwargs` (plus `thinking` / `enable_thinking` when thinking is off) as variables."""
    kind = chat_format(tokenizer)
    if kind == "xtml":
        segments = xtml.prompt_segments(messages, tools, thinking, thinking_effort, tool_choice, response_format,
                                        add_generation_prompt)
        return xtml.encode_segments(tokenizer, segments)
    if kind == "jinja":
        kwargs = dict(template_kwargs or {})
        if not thinking:
            kwargs.setdefault("thinking", False)
            kwargs.setdefault("enable_thinking", False)
        text = render_template(tokenizer.chat_template, messages, tools, add_generation_prompt,
                               _special_tokens(tokenizer), **kwargs)
        encode = getattr(tokenizer, "encode_with_specials", tokenizer.encode)
        return list(encode(text))
    flat = [{"role": m.get("role", "user"), "content": xtml._text(m.get("content"))} for m in messages]
    text = plain_chat_text(flat, add_generation_prompt)
    bos = getattr(tokenizer, "bos_token_id", None)
    return ([bos] if bos is not None else []) + list(tokenizer.encode(text))
