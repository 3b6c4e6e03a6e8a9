"""k3core.stop against the O(n^2) method it replaces: decode the whole output after every token and cut at the
earliest stop string. Random token streams (valid text, random ids, bytes that are not UTF-8, special ids) on the
byte tokenizer, a byte-level BPE tokenizer.json and a SentencePiece-style (Metaspace) tokenizer.json; then the
engine's text deltas, a stop string in the very first token, and abort."""
from __future__ import annotations

import functools
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3core import LLM, SamplingParams
from k3core.config import ModelConfig
from k3core.stop import (
    KEEP_TOKENS,
    REPLACEMENT,
    IncrementalDetokenizer,
    OutputText,
    StopMatcher,
)
from k3core.tokenizer import ByteTokenizer, CheckpointTokenizer

ALPHABET = "ab c\n.é中文😀\ufffd"          # 1-, 2-, 3- and 4-byte characters, and a real U+FFFD in the text
STOP_ALPHABET = "ab c\n.é中😀"
CORPUS = ["the cat sat on the mat.", "héllo wörld, ça va?", "中文字符和标点。", "emoji 😀🎉👍 party", "a b c abc abcd"]
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---- tokenizers ------------------------------------------------------------------------------------------------
@functools.cache
def _tokenizer(kind: str):
    config = ModelConfig.preset("k3-tiny")
    if kind == "byte":
        return ByteTokenizer(config)
    import tempfile
    from pathlib import Path

    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    specials = ["<unk>", "<|bos|>", "<|eos|>"]
    if kind == "bpe":                     # byte-level BPE: tokens are byte strings, often part of a character
        fast = FastTokenizer(models.BPE(unk_token="<unk>"))
        fast.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        fast.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:                                 # SentencePiece style: '▁' marks a space; decoding drops the first one
        fast = FastTokenizer(models.BPE(unk_token="<unk>"))
        fast.pre_tokenizer = pre_tokenizers.Metaspace()
        fast.decoder = decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=150, special_tokens=specials)
    fast.train_from_iterator(CORPUS * 10, trainer=trainer)
    with tempfile.TemporaryDirectory(prefix=f"k3core_stop_{kind}_") as name:   # tokenizer.json is read eagerly
        path = Path(name)
        fast.save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|bos|>", "eos_token": "<|eos|>"}))
        tokenizer = CheckpointTokenizer(path, config)
    tokenizer.vocab_size = fast.get_vocab_size()
    return tokenizer


KINDS = ["byte", "bpe", "metaspace"]


def _stream(kind: str):
    """Token ids: encoded text, random ids (invalid UTF-8, special ids), or a mix of pieces of both."""
    tokenizer = _tokenizer(kind)
    ids = st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=40)
    text = st.text(alphabet=ALPHABET, max_size=30).map(tokenizer.encode)
    return st.lists(st.one_of(ids, text), min_size=1, max_size=3).map(lambda parts: [t for part in parts for t in part])


@st.composite
def _stops(draw, full_text: str):
    """0-3 stop strings: pieces of the text (so that they hit), often overlapping, or random ones."""
    clean = full_text.replace(REPLACEMENT, "")
    pieces = []
    for _ in range(draw(st.integers(0, 3))):
        if clean and draw(st.booleans()):
            start = draw(st.integers(0, len(clean) - 1))
            end = draw(st.integers(start + 1, min(len(clean), start + 6)))
            pieces.append(clean[start:end])
        else:
            pieces.append(draw(st.text(alphabet=STOP_ALPHABET, min_size=1, max_size=4)))
    return pieces


# ---- the references -------------------------------------------------------------------------------------------
def _first_stop(text: str, stop: list[str]) -> tuple[int, int] | None:
    """(start, length) of the earliest stop string; the shortest among those starting there."""
    hits = [(text.find(s), len(s)) for s in stop if s in text]
    return min(hits) if hits else None


def _naive(tokenizer, ids: list[int], stop: list[str], include: bool) -> tuple[int, str]:
    """(tokens consumed, final text): decode the whole output after every token."""
    for num in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:num])
        hit = _first_stop(text, stop)
        if hit is not None:
            return num, text[:hit[0] + hit[1] if include else hit[0]]
    return len(ids), tokenizer.decode(ids)


