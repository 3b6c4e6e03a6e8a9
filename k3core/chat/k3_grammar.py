"""The grammar of a K3 reply (XTML, ../shared/K3_CHAT_FORMAT.md section 3) as an xgrammar structural tag (JSON).

    [REASONING <|close|>think<|sep|>] <|open|>response<|sep|> CONTENT <|close|>response<|sep|>
    [<|open|>tools<|sep|> CALL+ <|close|>tools<|sep|>] <|close|>message<|sep|>

The prompt already opened `think` (thinking on) or `response` (off), so a thinking-on reply starts with its
reasoning and a thinking-off one with its content. The reasoning stays free text (without XTML markers): the
constraint covers what follows it. CONTENT is free text, or the request's JSON schema / regex / choice / grammar.
Each CALL is `<|open|>call tool="NAME" index="N"<|sep|>` ARGUMENTS `<|close|>call<|sep|>` for one of the allowed
tools, its arguments the tool's JSON-schema parameters in xgrammar's `kimi_k3_xml` style (one
`<|open|>argument key=".." type=".."<|sep|>VALUE<|close|>argument<|sep|>` per property, string values raw).
Free text and string values never contain `<|open|>`, `<|close|>` or `<|sep|>`, so the output parser reads the
reply the grammar built. Plain data only: compiling it is `k3core.structured`'s job.
"""
from __future__ import annotations

import json
from typing import Any, Sequence

from k3core.chat.parsers import CLOSE_CALL, CLOSE_MESSAGE, CLOSE_RESPONSE, CLOSE_THINK, CLOSE_TOOLS, \
    OPEN_RESPONSE, OPEN_TOOLS
from k3core.chat.xtml import CLOSE, OPEN, SEP

MARKER_TEXTS = [OPEN, CLOSE, SEP]
MAX_JSON_WHITESPACE = 1          # as k3core.structured.compiler: no runs of blanks a looping model could fill
TOOLS_MODES = ("none", "optional", "required")


def free_text() -> dict[str, Any]:
    return {"type": "any_text", "excludes": MARKER_TEXTS}


def json_content(schema: Any) -> dict[str, Any]:
    """A JSON value matching `schema` (a dict, or True for any JSON object) as a reply's content."""
    return {"type": "json_schema", "json_schema": schema if isinstance(schema, dict) else {"type": "object"},
            "excludes": MARKER_TEXTS, "max_whitespace_cnt": MAX_JSON_WHITESPACE}


def _call(tool: dict[str, Any]) -> dict[str, Any]:
    function = tool.get("function", tool)
    parameters = function.get("parameters")
    if not isinstance(parameters, dict) or not parameters:
        parameters = {"type": "object"}
    return {"type": "tag", "begin": f'{OPEN}call tool="{function["name"]}" index="', "content": {
        "type": "sequence", "elements": [
            {"type": "regex", "pattern": r"[1-9][0-9]{0,2}"}, {"type": "const_string", "value": f'"{SEP}'},
            {"type": "json_schema", "json_schema": parameters, "style": "kimi_k3_xml", "excludes": MARKER_TEXTS,
             "max_whitespace_cnt": MAX_JSON_WHITESPACE}]},
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
