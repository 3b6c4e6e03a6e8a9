"""Token sampling: greedy, temperature, top-k, top-p, min-p, one torch.Generator per row."""
from __future__ import annotations

import torch


def _filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                    min_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One row: (probabilities over the kept tokens, their vocabulary ids), most likely first."""
    sorted_logits, sorted_ids = torch.sort(logits.float() / temperature, descending=True, stable=True)  # [V]
    keep = torch.ones_like(sorted_logits, dtype=torch.bool)
    if top_k > 0:
        keep[top_k:] = False
    probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
    if top_p < 1.0:
        # The smallest prefix whose mass reaches top_p: keep a token while the mass before it is below top_p.
        mass_before = torch.cumsum(probs, dim=-1) - probs
        keep &= mass_before < top_p
    if min_p > 0.0:
        keep &= probs >= min_p * probs[0]
    keep[0] = True                                                             # never an empty set
    probs = probs.masked_fill(~keep, 0.0)
    return probs / probs.sum(), sorted_ids


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """logits [B, V] -> token_ids int64 [B]. Rows are independent; each draws from its own generator
    (None = the global RNG). temperature 0 is greedy (argmax, lowest index on ties); top_k 0 and top_p 1 are off.
    Filters apply in the order top_k, top_p (on the top-k renormalised distribution), min_p (relative to the
    most likely token)."""
    num_rows = logits.shape[0]
    if len(generators) != num_rows:
        raise ValueError(f"sample: got {len(generators)} generators for {num_rows} rows; pass one (or None) per row")
    temps, ks, ps, mins = temperature.tolist(), top_k.tolist(), top_p.tolist(), min_p.tolist()
    token_ids = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    for row in range(num_rows):
        if temps[row] < 0 or not 0 < ps[row] <= 1 or not 0 <= mins[row] <= 1 or ks[row] < 0:
            raise ValueError(f"sample: row {row} has temperature={temps[row]}, top_k={ks[row]}, top_p={ps[row]}, "
                             f"min_p={mins[row]}; need temperature >= 0, top_k >= 0, 0 < top_p <= 1, 0 <= min_p <= 1")
        if temps[row] == 0:
            token_ids[row] = torch.argmax(logits[row])                         # first maximum on ties
            continue
        probs, ids = _filtered_probs(logits[row], temps[row], int(ks[row]), ps[row], mins[row])
        choice = torch.multinomial(probs, 1, generator=generators[row])        # [1]
        token_ids[row] = ids[choice[0]]
    return token_ids
