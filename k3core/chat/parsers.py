"""K3's output text to reasoning, content and tool calls, whole or as it streams.

A K3 completion, after a prompt that opened `think` (../shared/K3_CHAT_FORMAT.md section 3):

    REASONING<|close|>think<|sep|><|open|>response<|sep|>ANSWER<|close|>response<|sep|>
    [<|open|>tools<|sep|><|open|>call tool="NAME" index="1"<|sep|>ARGS<|close|>call<|sep|>...<|close|>tools<|sep|>]
    <|close|>message<|sep|>

(after a prompt that opened `response`, the text starts at ANSWER). The parser reads the decoded text with the
structure markers spelled out (k3core's Kimi tokenizer keeps them when decoding).

Reasoning is everything before the first `<|close|>think<|sep|>` (a repeated `<|open|>think<|sep|>` at the start
is dropped); with no close marker yet, all of it. Content is what follows, without `<|open|>response<|sep|>`, up to
`<|close|>response<|sep|>`. A tool section runs from `<|open|>tools<|sep|>` to `<|close|>tools<|sep|>` or to the
end; each complete `call` with a `tool` attribute becomes a `ToolCall` whose arguments are the JSON of its
`argument` children (strings raw, other types JSON-decoded, the raw text when that fails) or of its `json` child.
A call cut off before its `<|close|>call<|sep|>` is dropped. `<|close|>message<|sep|>` ends the output.

Streaming (`K3OutputParser.feed`): text is handed out as soon as it cannot be the start of a marker the current
state looks for; a suffix that could be is held back until the next text decides it. A tool call is handed out
once its close marker arrives. The whole text fed in pieces gives the same result as `parse_k3_output` on it.
On text alone a string argument that spells `<|close|>argument<|sep|>` is indistinguishable from the marker.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from k3core.chat.xtml import CLOSE, OPEN, SEP

OPEN_THINK, CLOSE_THINK = f"{OPEN}think{SEP}", f"{CLOSE}think{SEP}"
OPEN_RESPONSE, CLOSE_RESPONSE = f"{OPEN}response{SEP}", f"{CLOSE}response{SEP}"
OPEN_TOOLS, CLOSE_TOOLS = f"{OPEN}tools{SEP}", f"{CLOSE}tools{SEP}"
CLOSE_CALL, CLOSE_MESSAGE = f"{CLOSE}call{SEP}", f"{CLOSE}message{SEP}"

_ATTRIBUTE = re.compile(r' ([\w-]+)="([^"]*)"')
_CALL = re.compile(re.escape(OPEN) + r"call((?: [\w-]+=\"[^\"]*\")*)" + re.escape(SEP) + r"(.*?)"
                   + re.escape(CLOSE_CALL), re.S)
_CHILD = re.compile(re.escape(OPEN) + r"(argument|json)((?: [\w-]+=\"[^\"]*\")*)" + re.escape(SEP) + r"(.*?)"
                    + re.escape(CLOSE) + r"\1" + re.escape(SEP), re.S)


@dataclass
class ToolCall:
    name: str
    arguments: str          # a JSON object as text (json.dumps of the decoded arguments)
    index: int              # 0-based position among this output's calls
    id: str | None = None   # the id the model gave the call (K2's `functions.NAME:IDX`); None: the server makes one


@dataclass
class ParsedOutput:
    reasoning_content: str | None
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class ParsedDelta:
    """What one piece of streamed text added."""
    reasoning_content: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning_content or self.content or self.tool_calls)


def _unescape(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")


def _attributes(text: str) -> dict[str, str]:
    return {key: _unescape(value) for key, value in _ATTRIBUTE.findall(text)}


def _argument_value(kind: str | None, text: str):
    if kind == "string":
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_call_arguments(body: str) -> str:
    """The JSON text of a call body's `argument` children (or of its `json` child)."""
    arguments: dict = {}
    for tag, attribute_text, value in _CHILD.findall(body):
        attributes = _attributes(attribute_text)
        if tag == "json":
            try:
                return json.dumps(json.loads(value), ensure_ascii=False)
            except json.JSONDecodeError:
                return value
        if "key" in attributes:
            arguments[attributes["key"]] = _argument_value(attributes.get("type"), value)
    return json.dumps(arguments, ensure_ascii=False)


