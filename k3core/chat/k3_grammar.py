"""The grammar of a K3 reply (XTML, ../shared/K3_CHAT_FORMAT.md section 3) as an xgrammar structural tag (JSON).

    [REASONING <|close|>think<|sep|>] <|open|>response<|sep|> CONTENT <|close|>response<|sep|>
    [<|open|>tools<|sep|> CALL+ <|close|>tools<|sep|>] <|close|>message<|sep|>

The prompt already opened `think` (thinking on) or `response` (off), so a thinking-on reply starts with its
reasoning and a thinking-off one with its content. The reasoning stays free text (without XTML markers): the
constraint covers what follows it. CONTENT is free text, empty (`NO_CONTENT`: a forced tool call, whose content
OpenAI's API leaves empty), or the request's JSON schema / regex / choice / grammar.
Each CALL is `<|open|>call tool="NAME" index="N"<|sep|>` ARGUMENTS `<|close|>call<|sep|>` for one of the allowed
tools: one `<|open|>argument key=".." type=".."<|sep|>VALUE<|close|>argument<|sep|>` per property of the tool's
JSON-schema parameters, in the schema's order, optional ones may be left out; a string VALUE is raw text (an
enum / const / pattern / length-bounded string constrained as such), any other VALUE JSON valid for the
property's schema. Nothing else (no blanks around values: k3core's parser reads string values raw, so xgrammar's
own `kimi_k3_xml` style, which allows them, would let `" UTC\n"` through an enum of "UTC").
Free text and string values never contain `<|open|>`, `<|close|>` or `<|sep|>`, so the output parser reads the
reply the grammar built. Plain data only: compiling it is `k3core.structured`'s job.
"""
from __future__ import annotations

import json
from typing import Any, Sequence

from k3core.chat.parsers import CLOSE_CALL, CLOSE_MESSAGE, CLOSE_RESPONSE, CLOSE_THINK, CLOSE_TOOLS, \
    OPEN_RESPONSE, OPEN_TOOLS
from k3core.chat.xtml import CLOSE, OPEN, SEP, escape_attribute

MARKER_TEXTS = [OPEN, CLOSE, SEP]
MAX_JSON_WHITESPACE = 1          # as k3core.structured.compiler: no runs of blanks a looping model could fill
TOOLS_MODES = ("none", "optional", "required")


NO_CONTENT = {"type": "const_string", "value": ""}


def free_text() -> dict[str, Any]:
    return {"type": "any_text", "excludes": MARKER_TEXTS}


def json_content(schema: Any) -> dict[str, Any]:
    """A JSON value matching `schema` (a dict, or True for any JSON object) as a reply's content."""
    return {"type": "json_schema", "json_schema": schema if isinstance(schema, dict) else {"type": "object"},
            "excludes": MARKER_TEXTS, "max_whitespace_cnt": MAX_JSON_WHITESPACE}


def _const(text: str) -> dict[str, Any]:
    return {"type": "const_string", "value": text}


def _raw_string(schema: dict[str, Any]) -> dict[str, Any] | None:
    """A string property's value as raw text (how XTML writes strings), or None when raw text cannot express it."""
    if "enum" in schema or "const" in schema:
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        if values and all(isinstance(v, str) and not any(m in v for m in MARKER_TEXTS) for v in values):
            return {"type": "or", "elements": [_const(v) for v in values]}
        return None
    if schema.get("type") != "string" or "format" in schema:
        return None
    if "pattern" in schema:
        return {"type": "regex", "pattern": schema["pattern"]}
    if "minLength" in schema or "maxLength" in schema:   # a bounded run without '<' (no marker can start)
        low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
        return {"type": "regex", "pattern": f"[^<]{{{low},{'' if high is None else int(high)}}}"}
    return free_text()


def _json_type(schema: dict[str, Any]) -> str:
    kind = schema.get("type")
    if kind == "integer":
        return "number"
    return kind if kind in ("number", "boolean", "null", "object", "array") else "object"


