"""Prompt logprobs already computed, by prefix, so that a later prompt sharing a prefix reads the prefix cache.

The logprob of prompt token i (and its rank and top-N alternatives) depends on tokens[:i + 1] only, so the positions
of a scored prompt serve every later prompt that starts with the same tokens, at the same top-N. Without them a
prompt-logprobs request could not start from a cached KDA checkpoint: the cache holds states, and a state at
position s cannot give back the logits before s. With them, a request whose first k positions are known here starts
from the deepest cached checkpoint s < k (the logits at s score token s + 1 onwards) and takes positions 0..s from
the store. lm-eval's multiple-choice tasks score the same context once per choice: every choice after the first
prefills only its continuation.

Entries are keyed by a running hash of the prompt's tokens at every `page_size`-th position; a hit is verified
against the stored tokens, so a hash collision can only miss. Bounded by the number of positions held (LRU); the
engine's flush_cache empties it with the prefix cache.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from k3core.prompt_logprobs import PromptLogprobs

DEFAULT_MAX_POSITIONS = 1 << 18        # about 50 MB at top-20 entries


@dataclass(frozen=True)
class _Scored:
    token_ids: tuple[int, ...]
    logprobs: PromptLogprobs
    num_top: int


class PromptLogprobStore:
    """`put` a complete PromptLogprobs, `lookup` the known positions of a new prompt. Invariant: each prefix hash
    lists exactly the records whose tokens have that prefix; `num_positions` is the sum of the records' lengths."""

    def __init__(self, page_size: int, max_positions: int = DEFAULT_MAX_POSITIONS):
        if page_size < 1 or max_positions < 1:
            raise ValueError("page_size and max_positions must be positive")
        self.page_size = page_size
        self.max_positions = max_positions
        self._records: OrderedDict[tuple[int, ...], _Scored] = OrderedDict()     # LRU order
        self._by_prefix: dict[bytes, list[tuple[int, ...]]] = {}                 # prefix hash -> record keys
        self.num_positions = 0

    def _prefix_hashes(self, token_ids: Sequence[int], num_top: int):
        """(prefix length, hash) at every page boundary of token_ids, longest last."""
        running = hashlib.blake2b(num_top.to_bytes(2, "little"), digest_size=16)
        for start in range(0, len(token_ids) - len(token_ids) % self.page_size, self.page_size):
            running.update(b"".join(t.to_bytes(4, "little") for t in token_ids[start:start + self.page_size]))
            yield start + self.page_size, running.copy().digest()

    def put(self, token_ids: Sequence[int], logprobs: PromptLogprobs, num_top: int) -> None:
        key = tuple(token_ids)
        if not logprobs.complete or len(key) < self.page_size or key in self._records:
            return
        self._records[key] = _Scored(key, logprobs, num_top)
        self.num_positions += len(key)
        for _, digest in self._prefix_hashes(key, num_top):
            self._by_prefix.setdefault(digest, []).append(key)
        while self.num_positions > self.max_positions and self._records:
            self._evict(next(iter(self._records)))

    def lookup(self, token_ids: Sequence[int], num_top: int) -> tuple[int, PromptLogprobs | None]:
        """(k, record): positions 0..k-1 of token_ids have the record's entries (k a multiple of page_size), or
        (0, None)."""
        best, best_key = (0, None), None
        for length, digest in self._prefix_hashes(token_ids, num_top):
            keys = self._by_prefix.get(digest)
            if not keys:
                break
            record = self._records[keys[-1]]
            if record.token_ids[:length] != tuple(token_ids[:length]):
                break                                          # a collision: never serve another prompt's numbers
            best, best_key = (length, record.logprobs), keys[-1]
        if best_key is not None:
            self._records.move_to_end(best_key)
        return best

    def flush(self) -> None:
        self._records.clear()
        self._by_prefix.clear()
        self.num_positions = 0

    def _evict(self, key: tuple[int, ...]) -> None:
        record = self._records.pop(key)
        self.num_positions -= len(key)
        for _, digest in self._prefix_hashes(key, record.num_top):
            keys = self._by_prefix[digest]
            keys.remove(key)
            if not keys:
                del self._by_prefix[digest]

    def check_invariants(self) -> None:
        assert self.num_positions == sum(len(k) for k in self._records), "position count drifted"
        expected: dict[bytes, set] = {}
        for key, record in self._records.items():
            for _, digest in self._prefix_hashes(key, record.num_top):
                expected.setdefault(digest, set()).add(key)
        assert {d: set(k) for d, k in self._by_prefix.items()} == expected, "prefix keys out of step with records"