def _held(text: str, stop: list[str]) -> int:
    """Length of the longest suffix of `text` that is the start of a stop string (what must be held back)."""
    return max((k for k in range(1, len(text) + 1) for s in stop if k < len(s) and s.startswith(text[-k:])),
               default=0)


def _incremental(tokenizer, ids, stop, include, max_pending_tokens=16, on_push=None):
    output = OutputText(tokenizer, stop, include, max_pending_tokens)
    deltas, num = [], len(ids)
    for n, token_id in enumerate(ids, 1):
        deltas.append(output.push([token_id]))
        if on_push is not None:
            on_push(n, "".join(deltas), output)
        if output.stopped:
            num = n
            break
    deltas.append(output.finish())
    return num, deltas, output


# ---- random streams against the naive method ------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_random_streams_match_full_decode(kind):
    tokenizer = _tokenizer(kind)

    @SETTINGS
    @given(data=st.data(), ids=_stream(kind), include=st.booleans(), max_pending=st.sampled_from([5, 16]))
    def check(data, ids, include, max_pending):
        stop = data.draw(_stops(tokenizer.decode(ids)))
        expected_num, expected_text = _naive(tokenizer, ids, stop, include)

        def on_push(n, emitted, output):
            # Never ahead of the final text (so never a character of a stop string that completes later), and
            # never behind the finished text decoded so far less the least hold-back a stop string needs.
            assert expected_text.startswith(emitted), (emitted, expected_text)
            if not output.stopped:
                finished = tokenizer.decode(ids[:n]).rstrip(REPLACEMENT)
                assert emitted.startswith(finished[:len(finished) - _held(finished, stop)])

        num, deltas, output = _incremental(tokenizer, ids, stop, include, max_pending, on_push)
        assert num == expected_num
        assert "".join(deltas) == expected_text == output.text
        assert output.stopped == (_first_stop(tokenizer.decode(ids[:num]), stop) is not None)

    check()


@SETTINGS
@given(chunks=st.lists(st.text(alphabet="aab c", max_size=5), max_size=12),
       stop=st.lists(st.text(alphabet="aab", min_size=1, max_size=4), min_size=1, max_size=3),
       include=st.booleans())
def test_stop_matcher_holds_back_exactly_the_possible_start(chunks, stop, include):
    matcher, seen, released = StopMatcher(stop, include), "", ""
    for chunk in chunks:
        seen += chunk
        released += matcher.push(chunk)
        hit = _first_stop(seen, stop)
        if hit is not None:
            assert matcher.stopped and matcher.stop_str == seen[hit[0]:hit[0] + hit[1]]
            assert released == seen[:hit[0] + hit[1] if include else hit[0]]
            assert matcher.push("more") == "" and matcher.finish() == ""
            return
        assert released == seen[:len(seen) - _held(seen, stop)]
    assert released + matcher.finish() == seen


def test_overlapping_stop_strings():
    def run(pieces, stop, include=False):
        matcher = StopMatcher(stop, include)
        return "".join(matcher.push(p) for p in pieces), matcher.stop_str

    # 'bc' completes before 'abcd' could: the text ends before it
    assert run("abcd", ["abcd", "bc"]) == ("a", "bc")
    # arriving together, the earliest start wins
    assert run(["abcd"], ["bc", "abcd"]) == ("", "abcd")
    # a stop string that overlaps itself: 'aab' inside 'aaab' starts at 1
    assert run("aaab", ["aab"]) == ("a", "aab")
    # same start: the shorter completed first
    assert run(["xabc"], ["abc", "ab"], include=True) == ("xab", "ab")
    # a near miss is released once it can no longer start the stop string
    matcher = StopMatcher(["abc"])
    assert [matcher.push(c) for c in "ababx"] == ["", "", "ab", "", "abx"]


def test_stop_in_the_first_token():
    for kind in KINDS:
        tokenizer = _tokenizer(kind)
        ids = tokenizer.encode("the cat sat")
        first = tokenizer.decode(ids[:1])
        assert first, f"{kind}: the first token has no text"
        output = OutputText(tokenizer, [first[:1]])
        assert output.push(ids[:1]) == "" and output.stopped and output.text == ""
        assert output.push(ids[1:]) == "" and output.finish() == ""
        included = OutputText(tokenizer, [first[:1]], include_stop=True)
        assert included.push(ids[:1]) == first[:1] and included.stopped


