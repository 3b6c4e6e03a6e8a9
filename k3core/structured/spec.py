"""What a request asks its output to match, as plain data (no xgrammar)."""
from __future__ import annotations

from dataclasses import dataclass

# kind -> what `value` holds
SPEC_KINDS = {
    "json_schema": "a JSON schema, as JSON text",
    "json_object": "nothing (any JSON object)",
    "regex": "a regular expression",
    "choice": "a JSON list of the allowed strings",
    "grammar": "an EBNF grammar (xgrammar's GBNF dialect, root rule `root`)",
    "structural_tag": "an xgrammar structural tag, as JSON text (the K3 chat format's wrappings)",
}


class StructuredError(ValueError):
    """A structured-output request that cannot be compiled; `field` names the request field to fix."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class StructuredSpec:
    """One request's constraint. `field` is the request field it came from (for error messages only)."""
    kind: str
    value: str = ""
    field: str = "structured_outputs"

    def __post_init__(self) -> None:
        if self.kind not in SPEC_KINDS:
            raise StructuredError(f"structured output kind {self.kind!r} is unknown; choose one of "
                                  f"{', '.join(SPEC_KINDS)}", self.field)
        if not isinstance(self.value, str):
            raise StructuredError(f"{self.field}: the {self.kind} constraint must be given as text", self.field)
