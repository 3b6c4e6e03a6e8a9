"""K3's XTML chat format: OpenAI-style messages to the segments of a prompt, and segments to token ids.

XTML (../shared/K3_CHAT_FORMAT.md section 3) marks structure with four control tokens, `<|open|>`, `<|close|>`,
`<|sep|>` and `<|end_of_msg|>`; tag names and attributes are ordinary text:

    <|open|>message role="user"<|sep|>Hi<|close|>message<|sep|><|end_of_msg|>

A rendered prompt is a list of segments. A `Marker` segment is one control token (its special id); every other
segment is encoded on its own as plain text, so user text that spells a marker stays text and the tag name, each
attribute's ` key`, `="`, value and `"` are separate pieces (encoding the joined string gives other ids). There is
no BOS.

Prompt order: the tool declaration (with tools), the thinking-effort note (thinking on), the conversation, the
tool-choice note (`required` / `none`), the response-format note, then the generation prompt: an unclosed
assistant message opening `think` (thinking on) or `response` (off). The response-format note's wording is
k3core's own (the published facts do not give it); every other text is the published one.
"""
from __future__ import annotations

import json
from typing import Any, Sequence

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
MARKERS = (OPEN, CLOSE, SEP, END_OF_MSG)
THINKING_EFFORTS = ("low", "high", "max")
DEFAULT_THINKING_EFFORT = "max"
TOOLS_PREAMBLE = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n"


class Marker(str):
    """A segment that is one of the four XTML control tokens (encoded as its special id)."""


class XtmlError(ValueError):
    """A chat request that XTML cannot express; the message names the field."""


def compact_json(value: Any) -> str:
    """JSON with no spaces, keys sorted at every depth, non-ASCII kept (how XTML quotes tools and schemas)."""
    return json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False)


