"""What the engine's steps held: how many were prefill-only, mixed (prefill chunks beside decodes) or decode-only,
and how many decode rows and prefill tokens they carried in all.

Why: the same requests can be served by very different step mixes (a closed-loop HTTP client admits one prompt at
a time, an offline batch admits as many as the token budget holds; an empty slot waiting for a client's next
request lowers the rows of every decode step). Throughput follows the mix, so the server exports these counters
(`k3core_engine_steps_by_kind`, `k3core_engine_decode_rows`, `k3core_engine_prefill_tokens`) and the serving
benchmarks compare them between offline and HTTP runs of one workload.
"""
from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class StepCounts:
    prefill: int = 0            # steps whose chunks are all prefill
    mixed: int = 0              # steps with prefill chunks and decodes
    decode: int = 0             # steps whose chunks are all decodes (one new token after the prompt)
    decode_rows: int = 0        # decode chunks, summed over steps
    prefill_tokens: int = 0     # prefill tokens, summed over steps
    graph_steps: int = 0        # steps whose decodes were replayed from a captured graph (whole or split)
    split_steps: int = 0        # of those, mixed steps split into a graph replay and an eager forward

    def count(self, chunks) -> None:
        """Add one step of scheduled chunks (`k3core.sched` chunks: `.request`, `.num_tokens`), before the step
        advances their requests."""
        decodes = sum(1 for c in chunks
                      if c.num_tokens == 1 and c.request.num_computed_tokens >= len(c.request.prompt_token_ids))
        self.decode_rows += decodes
        self.prefill_tokens += sum(c.num_tokens for c in chunks) - decodes
        if decodes == len(chunks):
            self.decode += 1
        elif decodes == 0:
            self.prefill += 1
        else:
            self.mixed += 1

    @property
    def num_steps(self) -> int:
        return self.prefill + self.mixed + self.decode

    def since(self, before: "StepCounts") -> "StepCounts":
        """The counts of the steps run after `before` was copied."""
        return StepCounts(**{f.name: getattr(self, f.name) - getattr(before, f.name) for f in fields(self)})

    def copy(self) -> "StepCounts":
        return StepCounts(**{f.name: getattr(self, f.name) for f in fields(self)})

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {f.name: getattr(self, f.name) for f in fields(self)}
        with_decode = self.mixed + self.decode
        out["mean_decode_rows"] = self.decode_rows / with_decode if with_decode else 0.0
        return out
