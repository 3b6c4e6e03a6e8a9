"""SamplingParams: how one request's tokens are chosen and when it stops."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0                        # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None               # a per-request generator; None = the engine's global RNG
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None           # return the top-N logprobs of each generated token
    include_stop_str_in_output: bool = False   # end the text after the stop string instead of before it

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        def need(cond: bool, message: str) -> None:
            if not cond:
                raise ValueError(message)

        need(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
             f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        need(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        need(isinstance(self.top_k, int) and self.top_k >= 0,
             f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        need(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        need(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        need(self.logprobs is None or 0 <= self.logprobs <= 20, f"logprobs must be in 0..20, got {self.logprobs}")
        need(all(isinstance(s, str) and s for s in self.stop), "stop must be a list of non-empty strings")
        need(all(isinstance(t, int) for t in self.stop_token_ids), "stop_token_ids must be a list of integers")
