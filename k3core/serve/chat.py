"""Chat on the HTTP side: a request to prompt ids, the model's sampling defaults, and K3 output to messages.

Rendering happens here, in the HTTP process (`k3core.chat.render_messages` in the model's chat format). For a
model whose chat format is XTML (`kimi_k3`) every choice gets a `K3OutputParser`: its text is split into
`reasoning_content`, `content` and `tool_calls`, and streamed deltas carry the same fields. A `kimi_linear` model
with its jinja template gets a `K2OutputParser` (content and K2-style tool calls; it has no reasoning channel).
Other models' text is the content as it is.

Request fields that only XTML can express (`tool_choice` "required" / "none", a `response_format`, a
`reasoning_effort`) are refused by name for models in another format, and so are `tools` for the plain template,
which has no place for them.
"""
from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from k3core.chat import K2OutputParser, K3OutputParser, ParsedDelta, ParsedOutput, TemplateError, ToolCall, XtmlError, \
    chat_format, render_messages
from k3core.serve.protocol import APIError, ChatRequest

SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k")


def generation_defaults(model: str) -> dict[str, Any]:
    """temperature / top_p / top_k from the checkpoint's generation_config.json (empty for presets)."""
    path = Path(model)
    file = (path if path.is_dir() else path.parent) / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {key: data[key] for key in SAMPLING_DEFAULT_KEYS
            if isinstance(data.get(key), (int, float)) and not isinstance(data.get(key), bool)}


def thinking_of(tokenizer: Any, req: ChatRequest) -> bool:
    """Whether this request's prompt opens the think channel: K3 thinks unless the request turns it off."""
    if req.thinking is not None:
        return req.thinking
    return chat_format(tokenizer) == "xtml"


def _render_thinking(tokenizer: Any, req: ChatRequest) -> bool:
    """`thinking` for render_messages. A jinja template hears `thinking=False` / `enable_thinking=False` only when
    the request turned thinking off; a request that says nothing leaves them undefined, as Hugging Face does, so
    that a template whose default is to think (Qwen3's, say) keeps it."""
    if chat_format(tokenizer) == "xtml":
        return thinking_of(tokenizer, req)
    return req.thinking is not False


def _refuse_unexpressed(tokenizer: Any, req: ChatRequest) -> None:
    """A 400 naming the first field this model's chat format has no way to show the model."""
    kind = chat_format(tokenizer)
    if kind == "xtml":
        return
    where = "its chat template" if kind == "jinja" else "the plain chat template (the model ships none)"
    refused = [("tools", req.tools and kind == "plain"),
               ("tool_choice", req.tool_choice in ("required", "none")),
               ("response_format", (req.response_format or {}).get("type", "text") != "text"),
               ("reasoning_effort", req.thinking_effort is not None)]
    for name, present in refused:
        if present:
            raise APIError(f"'{name}' is not supported for this model: {where} cannot express it and the server "
                           f"does not enforce it; leave '{name}' out", param=name, code="unsupported_parameter")


def chat_prompt_ids(tokenizer: Any, req: ChatRequest, add_generation_prompt: bool = True) -> list[int]:
    """The prompt ids of a chat request in the model's chat format; a request the format cannot express is a 400."""
    _refuse_unexpressed(tokenizer, req)
    try:
        return render_messages(tokenizer, [m.as_dict() for m in req.messages], tools=req.tools,
                               thinking=_render_thinking(tokenizer, req), thinking_effort=req.thinking_effort or "max",
                               tool_choice=req.tool_choice, response_format=req.response_format,
                               add_generation_prompt=add_generation_prompt, template_kwargs=req.template_kwargs)
    except (XtmlError, TemplateError) as exc:
        raise APIError(str(exc), param="messages", code="invalid_value") from None


def output_parser(tokenizer: Any, req: ChatRequest) -> K2OutputParser | K3OutputParser | None:
    """A parser for one choice's output, or None when the text is the content as it is."""
    kind = chat_format(tokenizer)
    if kind == "xtml":
        return K3OutputParser(thinking=thinking_of(tokenizer, req))
    if kind == "jinja" and getattr(tokenizer, "model_type", None) == "kimi_linear":
        return K2OutputParser()
    return None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_body(call: ToolCall, streamed: bool) -> dict[str, Any]:
    body = {"id": call.id or new_call_id(), "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}
    return {"index": call.index, **body} if streamed else body


def message_body(parsed: ParsedOutput) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.reasoning_content is not None:
        message["reasoning_content"] = parsed.reasoning_content
    if parsed.tool_calls:
        message["tool_calls"] = [tool_call_body(call, streamed=False) for call in parsed.tool_calls]
    return message


def delta_body(delta: ParsedDelta) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if delta.reasoning_content:
        out["reasoning_content"] = delta.reasoning_content
    if delta.content:
        out["content"] = delta.content
    if delta.tool_calls:
        out["tool_calls"] = [tool_call_body(call, streamed=True) for call in delta.tool_calls]
    return out


def merge_deltas(first: ParsedDelta, second: ParsedDelta) -> ParsedDelta:
    return ParsedDelta(first.reasoning_content + second.reasoning_content, first.content + second.content,
                       first.tool_calls + second.tool_calls)


def finish_reason(reason: str | None, has_tool_calls: bool) -> str | None:
    """OpenAI's "tool_calls" for an output that stopped on its own after calling tools."""
    return "tool_calls" if reason == "stop" and has_tool_calls else reason
