"""k3core: an inference engine for the Kimi-K3 family of hybrid models.

`import k3core` imports only the standard library and torch; vendor packages load inside `backends/` and
`kernels/` when a backend is chosen.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["LLM", "SamplingParams", "ModelConfig"]

if TYPE_CHECKING:
    from k3core.config import ModelConfig
    from k3core.llm import LLM
    from k3core.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from k3core.llm import LLM
        return LLM
    if name == "SamplingParams":
        from k3core.sampling_params import SamplingParams
        return SamplingParams
    if name == "ModelConfig":
        from k3core.config import ModelConfig
        return ModelConfig
    raise AttributeError(f"module 'k3core' has no attribute {name!r}")