def _argument(key: str, schema: Any) -> dict[str, Any]:
    """`<|open|>argument key="K" type="T"<|sep|>VALUE<|close|>argument<|sep|>`: strings raw, the rest JSON (a
    string the raw form cannot constrain, e.g. one with a `format`, is written as JSON: the parser decodes it)."""
    schema = schema if isinstance(schema, dict) else {}
    raw = _raw_string(schema)
    kind = "string" if raw is not None else _json_type(schema)
    value = raw if raw is not None else {"type": "json_schema", "json_schema": schema or True,
                                         "excludes": MARKER_TEXTS, "max_whitespace_cnt": MAX_JSON_WHITESPACE}
    head = f'{OPEN}argument key="{escape_attribute(key)}" type="{kind}"{SEP}'
    return {"type": "sequence", "elements": [_const(head), value, _const(f"{CLOSE}argument{SEP}")]}


def _arguments(parameters: Any) -> dict[str, Any]:
    """A call's arguments for its JSON-schema `parameters`: one `argument` per property in the schema's order
    (optional ones may be left out), or, for parameters that are not an object of properties, one `json` child."""
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object" or not isinstance(
            parameters.get("properties", {}), dict) or any(k in parameters for k in ("anyOf", "oneOf", "allOf")):
        json_value = {"type": "json_schema", "json_schema": parameters if isinstance(parameters, dict) else True,
                      "excludes": MARKER_TEXTS, "max_whitespace_cnt": MAX_JSON_WHITESPACE}
        return {"type": "sequence", "elements": [_const(f'{OPEN}json type="object"{SEP}'), json_value,
                                                 _const(f"{CLOSE}json{SEP}")]}
    required = set(parameters.get("required") or [])
    elements = [_argument(key, schema) if key in required else {"type": "optional", "content": _argument(key, schema)}
                for key, schema in (parameters.get("properties") or {}).items()]
    return {"type": "sequence", "elements": elements or [_const("")]}


def _call(tool: dict[str, Any]) -> dict[str, Any]:
    function = tool.get("function", tool)
    return {"type": "tag", "begin": f'{OPEN}call tool="{escape_attribute(function["name"])}" index="', "content": {
        "type": "sequence", "elements": [
            {"type": "regex", "pattern": r"[1-9][0-9]{0,2}"}, _const(f'"{SEP}'), _arguments(function.get("parameters"))]},
        "end": CLOSE_CALL}


def k3_reply_tag(thinking: bool, content: dict[str, Any] | None = None, tools: Sequence[dict[str, Any]] = (),
                 tools_mode: str = "none", single_call: bool = False) -> str:
    """The structural tag (JSON text) of a K3 reply. `content`: a format for the response body (None: free text);
    `tools_mode`: "none" (no tool section), "optional" or "required" (at least one call of one of `tools`);
    `single_call`: exactly one call when required (a named tool_choice)."""
    if tools_mode not in TOOLS_MODES:
        raise ValueError(f"tools_mode {tools_mode!r}: choose one of {TOOLS_MODES}")
    if tools_mode != "none" and not tools:
        raise ValueError("a tool section needs at least one tool")
    elements: list[dict[str, Any]] = []
    if thinking:
        elements.append({"type": "tag", "begin": "", "content": free_text(), "end": CLOSE_THINK})
        elements.append({"type": "const_string", "value": OPEN_RESPONSE})
    elements.append({"type": "tag", "begin": "", "content": content or free_text(), "end": CLOSE_RESPONSE})
    if tools_mode != "none":
        calls = {"type": "tags_with_separator", "tags": [_call(tool) for tool in tools], "separator": "",
                 "at_least_one": True, "stop_after_first": single_call}
        section = {"type": "tag", "begin": OPEN_TOOLS, "content": calls, "end": CLOSE_TOOLS}
        elements.append(section if tools_mode == "required" else {"type": "optional", "content": section})
    elements.append({"type": "const_string", "value": CLOSE_MESSAGE})
    return json.dumps({"type": "structural_tag", "format": {"type": "sequence", "elements": elements}},
                      ensure_ascii=False)
