"""A request's structured-output fields to the one `StructuredSpec` the engine enforces, or a 400.

Fields: chat `response_format` (json_object / json_schema; "text" is no constraint), `structured_outputs` (vLLM's:
json / regex / choice / grammar, on completions and chat) and chat `tool_choice` "required" or a named function.
At most one of response_format and structured_outputs; `parallel_tool_calls: false` allows one call at most. For a completion, or a chat model whose format has no
reply structure (jinja, plain), the constraint covers the whole output; tool calls need the K3 format. For a K3
(XTML) model the constraint is the K3 reply grammar (`k3core.chat.k3_grammar`) with the content constrained and,
for "required" / a named function, a tool section whose arguments match each tool's parameters (the content is
then empty unless a content constraint is given too, as OpenAI's forced calls come without content). A thinking-on
reply's reasoning stays free: the grammar starts with it (free text up to `<|close|>think<|sep|>`).
"""
from __future__ import annotations

import json
from typing import Any

from k3core.chat import chat_format
from k3core.chat.k3_grammar import NO_CONTENT, json_content, k3_reply_tag
from k3core.serve.protocol import APIError, ChatRequest, SamplingRequest
from k3core.structured import StructuredSpec


def _content_spec(req: SamplingRequest) -> tuple[str, str, Any] | None:
    """(field, kind, value) of the request's content constraint, or None."""
    response_format = getattr(req, "response_format", None) or {}
    kind = response_format.get("type", "text")
    structured = req.structured_outputs
    if kind != "text" and structured:
        raise APIError("give either 'response_format' or 'structured_outputs', not both", param="structured_outputs",
                       code="invalid_value")
    if kind == "json_object":
        return "response_format", "json_object", None
    if kind == "json_schema":
        spec = response_format["json_schema"]
        return "response_format", "json_schema", spec.get("schema", True)
    if structured:
        ((key, value),) = structured.items()
        name = {"json": "json_schema"}.get(key, key)
        return f"structured_outputs.{key}", name, value
    return None


def _whole_output(field: str, kind: str, value: Any) -> StructuredSpec:
    if kind == "json_schema":
        text = json.dumps(value if isinstance(value, dict) else {"type": "object"})
    elif kind == "choice":
        text = json.dumps(value)
    else:
        text = value or ""
    return StructuredSpec(kind, text, field)


def _k3_content(kind: str, value: Any) -> dict[str, Any]:
    if kind in ("json_schema", "json_object"):
        return json_content(value if kind == "json_schema" else True)
    if kind == "regex":
        return {"type": "regex", "pattern": value}
    if kind == "choice":
        return {"type": "or", "elements": [{"type": "const_string", "value": c} for c in value]}
    return {"type": "grammar", "grammar": value}


def _chosen_tools(req: ChatRequest) -> tuple[str, list[dict[str, Any]], bool]:
    """(tools mode, the tools a call may use, exactly one call)."""
    choice, single = req.tool_choice, not req.parallel_tool_calls
    if choice in (None, "auto", "none"):
        return ("optional" if req.tools and choice != "none" else "none"), list(req.tools or []), single
    if not req.tools:
        raise APIError(f"'tool_choice' {choice!r:.60} needs 'tools' to choose from", param="tool_choice",
                       code="invalid_value")
    if choice == "required":
        return "required", list(req.tools), single
    name = choice["function"]["name"]
    named = [tool for tool in req.tools if tool.get("function", {}).get("name") == name]
    if not named:
        offered = ", ".join(str(tool.get("function", {}).get("name")) for tool in req.tools)
        raise APIError(f"'tool_choice' names the function {name!r}, which is not among 'tools' ({offered})",
                       param="tool_choice", code="invalid_value")
    return "required", named[:1], True


def request_spec(req: SamplingRequest, tokenizer: Any, thinking: bool = False) -> StructuredSpec | None:
    """The constraint of a completion or chat request (None: unconstrained). `thinking`: the chat prompt opened
    K3's think channel."""
    content = _content_spec(req)
    if not isinstance(req, ChatRequest):
        return None if content is None else _whole_output(*content)
    forced = req.tool_choice not in (None, "auto", "none")
    single = not req.parallel_tool_calls and bool(req.tools) and req.tool_choice != "none"
    if chat_format(tokenizer) != "xtml":
        if forced or single:
            name = "tool_choice" if forced else "parallel_tool_calls"
            raise APIError(f"'{name}' {getattr(req, name)!r:.60} needs a chat format with a tool-call grammar; "
                           f"this model's ({chat_format(tokenizer)}) has none, so leave it out",
                           param=name, code="unsupported_parameter")
        return None if content is None else _whole_output(*content)
    if content is None and not forced and not single:
        return None
    mode, tools, single = _chosen_tools(req)
    field = content[0] if content is not None else "tool_choice"
    body = (NO_CONTENT if forced else None) if content is None else _k3_content(content[1], content[2])
    tag = k3_reply_tag(thinking, body, tools, mode, single)
    return StructuredSpec("structural_tag", tag, field)
