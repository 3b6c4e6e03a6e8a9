"""A request's output text as it grows: token ids in, text a client may see out, cut at the first stop string.

Decoding the whole output at every step costs O(n^2) over a generation. `IncrementalDetokenizer` decodes only a
window of recent tokens, marked by two offsets into the token ids:

    token_ids:  ...... | prefix_offset ........ read_offset ........ end
                         context: its text        not handed out
                         was handed out before    (completely) yet

Each step decodes `token_ids[prefix_offset:]`. Starting one emitted stretch early, rather than at read_offset, keeps
what a decoder does at the start of a sequence (a SentencePiece decoder drops the first token's leading space) out of
the middle of the text. What the window shows beyond the text already handed out is new, except a trailing run of
U+FFFD: the decoder shows an unfinished UTF-8 character that way, and the next token may finish it. Once the window's
text ends in a real character the offsets move up to the end.

A model that keeps producing bytes that are not UTF-8 never ends its text in a real character. After
`max_pending_tokens` such tokens the window is cut `KEEP_TOKENS` before the end, where the text of the two halves
joined equals the text of the whole; with a decoder that replaces each maximal invalid byte sequence by one U+FFFD
(the byte tokenizer, byte-level BPE) a character cannot straddle such a cut, so the text stays exact and the window
stays bounded.

`StopMatcher` runs on that text. It hands out everything except the longest suffix that is the start of some stop
string (the least it must hold back: a client never sees a character of a stop string that later completes), and
ends the text at the earliest start of a stop string, keeping the stop string only when asked to. `OutputText` joins
the two for one request.

Equivalence (tests/test_stop.py checks it): with a decoder whose text for a token sequence begins with its text for
every prefix that ends in a real character, the text handed out equals that of decoding the whole output after every
token and cutting at the earliest stop string, and the stop is found at the same token. A stop string is matched
against finished text only: a U+FFFD in one matches a replacement character that no later token can change.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT = "\ufffd"
KEEP_TOKENS = 4              # an unfinished character has at most 3 bytes, so at most 3 byte tokens: keep them whole


class IncrementalDetokenizer:
    """`push(token_ids)` returns the new text; `finish()` (once, at the end) returns what was held back.

    Invariant: the concatenation of everything handed out is a prefix of `decode(all token ids)` and, after
    `finish()`, equal to it (for a decoder as the module docstring describes). Each push decodes
    `token_ids[prefix_offset:]`: the last emitted stretch plus the tokens not yet read, which stay a handful unless
    bytes that are not UTF-8 arrive, and then about `max_pending_tokens` (tests/test_stop.py bounds it)."""

    def __init__(self, tokenizer: Any, max_pending_tokens: int = 16):
        if max_pending_tokens <= KEEP_TOKENS:
            raise ValueError(f"max_pending_tokens must be > {KEEP_TOKENS}, got {max_pending_tokens}")
        self.decode = tokenizer.decode
        self.max_pending_tokens = max_pending_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.prefix_len = 0       # len(decode(token_ids[prefix_offset:read_offset]))
        self.emitted_len = 0      # characters of decode(token_ids[prefix_offset:]) handed out (>= prefix_len)

    def push(self, token_ids: Sequence[int]) -> str:
        self.token_ids.extend(token_ids)
        window = self.decode(self.token_ids[self.prefix_offset:])
        finished = window.rstrip(REPLACEMENT)
        delta = window[self.emitted_len:len(finished)]
        self.emitted_len = max(self.emitted_len, len(finished))
        if len(finished) == len(window) and len(window) > self.prefix_len:
            # Ends in a real character: move the window. A push that adds no text (special tokens) does not move
            # it, so that the next window does not start at a token whose text the decoder would change.
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            self.prefix_len = self.emitted_len = len(self.decode(self.token_ids[self.prefix_offset:]))
        elif len(self.token_ids) - self.read_offset > self.max_pending_tokens:
            delta += self._cut(window)
        return delta

    def finish(self) -> str:
        window = self.decode(self.token_ids[self.prefix_offset:])
        delta = window[self.emitted_len:]
        self.emitted_len = max(self.emitted_len, len(window))
        return delta

    def _cut(self, window: str) -> str:
        """Start the window `KEEP_TOKENS` before the end if the text splits there; returns text that became final."""
        cut = len(self.token_ids) - KEEP_TOKENS
        head = self.decode(self.token_ids[self.prefix_offset:cut])
        tail = self.decode(self.token_ids[cut:])
        if head + tail != window:
            return ""            # a character straddles the cut (or the decoder joins there): try again next push
        # head is followed by more bytes, so its replacement characters are final; hand out the unseen ones
        delta = head[self.emitted_len:]
        self.emitted_len = max(self.emitted_len - len(head), 0)
        self.prefix_offset = self.read_offset = cut
        self.prefix_len = 0
        return delta


class StopMatcher:
    """Text in, text out, ending at the earliest stop string.

    `push(text)` returns the part a client may see now: everything except the longest suffix that is the start of
    some stop string. When a stop string appears, the text ends just before it (or after it, with
    `include_stop`); among stop strings starting at the same place the shortest wins, since it completed first.
    Invariant: no stop string starts in the text already handed out, so each push searches only `pending + text`."""

    def __init__(self, stop: Sequence[str], include_stop: bool = False):
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError("stop strings must be non-empty strings")
        self.stop = tuple(stop)
        self.include_stop = include_stop
        self.pending = ""
        self.early = 0                       # characters of `pending` produced before min_tokens was reached
        self.stop_str: str | None = None     # the stop string that ended the text

    @property
    def stopped(self) -> bool:
        return self.stop_str is not None

    def push(self, text: str, may_stop: bool = True) -> str:
        """`may_stop` False (a request short of its min_tokens): no stop string ends in this text; one that starts
        in it and completes later still stops the output, as in vLLM."""
        if self.stopped:
            return ""
        buffer = self.pending + text
        early = len(buffer) if not may_stop else self.early      # a hit must end past the first `early` characters
        hits = [(index, len(s), s) for s in self.stop if (index := buffer.find(s, max(0, early - len(s) + 1))) >= 0]
        if hits:
            index, length, self.stop_str = min(hits)
            self.pending = ""
            return buffer[:index + length if self.include_stop else index]
        held = self._held_len(buffer)
        self.pending = buffer[len(buffer) - held:]
        self.early = held if not may_stop else 0     # held text from before min_tokens: no stop may end in it
        return buffer[:len(buffer) - held]

    def finish(self) -> str:
        """The held-back text (the output ended without completing the stop string it might have started)."""
        rest, self.pending = self.pending, ""
        return rest

    def _held_len(self, buffer: str) -> int:
        for length in range(min(len(buffer), max((len(s) for s in self.stop), default=1) - 1), 0, -1):
            suffix = buffer[len(buffer) - length:]
            if any(s.startswith(suffix) and len(s) > length for s in self.stop):   # could still complete
                return length
        return 0


class OutputText:
    """One request's output text: `push(token_ids)` returns the text a client may see now, `finish()` (once, when
    the request ends) the rest; `text` is everything handed out. Once `stopped`, further tokens add no text."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), include_stop: bool = False,
                 max_pending_tokens: int = 16):
        self.detokenizer = IncrementalDetokenizer(tokenizer, max_pending_tokens)
        self.matcher = StopMatcher(stop, include_stop)
        self._parts: list[str] = []
        self._finished = False

    @property
    def stopped(self) -> bool:
        return self.matcher.stopped

    @property
    def text(self) -> str:
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def push(self, token_ids: Sequence[int], may_stop: bool = True) -> str:
        if self.stopped or self._finished:
            return ""
        return self._hand_out(self.matcher.push(self.detokenizer.push(token_ids), may_stop))

    def finish(self) -> str:
        if self.stopped or self._finished:
            return ""
        self._finished = True
        delta = self.matcher.push(self.detokenizer.finish())
        if not self.stopped:
            delta += self.matcher.finish()
        return self._hand_out(delta)

    def _hand_out(self, delta: str) -> str:
        if delta:
            self._parts.append(delta)
        return delta
