"""Kimi-Linear's (K2-family) output text to content and tool calls, whole or as it streams.

A K2-style completion (the chat template's generation prompt is `<|im_assistant|>assistant<|im_middle|>`):

    CONTENT<|tool_calls_section_begin|>
    <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{JSON}<|tool_call_end|> ...
    <|tool_calls_section_end|>

then the stop token `<|im_end|>`. The markers are special tokens; k3core's Kimi tokenizer keeps their spelling when
decoding, so the parser reads text. Kimi-Linear-Instruct does not think: there is no reasoning channel, and
`reasoning_content` stays None.

Content is all text outside a tool-call section. Inside one, each `<|tool_call_begin|>ID<|tool_call_argument_begin|>
ARGS<|tool_call_end|>` becomes a `ToolCall`: ID (whitespace stripped) is kept as the call's id, since the template
renders it back into the history and into a tool result's `## Return of ID`; the function name is ID without its
`functions.` prefix and `:IDX` suffix; the arguments are ARGS re-serialised (`json.dumps`, non-ASCII kept) when it
is JSON, else the raw text. A call without a name is dropped, and so is a call cut off before `<|tool_call_end|>`.
A section cut off before `<|tool_calls_section_end|>` keeps the calls it completed.

Streaming (`K2OutputParser.feed`): content is handed out as soon as it cannot be the start of the section marker
(a suffix that could be is held back until the next text decides it); a tool call is handed out once its
`<|tool_call_end|>` arrives. The whole text fed in pieces gives the same result as `parse_k2_output` on it.
"""
from __future__ import annotations

import json
import re

from k3core.chat.parsers import ParsedDelta, ParsedOutput, ToolCall, held_suffix_length

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGUMENT_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
K2_TOOL_MARKERS = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END)

_CALL = re.compile(re.escape(CALL_BEGIN) + r"(.*?)" + re.escape(ARGUMENT_BEGIN) + r"(.*?)" + re.escape(CALL_END),
                   re.S)
_FUNCTION_ID = re.compile(r"^(?:functions\.)?(.*?)(?::\d+)?$", re.S)


def function_name(call_id: str) -> str:
    """`functions.get_weather:0` -> `get_weather` (a bare `get_weather` stays as it is)."""
    match = _FUNCTION_ID.match(call_id.strip())
    return match.group(1).strip() if match else ""


def _arguments(text: str) -> str:
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except json.JSONDecodeError:
        return text.strip()


class K2OutputParser:
    """Incremental parser of one Kimi-Linear output. `feed(text)` -> ParsedDelta; `finish()` hands out what was
    held back; `result()` is the whole ParsedOutput so far. States: content -> (section begin) tools -> (section end)
    content."""

    def __init__(self) -> None:
        self.state = "content"
        self.buffer = ""
        self.content: list[str] = []
        self.tool_calls: list[ToolCall] = []

    def feed(self, text: str) -> ParsedDelta:
        self.buffer += text
        return self._run(final=False)

    def finish(self) -> ParsedDelta:
        return self._run(final=True)

    def result(self) -> ParsedOutput:
        return ParsedOutput(None, "".join(self.content), list(self.tool_calls))

    def _run(self, final: bool) -> ParsedDelta:
        delta = ParsedDelta()
        while self.buffer and (self._content(delta, final) if self.state == "content" else self._tools(delta, final)):
            pass
        self.content.append(delta.content)
        self.tool_calls += delta.tool_calls
        return delta

    def _content(self, delta: ParsedDelta, final: bool) -> bool:
        index = self.buffer.find(SECTION_BEGIN)
        if index >= 0:
            delta.content += self.buffer[:index]
            self.buffer = self.buffer[index + len(SECTION_BEGIN):]
            self.state = "tools"
            return True
        keep = 0 if final else held_suffix_length(self.buffer, (SECTION_BEGIN,))
        delta.content += self.buffer[:len(self.buffer) - keep]
        self.buffer = self.buffer[len(self.buffer) - keep:]
        return False

    def _tools(self, delta: ParsedDelta, final: bool) -> bool:
        end = self.buffer.find(SECTION_END)
        section = self.buffer if end < 0 else self.buffer[:end]
        consumed = 0
        for match in _CALL.finditer(section):
            consumed = match.end()
            call_id = match.group(1).strip()
            name = function_name(call_id)
            if name:
                delta.tool_calls.append(ToolCall(name, _arguments(match.group(2)),
                                                 len(self.tool_calls) + len(delta.tool_calls), id=call_id))
        if end >= 0:
            self.buffer = self.buffer[end + len(SECTION_END):]
            self.state = "content"
            return True
        self.buffer = "" if final else self.buffer[consumed:]    # a call cut off before its end is dropped
        return False


def parse_k2_output(text: str) -> ParsedOutput:
    """The content and tool calls of one whole Kimi-Linear (K2-style) output."""
    parser = K2OutputParser()
    parser.feed(text)
    parser.finish()
    return parser.result()