def escape_attribute(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


def open_tag(tag: str, attributes: Sequence[tuple[str, str]] = ()) -> list[str]:
    out: list[str] = [Marker(OPEN), tag]
    for key, value in attributes:
        out += [f" {key}", '="', escape_attribute(value), '"']
    return out + [Marker(SEP)]


def close_tag(tag: str) -> list[str]:
    return [Marker(CLOSE), tag, Marker(SEP)]


def element(tag: str, body: Sequence[str], attributes: Sequence[tuple[str, str]] = ()) -> list[str]:
    return [*open_tag(tag, attributes), *body, *close_tag(tag)]


def message(role: str, body: Sequence[str], attributes: Sequence[tuple[str, str]] = ()) -> list[str]:
    return [*element("message", body, [("role", role), *attributes]), Marker(END_OF_MSG)]


def system_note(kind: str, text: str) -> list[str]:
    return message("system", [text], [("type", kind)])


# ---- the system notes ------------------------------------------------------------------------------------------
def tools_declaration(tools: Sequence[Any]) -> str:
    return TOOLS_PREAMBLE + compact_json(list(tools)) + "\n```"


def thinking_effort_note(effort: str) -> str:
    return ("`thinking_effort` guides on how much to think in your thinking channel (not including the response "
            "channel), supported values include `low`, `medium`, `high`, and `max`.\n"
            f"Now the system is invoked with `thinking_effort={effort}`.")


def tool_choice_note(choice: str) -> str | None:
    if choice == "required":
        return "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message."
    if choice == "none":
        return "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message."
    return None


def response_format_note(response_format: dict[str, Any] | None) -> str | None:
    kind = (response_format or {}).get("type", "text")
    if kind == "json_object":
        return "The system is invoked with `response_format=json_object`.\nYour response MUST be one JSON object."
    if kind == "json_schema":
        spec = response_format.get("json_schema") or {}
        schema = spec.get("schema", spec) if isinstance(spec, dict) else spec
        return ("The system is invoked with `response_format=json_schema`.\nYour response MUST be JSON that "
                f"validates against this JSONSchema:\n```json\n{compact_json(schema)}\n```")
    return None


# ---- messages --------------------------------------------------------------------------------------------------
def _text(content: Any) -> str:
    """A message's content as text: a string, None, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") if isinstance(part, dict) else str(part) for part in content)
    raise XtmlError(f"message content must be a string or a list of text parts, got {type(content).__name__}")


def _argument_type(value: Any) -> str:
    if isinstance(value, bool):             # bool before int: True is an int in Python
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if value is None:
        return "null"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


def arguments_segments(arguments: Any) -> list[str]:
    """A call's arguments: one `argument` child per key of a JSON object, else one `json` child of the raw text."""
    raw = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    try:
        parsed = json.loads(raw) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        return element("json", [raw], [("type", "object")])
    out: list[str] = []
    for key, value in parsed.items():
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        out += element("argument", [text], [("key", str(key)), ("type", _argument_type(value))])
    return out


def _function(call: dict[str, Any]) -> tuple[str, Any]:
    function = call.get("function") if isinstance(call.get("function"), dict) else call
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise XtmlError("every assistant tool call needs a function name")
    return name, function.get("arguments", "{}")


def tool_calls_segments(calls: Sequence[dict[str, Any]]) -> list[str]:
    body: list[str] = []
    for index, call in enumerate(calls, start=1):
        name, arguments = _function(call)
        body += element("call", arguments_segments(arguments), [("tool", name), ("index", str(index))])
    return element("tools", body)


def assistant_body(entry: dict[str, Any], thinking: bool) -> list[str]:
    body: list[str] = []
    if thinking:
        body += element("think", [_text(entry.get("reasoning_content") or entry.get("reasoning"))])
    body += element("response", [_text(entry.get("content"))])
    if entry.get("tool_calls"):
        body += tool_calls_segments(entry["tool_calls"])
    return body


def _tool_results(results: list[dict[str, Any]], calls: list[dict[str, Any]]) -> list[str]:
    """Tool messages after one assistant turn, put in its call order (by tool_call_id), numbered from 1."""
    order = {call.get("id"): position for position, call in enumerate(calls) if call.get("id") is not None}
    names = {call.get("id"): _function(call)[0] for call in calls if call.get("id") is not None}
    ranked = sorted(enumerate(results), key=lambda item: (order.get(item[1].get("tool_call_id"), len(calls)),
                                                          item[0]))
    out: list[str] = []
    for index, (_, result) in enumerate(ranked, start=1):
        name = result.get("name") or names.get(result.get("tool_call_id")) or ""
        out += message("tool", [_text(result.get("content"))], [("tool", name), ("index", str(index))])
    return out


def conversation_segments(messages: Sequence[dict[str, Any]], thinking: bool) -> list[str]:
    out: list[str] = []
    calls: list[dict[str, Any]] = []          # the latest assistant message's tool calls
    pending: list[dict[str, Any]] = []        # tool results since then, in arrival order
    for entry in messages:
        role = entry.get("role")
        if role == "tool":
            pending.append(entry)
            continue
        if pending:
            out += _tool_results(pending, calls)
            pending = []
        if role == "assistant":
            out += message("assistant", assistant_body(entry, thinking))
            calls = list(entry.get("tool_calls") or [])
        elif role in ("system", "developer", "user"):
            name = entry.get("name")
            attributes = [("name", name)] if isinstance(name, str) and name else []
            out += message("system" if role == "developer" else role, [_text(entry.get("content"))], attributes)
        else:
            raise XtmlError(f"message role {role!r} has no XTML form; use system, user, assistant or tool")
    if pending:
        out += _tool_results(pending, calls)
    return out


def prompt_segments(messages: Sequence[dict[str, Any]], tools: Sequence[Any] | None = None, thinking: bool = True,
                    thinking_effort: str = DEFAULT_THINKING_EFFORT, tool_choice: Any = None,
                    response_format: dict[str, Any] | None = None, add_generation_prompt: bool = True) -> list[str]:
    """The segments of a K3 prompt (see the module docstring for the order)."""
    if thinking and thinking_effort not in THINKING_EFFORTS:
        raise XtmlError(f"thinking effort {thinking_effort!r} is not supported; choose low, high or max "
                        "(or none for no thinking)")
    out: list[str] = []
    if tools:
        out += system_note("tool-declare", tools_declaration(tools))
    if thinking:
        out += system_note("thinking-effort", thinking_effort_note(thinking_effort))
    out += conversation_segments(messages, thinking)
    choice_note = tool_choice_note(tool_choice) if isinstance(tool_choice, str) else None
    if choice_note is not None:
        out += system_note("tool-choice", choice_note)
    format_note = response_format_note(response_format)
    if format_note is not None:
        out += system_note("response-format", format_note)
    if add_generation_prompt:
        out += open_tag("message", [("role", "assistant")]) + open_tag("think" if thinking else "response")
    return out


def segments_text(segments: Sequence[str]) -> str:
    """The prompt as one string (markers spelled out): for reading and for `/tokenize`'s echo, never for encoding."""
    return "".join(segments)


def marker_id(tokenizer: Any, marker: str) -> int:
    """The special id of an XTML control token in `tokenizer` (a k3core tokenizer or a tiktoken Encoding)."""
    lookup = getattr(tokenizer, "special_token_id", None)
    token_id = lookup(marker) if callable(lookup) else None
    if token_id is None and callable(getattr(tokenizer, "encode_single_token", None)):
        token_id = tokenizer.encode_single_token(marker)
    if token_id is None:
        raise XtmlError(f"the tokenizer has no special token {marker}; an XTML (kimi_k3) prompt needs the Kimi "
                        "tokenizer (tiktoken.model with tokenizer_config.json)")
    return int(token_id)


def encode_segments(tokenizer: Any, segments: Sequence[str]) -> list[int]:
    """Markers -> their special ids; every other segment encoded on its own as plain text."""
    encode = getattr(tokenizer, "encode_ordinary", None) or tokenizer.encode
    ids_of = {marker: marker_id(tokenizer, marker) for marker in MARKERS}
    ids: list[int] = []
    for segment in segments:
        if isinstance(segment, Marker):
            ids.append(ids_of[str(segment)])
        elif segment:
            ids += encode(segment)
    return ids
