"""Kimi-Linear's K2-style output parser: whole outputs, the same outputs streamed character by character, in random
pieces and token by token through a Kimi tokenizer (where each marker is one special token)."""
from __future__ import annotations

import json
import random

import pytest

from k3core.chat import K2OutputParser, parse_k2_output
from k3core.chat.k2_parsers import ARGUMENT_BEGIN, CALL_BEGIN, CALL_END, SECTION_BEGIN, SECTION_END, function_name
from k3core.config import ModelConfig
from k3core.model.tokenizer_writer import K2_SPECIAL_OFFSETS, prefix_ranks, write_kimi_tokenizer
from k3core.stop import IncrementalDetokenizer
from k3core.tokenizer import load_tokenizer

ARGUMENTS = {"city": "Zürich", "days": 3, "metric": True, "filters": {"rain": [1, 2]}, "note": None}


def _call(call_id: str, arguments: str) -> str:
    return f"{CALL_BEGIN}{call_id}{ARGUMENT_BEGIN}{arguments}{CALL_END}"


TOOL_OUTPUT = ("Let me check both. " + SECTION_BEGIN
               + _call("functions.get_weather:0", json.dumps(ARGUMENTS, ensure_ascii=False))
               + "\n" + _call(" functions.get_time:1 ", ' {"zone": "CET"} ')     # whitespace around id and JSON
               + _call("functions.:2", "{}")                                   # no function name: dropped
               + _call("functions.raw:3", "not json")                          # arguments kept as they came
               + SECTION_END)
PLAIN = "It is 18 °C in Paris. Tokens like <|im_end and < | stay text."


def _stream(pieces):
    parser = K2OutputParser()
    deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    return parser, deltas


def _random_pieces(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), k=len(text) // 3))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def test_tool_calls_content_and_ids():
    parsed = parse_k2_output(TOOL_OUTPUT)
    assert parsed.reasoning_content is None and parsed.content == "Let me check both. "
    assert [(c.name, c.id, c.index) for c in parsed.tool_calls] == [
        ("get_weather", "functions.get_weather:0", 0), ("get_time", "functions.get_time:1", 1),
        ("raw", "functions.raw:3", 2)]
    assert json.loads(parsed.tool_calls[0].arguments) == ARGUMENTS
    assert "Zürich" in parsed.tool_calls[0].arguments                  # non-ASCII kept, not \u-escaped
    assert parsed.tool_calls[1].arguments == '{"zone": "CET"}'
    assert parsed.tool_calls[2].arguments == "not json"


def test_plain_text_is_all_content():
    assert parse_k2_output(PLAIN).content == PLAIN and parse_k2_output(PLAIN).tool_calls == []


def test_cut_off_outputs():
    # cut inside the second call: the first is kept, the half call dropped; cut inside the marker: held text kept
    first = _call("functions.a:0", '{"x": 1}')
    parsed = parse_k2_output("Hi" + SECTION_BEGIN + first + CALL_BEGIN + "functions.b:1" + ARGUMENT_BEGIN + '{"y"')
    assert parsed.content == "Hi" and [c.name for c in parsed.tool_calls] == ["a"]
    assert parse_k2_output("Hi <|tool_calls_sec").content == "Hi <|tool_calls_sec"


def test_text_after_the_section_is_content():
    parsed = parse_k2_output("A" + SECTION_BEGIN + _call("functions.f:0", "{}") + SECTION_END + "B")
    assert parsed.content == "AB" and [c.name for c in parsed.tool_calls] == ["f"]


def test_function_names():
    assert function_name("functions.get_weather:0") == "get_weather"
    assert function_name("get_weather") == "get_weather"
    assert function_name("functions.ns.tool:12") == "ns.tool"
    assert function_name("functions.:0") == ""


@pytest.mark.parametrize("text", [TOOL_OUTPUT, PLAIN, "A" + SECTION_BEGIN + _call("functions.f:0", "{}")])
def test_streaming_in_pieces_equals_the_whole(text):
    whole = parse_k2_output(text)
    for pieces in ([*text], _random_pieces(text, 1), _random_pieces(text, 2), [text]):
        parser, deltas = _stream(pieces)
        assert parser.result() == whole
        assert "".join(d.content for d in deltas) == whole.content
        assert [c for d in deltas for c in d.tool_calls] == whole.tool_calls


def test_streaming_holds_back_only_a_possible_marker_and_emits_each_call_at_its_end():
    parser = K2OutputParser()
    assert parser.feed("Hello <|tool").content == "Hello "               # `<|tool` may begin the section marker
    assert parser.feed("s are fun").content == "<|tools are fun"         # it did not
    assert not parser.feed(SECTION_BEGIN + CALL_BEGIN + "functions.f:0" + ARGUMENT_BEGIN + '{"a"')  # nothing yet
    delta = parser.feed(": 1}" + CALL_END)
    assert [(c.name, c.arguments) for c in delta.tool_calls] == [("f", '{"a": 1}')]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("kimi_linear_tokenizer")
    ranks = prefix_ranks(["functions", "get_weather", "get_time", "Let", "check", "both", "city", "Zürich"])
    specials = write_kimi_tokenizer(directory, ranks, K2_SPECIAL_OFFSETS)    # every K2 special marked special
    base = ModelConfig.preset("k3-tiny")
    config = base.replace(vocab_size=len(ranks) + 256, eos_token_id=specials["<|im_end|>"],
                          extra={**base.extra, "hf_model_type": "kimi_linear"})
    return load_tokenizer(directory, config)


def test_token_by_token_through_the_kimi_tokenizer(tokenizer):
    ids = tokenizer.encode_with_specials(TOOL_OUTPUT)
    for marker in (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END):
        assert tokenizer.special_token_id(marker) in ids                  # each marker is one special token
    assert tokenizer.decode(ids) == TOOL_OUTPUT                           # ... kept as text when decoding
    detokenizer = IncrementalDetokenizer(tokenizer)                       # the text the engine hands out
    pieces = [detokenizer.push([token_id]) for token_id in ids] + [detokenizer.finish()]
    parser, deltas = _stream(pieces)
    assert parser.result() == parse_k2_output(TOOL_OUTPUT)
    assert len(parser.tool_calls) == 3
