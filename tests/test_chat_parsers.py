"""K3 output parsers (K3_CHAT_FORMAT.md section 3): whole outputs, and the same outputs streamed in pieces."""
from __future__ import annotations

import json
import random

import pytest

from k3core.chat import K3OutputParser, parse_k3_output
from k3core.chat.parsers import CLOSE_CALL

WORKED = ("The tool returned the weather.<|close|>think<|sep|><|open|>response<|sep|>It is 18 °C and sunny."
          "<|close|>response<|sep|><|close|>message<|sep|>")

ARGUMENTS = {"city": "Paris", "days": 3, "ratio": 0.25, "metric": True, "verbose": False, "since": None,
             "filters": {"rain": [1, 2], "note": "ü"}, "tags": ["a", 1, None], "empty": ""}


def _call(name: str, arguments: dict, index: int) -> str:
    children = ""
    for key, value in arguments.items():
        kind = ("boolean" if isinstance(value, bool) else "number" if isinstance(value, (int, float)) else
                "null" if value is None else "string" if isinstance(value, str) else
                "object" if isinstance(value, dict) else "array")
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        children += f'<|open|>argument key="{key}" type="{kind}"<|sep|>{text}<|close|>argument<|sep|>'
    return f'<|open|>call tool="{name}" index="{index}"<|sep|>{children}<|close|>call<|sep|>'


TOOL_OUTPUT = ("I should call both.<|close|>think<|sep|><|open|>response<|sep|>Checking.<|close|>response<|sep|>"
               "<|open|>tools<|sep|>" + _call("get_weather", ARGUMENTS, 1)
               + '<|open|>call tool="raw" index="2"<|sep|><|open|>json type="object"<|sep|>[1, "two"]'
               '<|close|>json<|sep|><|close|>call<|sep|>'
               + '<|open|>call index="3"<|sep|><|close|>call<|sep|>'          # no tool attribute: dropped
               + "<|close|>tools<|sep|><|close|>message<|sep|>")


def _stream(text: str, pieces: list[str], thinking: bool = True):
    parser = K3OutputParser(thinking)
    deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    return parser, deltas


