"""`text_offset` of completion logprobs: characters of output text before each token, computed incrementally (the
server used to decode the whole output again for every token of every chunk: O(n^2) per request)."""
from __future__ import annotations

from k3core.config import load_config
from k3core.serve.generation import Choice
from k3core.serve.responses import completion_logprobs
from k3core.tokenizer import ByteTokenizer


class CountingDecoder:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.decoded_tokens = 0

    def decode(self, ids):
        self.decoded_tokens += len(ids)
        return self.tokenizer.decode(ids)


def _choice(token_ids):
    return Choice(index=0, engine_id="e", prompt_index=0, num_prompt_tokens=3, token_ids=list(token_ids))


def test_offsets_count_characters_before_each_token_across_streamed_chunks():
    tokenizer = ByteTokenizer(load_config("k3-tiny"))
    text = "héllo → wörld ✓ end"
    ids = tokenizer.encode(text)
    choice = _choice([])
    offsets = []
    for step, token_id in enumerate(ids):            # one token per chunk, as a stream delivers them
        choice.token_ids.append(token_id)
        entries = [{token_id: -0.5}]
        offsets += completion_logprobs(tokenizer, choice, step, entries, 0)["text_offset"]
    # a token that completes a character starts where the characters before it end; the continuation bytes of a
    # split character report the offset of that (not yet finished) character
    expected = [len(tokenizer.decode(ids[:p]).rstrip("\ufffd")) for p in range(len(ids))]
    assert offsets == expected
    whole = completion_logprobs(tokenizer, choice, 0, [{t: -0.5} for t in ids], 0)["text_offset"]
    assert whole == expected                         # a non-streamed response reads the same cached offsets


def test_offsets_decode_each_token_a_bounded_number_of_times():
    tokenizer = CountingDecoder(ByteTokenizer(load_config("k3-tiny")))
    ids = tokenizer.tokenizer.encode("abcdefghij" * 60)
    choice = _choice([])
    for step, token_id in enumerate(ids):
        choice.token_ids.append(token_id)
        completion_logprobs(tokenizer, choice, step, [{token_id: -1.0}], 0)
    # the old per-token full decode read ~n^2 / 2 = 180,000 token ids here
    assert tokenizer.decoded_tokens <= 8 * len(ids)
