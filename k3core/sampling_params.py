"""SamplingParams: how one request's tokens are chosen and when it stops.

`validate()` refuses every value the batched sampler cannot take, so that one request's parameters can never fail
a shared sampling step: numbers must be finite, and floats are checked after rounding to float32 (the precision
the sampler computes in). A temperature below GREEDY_TEMPERATURE (subnormal ones included) means greedy. top_k
has no vocabulary bound here; the sampler treats any top_k >= the vocabulary size as off. Token ids (logit_bias)
are checked against the vocabulary when the sampler takes the request.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

from k3core.ops import GREEDY_TEMPERATURE
from k3core.structured.spec import StructuredSpec

MAX_LOGPROBS = 20                 # top-N logprobs per token, as vLLM
MAX_TOKEN_ID = 2 ** 31 - 1        # token ids and top_k fit an int32
MAX_LOGIT_BIAS = 100.0            # |bias| bound, as OpenAI
MAX_PENALTY = 2.0                 # |presence_penalty|, |frequency_penalty| bound, as OpenAI
INT64_MIN, INT64_MAX = -2 ** 63, 2 ** 63 - 1

__all__ = ["SamplingParams", "GREEDY_TEMPERATURE", "MAX_LOGPROBS"]


def _float32(value: float) -> float:
    """`value` rounded to float32 (inf when it overflows)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and \
        math.isfinite(_float32(value))


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0              # < GREEDY_TEMPERATURE: greedy
    top_k: int = 0                        # 0 (or -1) = off; >= vocabulary size = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None               # reproducible draws whatever the batch; None = a random seed
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None           # return the top-N logprobs of each generated token (N <= 20)
    include_stop_str_in_output: bool = False   # end the text after the stop string instead of before it
    presence_penalty: float = 0.0         # subtracted once from the logit of every token already in the output
    frequency_penalty: float = 0.0        # subtracted per occurrence in the output
    repetition_penalty: float = 1.0       # tokens in prompt or output: positive logits divided, others multiplied
    min_tokens: int = 0                   # EOS and stop_token_ids are masked until this many tokens are out
    logit_bias: dict[int, float] = field(default_factory=dict)   # added to the logits before anything else
    structured: StructuredSpec | None = None   # the output must match this grammar (k3core.structured)
    prompt_logprobs: int | None = None    # logprob (and top-N, N <= 20) of every prompt token given its prefix

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0                # vLLM's spelling of "off"
        if isinstance(self.logit_bias, dict):
            # JSON object keys are strings ("50256": -100); token ids are integers everywhere else
            self.logit_bias = {int(k) if isinstance(k, str) and k.strip().isdigit() else k: v
                               for k, v in self.logit_bias.items()}
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def uses_penalties(self) -> bool:
        """Whether the sampler must keep token counts for this request."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def validate(self) -> None:
        def need(cond: bool, message: str) -> None:
            if not cond:
                raise ValueError(message)

        need(_is_int(self.max_tokens) and 0 <= self.max_tokens <= INT64_MAX,
             f"max_tokens must be an integer >= 0 (0: run the prompt only), got {self.max_tokens!r}")
        need(_is_real(self.temperature) and self.temperature >= 0,
             f"temperature must be a finite number >= 0 (below {GREEDY_TEMPERATURE:g} is greedy), "
             f"got {self.temperature!r}")
        need(_is_int(self.top_k) and 0 <= self.top_k <= MAX_TOKEN_ID,
             f"top_k must be an integer in 0..{MAX_TOKEN_ID} (0 or -1 = off), got {self.top_k!r}")
        need(_is_real(self.top_p) and 0 < _float32(self.top_p) and self.top_p <= 1,
             f"top_p must be in (0, 1] (and not round to 0 in float32), got {self.top_p!r}")
        need(_is_real(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        need(self.seed is None or (_is_int(self.seed) and INT64_MIN <= self.seed <= INT64_MAX),
             f"seed must be an integer in [-2**63, 2**63), got {self.seed!r}")
        need(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
             f"logprobs must be an integer in 0..{MAX_LOGPROBS}, got {self.logprobs!r}")
        need(self.prompt_logprobs is None or (
            _is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
             f"prompt_logprobs must be an integer in 0..{MAX_LOGPROBS}, got {self.prompt_logprobs!r}")
        need(isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
             "stop must be a list of non-empty strings")
        need(isinstance(self.stop_token_ids, list) and
             all(_is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in self.stop_token_ids),
             "stop_token_ids must be a list of token ids (integers >= 0)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            need(_is_real(value) and -MAX_PENALTY <= value <= MAX_PENALTY,
                 f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}")
        need(_is_real(self.repetition_penalty) and _float32(self.repetition_penalty) > 0,
             f"repetition_penalty must be a finite number > 0 (1 = off), got {self.repetition_penalty!r}")
        need(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be an integer in 0..max_tokens ({self.max_tokens}), got {self.min_tokens!r}")
        need(self.structured is None or isinstance(self.structured, StructuredSpec),
             "structured must be a k3core.structured.StructuredSpec")
        need(self.structured is None or self.min_tokens == 0,
             "min_tokens cannot be combined with structured outputs (the grammar decides where the output may "
             "end); leave min_tokens out")
        need(isinstance(self.logit_bias, dict), "logit_bias must map token ids to biases")
        for token_id, bias in self.logit_bias.items():
            need(_is_int(token_id) and 0 <= token_id <= MAX_TOKEN_ID,
                 f"logit_bias keys must be token ids (integers >= 0), got {token_id!r}")
            need(_is_real(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS,
                 f"logit_bias of token {token_id} must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias!r}")