def test_multibyte_characters_split_across_tokens():
    tokenizer = _tokenizer("byte")
    ids = tokenizer.encode("a中😀b")                          # 1 + 3 + 4 + 1 byte tokens
    output = OutputText(tokenizer, ["😀"])
    deltas = [output.push([t]) for t in ids]
    assert deltas == ["a", "", "", "中", "", "", "", "", ""]    # the stop string ends the text; 'b' never shows
    assert output.stopped and output.text == "a中"
    unfinished = OutputText(tokenizer)
    assert [unfinished.push([t]) for t in ids[:3]] == ["a", "", ""]
    assert unfinished.finish() == "\ufffd" and unfinished.text == tokenizer.decode(ids[:3])


@pytest.mark.parametrize("ids", [[0xE4] * 300, [0x80] * 300, [0xF0, 0x9F] * 150, [256] * 300,
                                 [0x61, 0xE4] * 150, [0xE4, 0xB8] * 100 + list("中".encode()) * 20])
@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_window_stays_bounded_on_bytes_that_are_not_utf8(kind, ids):
    tokenizer = _tokenizer(kind)
    if kind == "bpe":              # the same bytes through byte-level BPE: ids of the single-byte tokens
        ids = [tokenizer._fast.token_to_id(BYTE_LEVEL_CHARS[b]) if b < 256 else 2 for b in ids]
    decoded_lengths = []

    class Counting:
        def decode(self, token_ids):
            decoded_lengths.append(len(token_ids))
            return tokenizer.decode(token_ids)

    max_pending = 8
    detokenizer = IncrementalDetokenizer(Counting(), max_pending)
    text = "".join(detokenizer.push([t]) for t in ids) + detokenizer.finish()
    assert text == tokenizer.decode(ids)
    assert max(decoded_lengths) <= 2 * max_pending + KEEP_TOKENS
    assert len(decoded_lengths) <= 3 * len(ids) + 1


def _byte_level_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the others for chr(256 + n) in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


BYTE_LEVEL_CHARS = _byte_level_chars()


# ---- the engine -------------------------------------------------------------------------------------------------
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny():
    return LLM("k3-tiny", backend="torch", device="cpu", dtype="float32", seed=3, page_size=4,
               checkpoint_interval=8, chunked_prefill_tokens=16)


