"""The engine's grammar matchers: one per constrained request, a token bitmask per step, tokens accepted back.

Rules: `add` when the request arrives (compiles its spec, or raises StructuredError), `bitmask` for the rows of
a step before it samples (the matchers must have accepted every token sampled before; the engine resolves the
step in flight first), `accept` with every sampled token in order, `remove` when the request ends.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from k3core.structured.compiler import grammar_cache
from k3core.structured.spec import StructuredSpec


class GrammarMask(NamedTuple):
    """The allowed tokens of some rows of a step: bit j of bitmask[i, w] allows token 32 w + j in row rows[i]."""
    rows: list[int]
    bitmask: torch.Tensor          # [G, ceil(V / 32)] int32 on the host


class Constraints:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids):
        self._cache = grammar_cache(tokenizer, vocab_size, stop_token_ids)
        self.vocab_size = vocab_size
        self._matchers: dict[str, Any] = {}
        self.num_masks = 0                         # bitmasks built (steps with constrained rows)

    def add(self, request_id: str, spec: StructuredSpec) -> None:
        import xgrammar
        self._matchers[request_id] = xgrammar.GrammarMatcher(self._cache.compile(spec))

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def bitmask(self, request_ids: list[str]) -> GrammarMask | None:
        """The mask of the constrained ones among a step's rows (in row order), or None when none is."""
        rows = [row for row, request_id in enumerate(request_ids) if request_id in self._matchers]
        if not rows:
            return None
        words = -(-self.vocab_size // 32)
        bitmask = torch.empty(len(rows), words, dtype=torch.int32)     # [G, W]
        for index, row in enumerate(rows):
            self._matchers[request_ids[row]].fill_next_token_bitmask(bitmask, index)
        self.num_masks += 1
        return GrammarMask(rows, bitmask)

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advance the request's matcher by its sampled token; True when the grammar has ended (the token was a
        stop token after a complete match). A token the mask allowed is always accepted."""
        matcher = self._matchers[request_id]
        if not matcher.accept_token(token_id):
            raise RuntimeError(f"request {request_id}: token {token_id} was sampled although its grammar refuses "
                               "it (the token bitmask was not applied); this is a bug")
        return matcher.is_terminated()


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[G, W] int32 bit words -> [G, V] bool, allowed = True (on the bitmask's device)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)                     # [32]
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1                                             # [G, W, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()                            # [G, V]
