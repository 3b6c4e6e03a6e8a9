"""Structured outputs: a request's output constrained by a grammar that xgrammar compiles against the vocabulary.

A constrained request carries a `StructuredSpec` in its SamplingParams (plain data: it crosses the engine-process
and rank boundaries as msgspec / pickle). The server compiles the spec before it queues the request
(`k3core.structured.compiler.compile_spec`, a bounded LRU cache per tokenizer), so that an invalid schema, regex or
grammar is a 400 naming its field. The engine keeps one xgrammar matcher per constrained request
(`k3core.structured.matchers.Constraints`): each step the host fills the token bitmask of the constrained rows, the
sampler applies it to those rows' logits on the device, and each sampled token is accepted into its matcher; a
matcher that terminates finishes its request. A batch without constrained requests never builds a mask.

xgrammar is imported only when the first constrained request arrives (this module and `spec` import nothing).
"""
from k3core.structured.spec import SPEC_KINDS, StructuredError, StructuredSpec

__all__ = ["SPEC_KINDS", "StructuredError", "StructuredSpec"]