def held_suffix_length(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of one of `markers`."""
    for length in range(min(len(text), max(len(m) for m in markers) - 1), 0, -1):
        if any(m.startswith(text[-length:]) for m in markers):
            return length
    return 0


class K3OutputParser:
    """Incremental parser of one K3 output. `feed(text)` -> ParsedDelta; `finish()` hands out what was held back.

    States: reasoning -> (close think) between -> content -> (close response) after -> tools -> done; with
    `thinking=False` it starts at content."""

    _CONTENT_ENDS = (CLOSE_RESPONSE, OPEN_TOOLS, CLOSE_MESSAGE)

    def __init__(self, thinking: bool = True):
        self.thinking = thinking
        self.state = "reasoning" if thinking else "content"
        self.buffer = ""              # text received and not yet consumed
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.tool_calls: list[ToolCall] = []
        self._at_start = True         # nothing of the reasoning consumed yet (a repeated open-think may follow)

    def feed(self, text: str) -> ParsedDelta:
        self.buffer += text
        return self._run(final=False)

    def finish(self) -> ParsedDelta:
        return self._run(final=True)

    def result(self) -> ParsedOutput:
        return ParsedOutput("".join(self.reasoning) if self.thinking else None, "".join(self.content),
                            list(self.tool_calls))

    # ---- the state machine -----------------------------------------------------------------------------------
    def _run(self, final: bool) -> ParsedDelta:
        delta = ParsedDelta()
        while self.buffer and self._step(delta, final):
            pass
        self.reasoning.append(delta.reasoning_content)
        self.content.append(delta.content)
        self.tool_calls += delta.tool_calls
        return delta

    def _emit(self, delta: ParsedDelta, text: str) -> None:
        if self.state == "reasoning":
            delta.reasoning_content += text
        else:
            delta.content += text

    def _scan(self, delta: ParsedDelta, ends: tuple[str, ...], final: bool) -> str | None:
        """Hand out text up to the earliest of `ends` and consume it; return that marker, or None when none is
        complete yet (everything that cannot start one is handed out, unless nothing can be decided)."""
        hits = [(index, marker) for marker in ends if (index := self.buffer.find(marker)) >= 0]
        if hits:
            index, marker = min(hits)
            self._emit(delta, self.buffer[:index])
            self.buffer = self.buffer[index + len(marker):]
            return marker
        keep = 0 if final else held_suffix_length(self.buffer, ends)
        self._emit(delta, self.buffer[:len(self.buffer) - keep])
        self.buffer = self.buffer[len(self.buffer) - keep:]
        return None

    def _expect(self, options: tuple[str, ...], final: bool) -> str | None:
        """The option the buffer starts with (consumed), "" when it might still become one, None when it cannot."""
        stripped = self.buffer.lstrip()
        for option in options:
            if stripped.startswith(option):
                self.buffer = stripped[len(option):]
                return option
        if not final and any(option.startswith(stripped) for option in options):
            return ""
        return None

    def _step(self, delta: ParsedDelta, final: bool) -> bool:
        """One transition; False when it has to wait for more text (or has consumed everything)."""
        if self.state == "reasoning":
            if self._at_start:
                found = self._expect((OPEN_THINK,), final)
                if found == "":
                    return False
                self._at_start = found is not None     # drop every repeat of the open marker
                if found:
                    return True
            marker = self._scan(delta, (CLOSE_THINK,), final)
            if marker is None:
                return False
            self.state = "between"
            return True
        if self.state in ("between", "after"):
            options = (OPEN_RESPONSE, OPEN_TOOLS, CLOSE_MESSAGE) if self.state == "between" \
                else (OPEN_TOOLS, CLOSE_MESSAGE)
            found = self._expect(options, final)
            if found == "":
                return False
            self.state = {OPEN_RESPONSE: "content", OPEN_TOOLS: "tools", CLOSE_MESSAGE: "done",
                          None: "content"}[found]
            return True
        if self.state == "content":
            marker = self._scan(delta, self._CONTENT_ENDS, final)
            if marker is None:
                return False
            self.state = {CLOSE_RESPONSE: "after", OPEN_TOOLS: "tools", CLOSE_MESSAGE: "done"}[marker]
            return True
        if self.state == "tools":
            return self._tools(delta, final)
        self.buffer = ""                                   # done: the end-of-message tail carries nothing
        return False

    def _tools(self, delta: ParsedDelta, final: bool) -> bool:
        end = self.buffer.find(CLOSE_TOOLS)
        section = self.buffer if end < 0 else self.buffer[:end]
        consumed = 0
        for match in _CALL.finditer(section):
            attributes = _attributes(match.group(1))
            consumed = match.end()
            if attributes.get("tool"):
                delta.tool_calls.append(ToolCall(attributes["tool"], parse_call_arguments(match.group(2)),
                                                 len(self.tool_calls) + len(delta.tool_calls)))
        if end >= 0:
            self.buffer = self.buffer[end + len(CLOSE_TOOLS):]
            self.state = "after"
            return True
        self.buffer = self.buffer[consumed:]
        if final:
            self.buffer = ""                               # a call cut off before its close marker is dropped
        return False


def parse_k3_output(text: str, thinking: bool = True) -> ParsedOutput:
    """The reasoning, content and tool calls of one whole K3 output (`thinking`: the prompt opened `think`)."""
    parser = K3OutputParser(thinking)
    parser.feed(text)
    parser.finish()
    return parser.result()