def _drive(engine, prompts, params):
    """Step the engine; return {request id: (new_text deltas, token ids, finish reason, final text)}."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    deltas = {i: [] for i in ids}
    finished = {}
    while len(finished) < len(ids):
        for output in engine.step():
            deltas[output.request_id].append(output.new_text)
            if output.finished:
                request = engine.requests.pop(output.request_id)
                finished[output.request_id] = (list(request.output_token_ids), output.finish_reason, request.text)
    assert not engine.output_texts, "the engine kept the text of a finished request"
    return [(deltas[i], *finished[i]) for i in ids]


def test_engine_text_deltas_match_full_decode(tiny):
    tokenizer, engine = tiny.tokenizer, tiny.engine
    prompts = [[(7 * i + 3 * j) % 256 for j in range(5 + i)] for i in range(6)]
    outputs = tiny.generate(prompts, SamplingParams(max_tokens=24, **GREEDY))
    full, full_ids = [o.text for o in outputs], [o.token_ids for o in outputs]
    pieces = [[], [(3, 5)], [(10, 11), (2, 6)], [], [(0, 1)], [(5, 9), (6, 8)]]    # overlapping, first token, ...
    stops = [[t[a:b] for a, b in group if t[a:b] and REPLACEMENT not in t[a:b]] for group, t in zip(pieces, full)]
    stops[3] = ["never there"]
    params = [SamplingParams(max_tokens=24, stop=s, include_stop_str_in_output=(i % 2 == 1), **GREEDY)
              for i, s in enumerate(stops)]
    results = _drive(engine, prompts, params)
    for ids, stop, sp, (deltas, out_ids, reason, text) in zip(full_ids, stops, params, results):
        num, expected = _naive(tokenizer, ids, stop, sp.include_stop_str_in_output)
        assert out_ids == ids[:num]
        assert "".join(deltas) == text == expected
        assert reason == ("stop" if _first_stop(tokenizer.decode(ids[:num]), stop) else "length")


def test_engine_stop_in_the_first_token(tiny):
    # The byte tokenizer: the first generated id is one byte; find a prompt whose first byte is a printable character.
    for seed in range(64):
        prompt = [(seed * 37 + 11 * j) % 256 for j in range(4)]
        first = tiny.generate([prompt], SamplingParams(max_tokens=3, **GREEDY))[0]
        if first.text[:1].isprintable() and first.text[:1].isascii() and first.text[:1]:
            break
    else:
        pytest.skip("no greedy continuation starts with a printable ASCII character")
    stop = first.text[0]
    out = tiny.generate([prompt], SamplingParams(max_tokens=3, stop=[stop], **GREEDY))[0]
    assert (out.token_ids, out.text, out.finish_reason) == (first.token_ids[:1], "", "stop")
    out = tiny.generate([prompt], SamplingParams(max_tokens=3, stop=[stop], include_stop_str_in_output=True,
                                                 **GREEDY))[0]
    assert (out.token_ids, out.text, out.finish_reason) == (first.token_ids[:1], stop, "stop")


def test_engine_abort_keeps_the_held_back_text(tiny):
    engine, tokenizer = tiny.engine, tiny.tokenizer
    prompt = [5, 6, 7, 8]
    full = tiny.generate([prompt], SamplingParams(max_tokens=8, **GREEDY))[0]
    # a stop string that never completes but whose start is held back at the end
    stop = [full.text[-1:] + "\x00never"] if full.text and full.text[-1] != REPLACEMENT else ["\x00never"]
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=20, stop=stop, **GREEDY))
    deltas = []
    request = engine.requests[request_id]
    while len(request.output_token_ids) - request.num_unresolved < 8:      # tokens read back (overlap)
        deltas.extend(o.new_text for o in engine.step())
    assert engine.abort(request_id)
    assert engine.requests.pop(request_id) is request
    assert request.text == tokenizer.decode(request.output_token_ids) == full.text
    assert full.text.startswith("".join(deltas)) and request_id not in engine.output_texts


def test_stop_matcher_ignores_stops_that_end_before_min_tokens():
    matcher = StopMatcher(["ab", "xyz"])
    assert matcher.push("ab", may_stop=False) == "ab"           # complete, but too early: handed out
    assert matcher.push("x", may_stop=False) == ""              # the start of "xyz" is held back as usual
    assert matcher.push("yz", may_stop=True) == "" and matcher.stop_str == "xyz"   # completed in time: it stops
    late = StopMatcher(["ab"])
    assert late.push("cab", may_stop=False) == "cab" and late.push("ab") == "" and late.stopped


def test_engine_min_tokens_holds_stop_strings_back(tiny):
    """A stop string completed within the first min_tokens tokens does not end the output (vLLM's rule); the first
    one completed after does."""
    tokenizer = tiny.tokenizer
    for seed in range(64):
        prompt = [(seed * 37 + 11 * j) % 256 for j in range(4)]
        full = tiny.generate([prompt], SamplingParams(max_tokens=12, **GREEDY))[0]
        first = tokenizer.decode(full.token_ids[:1])
        if first and REPLACEMENT not in first and first in tokenizer.decode(full.token_ids[6:]):
            break
    else:
        pytest.skip("no greedy continuation repeats its first character later")
    stop = [first]
    early = tiny.generate([prompt], SamplingParams(max_tokens=12, stop=stop, **GREEDY))[0]
    assert early.token_ids == full.token_ids[:1] and early.finish_reason == "stop"
    held = tiny.generate([prompt], SamplingParams(max_tokens=12, stop=stop, min_tokens=6, **GREEDY))[0]
    num, expected = next((n, tokenizer.decode(full.token_ids[:n])) for n in range(6, 13)
                         if first in tokenizer.decode(full.token_ids[:n])[len(tokenizer.decode(full.token_ids[:5])):])
    assert held.finish_reason == "stop" and held.token_ids == full.token_ids[:num]
    assert held.text == expected[:expected.rindex(first)]
