"""Specs compiled by xgrammar against a tokenizer's vocabulary, with a bounded LRU cache per tokenizer.

xgrammar needs every token id's bytes (`encoded_vocab`): k3core's Kimi tokenizer gives its ranks' bytes, the XTML
structure markers their spelling (the text `decode` shows for them, so that the grammar and the output parsers see
the same text) and every other special id b"" (xgrammar never allows those, except the stop ids); the byte-level
tokenizer of presets its bytes and ` w<id>` words; a `tokenizer.json` checkpoint goes through transformers'
`PreTrainedTokenizerFast` to xgrammar's own reader. Ids past the tokenizer up to the model's vocab_size are b"".

JSON allows runs of at most MAX_JSON_WHITESPACE blanks between tokens (`{"a": 1}` and `{"a":1}`, not an indented
layout): a model that loops on blanks would otherwise spend its whole budget inside a valid prefix.
"""
from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from typing import Any

from k3core.structured.spec import StructuredError, StructuredSpec

MAX_JSON_WHITESPACE = 1
MAX_COMPILED = 128            # compiled grammars kept per tokenizer (least recently used dropped first)
COMPILE_THREADS = 1


def encoded_vocab(tokenizer: Any, vocab_size: int) -> list[bytes] | None:
    """Each id's bytes for the k3core tokenizers that have them, or None for one that xgrammar must read itself
    (a checkpoint's Hugging Face tokenizer)."""
    from k3core.tokenizer import ByteTokenizer, TiktokenTokenizer, TokenIdsOnlyTokenizer, NUM_BYTES
    if isinstance(tokenizer, TiktokenTokenizer):
        encoding, names, hidden = tokenizer._encoding, tokenizer._names, tokenizer._hidden
        vocab = [encoding.decode_single_token_bytes(i) if i < tokenizer.num_ranks
                 else names[i].encode() if i in names and i not in hidden else b""
                 for i in range(min(vocab_size, tokenizer.vocab_size))]
    elif isinstance(tokenizer, ByteTokenizer):
        special = {tokenizer.bos_token_id, tokenizer.pad_token_id, *tokenizer.eos_token_ids}
        vocab = [bytes([i]) if i < NUM_BYTES else b"" if i in special else f" w{i}".encode()
                 for i in range(vocab_size)]
    elif isinstance(tokenizer, TokenIdsOnlyTokenizer):
        raise StructuredError("this model has no tokenizer text (token ids only), so no grammar can describe its "
                              "output; leave out response_format / structured_outputs / tool_choice", "model")
    else:
        return None
    return vocab + [b""] * (vocab_size - len(vocab))


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]):
    import xgrammar
    stops = [t for t in stop_token_ids if 0 <= t < vocab_size]
    vocab = encoded_vocab(tokenizer, vocab_size)
    if vocab is not None:
        return xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stops)
    hf = getattr(tokenizer, "_auto", None)
    if hf is None:
        from transformers import PreTrainedTokenizerFast
        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer._fast)
    return xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stops or None)


class GrammarCache:
    """One tokenizer's xgrammar compiler and its most recently used compiled grammars."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...],
                 capacity: int = MAX_COMPILED):
        import xgrammar
        self.info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self._compiler = xgrammar.GrammarCompiler(self.info, max_threads=COMPILE_THREADS, cache_enabled=False)
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()
        self.num_compiles = 0

    def compile(self, spec: StructuredSpec):
        """The compiled grammar of `spec`; StructuredError (naming spec.field) when it does not compile."""
        key = (spec.kind, spec.value)
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        compiled = self._compile(spec)
        with self._lock:
            self.num_compiles += 1
            self._compiled[key] = compiled
            while len(self._compiled) > self._capacity:
                self._compiled.popitem(last=False)
        return compiled

    def __len__(self) -> int:
        return len(self._compiled)

    def _compile(self, spec: StructuredSpec):
        compiler, value = self._compiler, spec.value
        try:
            if spec.kind == "json_schema":
                _json_value(spec, (dict, bool), "a JSON schema (an object)")
                return compiler.compile_json_schema(value, strict_mode=True, max_whitespace_cnt=MAX_JSON_WHITESPACE)
            if spec.kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', max_whitespace_cnt=MAX_JSON_WHITESPACE)
            if spec.kind == "regex":
                return compiler.compile_regex(value)
            if spec.kind == "choice":
                choices = _json_value(spec, list, "a non-empty list of strings")
                if not choices or not all(isinstance(c, str) for c in choices):
                    raise StructuredError(f"{spec.field}: choice must be a non-empty list of strings", spec.field)
                return compiler.compile_structural_tag(json.dumps({"type": "structural_tag", "format": {
                    "type": "or", "elements": [{"type": "const_string", "value": c} for c in choices]}}))
            if spec.kind == "grammar":
                return compiler.compile_grammar(value)
            return compiler.compile_structural_tag(value)
        except StructuredError:
            raise
        except Exception as exc:      # xgrammar raises RuntimeError / ValueError / pydantic errors for bad input
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise StructuredError(f"{spec.field}: the {spec.kind} does not compile ({message[:300]}); fix it",
                                  spec.field) from None


def _json_value(spec: StructuredSpec, types, want: str):
    try:
        value = json.loads(spec.value)
    except json.JSONDecodeError as exc:
        raise StructuredError(f"{spec.field}: the {spec.kind} must be {want}, and is not JSON ({exc})",
                              spec.field) from None
    if not isinstance(value, types):
        raise StructuredError(f"{spec.field}: the {spec.kind} must be {want}, got {type(value).__name__}",
                              spec.field)
    return value


_caches: "weakref.WeakKeyDictionary[Any, dict[tuple, GrammarCache]]" = weakref.WeakKeyDictionary()
_caches_lock = threading.Lock()


def grammar_cache(tokenizer: Any, vocab_size: int, stop_token_ids) -> GrammarCache:
    """The process's cache for this tokenizer (shared by the HTTP side and an engine thread in one process)."""
    key = (vocab_size, tuple(sorted(set(stop_token_ids))))
    with _caches_lock:
        per_tokenizer = _caches.setdefault(tokenizer, {})
        cache = per_tokenizer.get(key)
        if cache is None:
            cache = per_tokenizer[key] = GrammarCache(tokenizer, vocab_size, key[1])
        return cache


def compile_spec(tokenizer: Any, vocab_size: int, stop_token_ids, spec: StructuredSpec):
    return grammar_cache(tokenizer, vocab_size, stop_token_ids).compile(spec)