def _random_pieces(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, len(text) // 3)))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def _joined(deltas, field):
    return "".join(getattr(d, field) for d in deltas)


def test_worked_example():
    parsed = parse_k3_output(WORKED)
    assert parsed.reasoning_content == "The tool returned the weather."
    assert parsed.content == "It is 18 °C and sunny." and parsed.tool_calls == []


@pytest.mark.parametrize("text", [WORKED, TOOL_OUTPUT])
def test_streaming_equals_whole_in_any_pieces(text):
    whole = parse_k3_output(text)
    for seed in range(20):
        pieces = list(text) if seed == 0 else _random_pieces(text, seed)
        parser, deltas = _stream(text, pieces)
        assert _joined(deltas, "reasoning_content") == whole.reasoning_content
        assert _joined(deltas, "content") == whole.content
        assert [c for d in deltas for c in d.tool_calls] == whole.tool_calls == parser.result().tool_calls
        # no marker text ever leaks into reasoning or content
        assert "<|" not in _joined(deltas, "reasoning_content") + _joined(deltas, "content")


def test_tool_calls_of_every_json_type():
    parsed = parse_k3_output(TOOL_OUTPUT)
    assert parsed.reasoning_content == "I should call both." and parsed.content == "Checking."
    assert [(c.name, c.index) for c in parsed.tool_calls] == [("get_weather", 0), ("raw", 1)]
    assert json.loads(parsed.tool_calls[0].arguments) == ARGUMENTS
    assert json.loads(parsed.tool_calls[1].arguments) == [1, "two"]
    # a value that does not decode as its type is kept as raw text
    broken = parse_k3_output('x<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>'
                             '<|open|>argument key="n" type="number"<|sep|>twelve<|close|>argument<|sep|>'
                             '<|close|>call<|sep|>')
    assert json.loads(broken.tool_calls[0].arguments) == {"n": "twelve"}


def test_a_call_is_handed_out_when_its_close_marker_arrives():
    end = TOOL_OUTPUT.index(CLOSE_CALL) + len(CLOSE_CALL)
    parser = K3OutputParser()
    assert not parser.feed(TOOL_OUTPUT[:end - 1]).tool_calls
    delta = parser.feed(TOOL_OUTPUT[end - 1:end])
    assert [c.name for c in delta.tool_calls] == ["get_weather"]


def test_truncated_tool_section():
    """Output cut off (max_tokens) inside the second call: the complete call stays, the cut one is dropped."""
    cut = TOOL_OUTPUT.index('<|open|>call tool="raw"') + 30
    for pieces in ([TOOL_OUTPUT[:cut]], list(TOOL_OUTPUT[:cut])):
        parser, deltas = _stream(TOOL_OUTPUT[:cut], pieces)
        assert [c.name for d in deltas for c in d.tool_calls] == ["get_weather"]
        assert parser.result().content == "Checking."
    # cut inside the first call's arguments: no call at all
    parsed = parse_k3_output(TOOL_OUTPUT[:TOOL_OUTPUT.index("Paris")])
    assert parsed.tool_calls == [] and parsed.content == "Checking."


def test_text_that_spells_part_of_a_marker_is_text():
    text = ("a <|close|>thin b<|close|>think<|sep|><|open|>response<|sep|>use <|close|>response without sep "
            "and <|open|>tool<|close|>response<|sep|><|close|>message<|sep|>")
    whole = parse_k3_output(text)
    assert whole.reasoning_content == "a <|close|>thin b"
    assert whole.content == "use <|close|>response without sep and <|open|>tool"
    for pieces in (list(text), _random_pieces(text, 1)):
        _, deltas = _stream(text, pieces)
        assert _joined(deltas, "content") == whole.content


def test_a_partial_marker_is_held_back_then_released():
    parser = K3OutputParser()
    assert parser.feed("abc<|clo").reasoning_content == "abc"
    assert parser.feed("ck").reasoning_content == "<|clock"      # not a marker after all
    assert parser.feed("<|close|>think<|s").reasoning_content == ""
    delta = parser.feed("ep|><|open|>response<|sep|>Hi")
    assert delta.reasoning_content == "" and delta.content == "Hi"
    assert parser.finish().content == ""
    # at the end a held-back prefix is text
    parser = K3OutputParser()
    parser.feed("x<|close|>think<|sep|><|open|>response<|sep|>y<|clo")
    assert parser.finish().content == "<|clo"


def test_no_close_marker_yet_is_all_reasoning_and_a_repeated_open_is_dropped():
    assert parse_k3_output("still thinking").reasoning_content == "still thinking"
    assert parse_k3_output("still thinking").content == ""
    repeated = parse_k3_output("<|open|>think<|sep|>hmm<|close|>think<|sep|><|open|>response<|sep|>ok")
    assert repeated.reasoning_content == "hmm" and repeated.content == "ok"
    _, deltas = _stream("<|open|>think<|sep|>hmm<|close|>think<|sep|>", list("<|open|>think<|sep|>hmm<|close|>"
                                                                           "think<|sep|>"))
    assert _joined(deltas, "reasoning_content") == "hmm"


def test_thinking_off_starts_in_the_response():
    text = "Plain answer.<|close|>response<|sep|><|open|>tools<|sep|>" + _call("f", {"x": 1}, 1) + \
        "<|close|>tools<|sep|><|close|>message<|sep|>"
    parsed = parse_k3_output(text, thinking=False)
    assert parsed.reasoning_content is None and parsed.content == "Plain answer."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("f", {"x": 1})]
    _, deltas = _stream(text, list(text), thinking=False)
    assert _joined(deltas, "content") == "Plain answer." and _joined(deltas, "reasoning_content") == ""
