"""A checkpoint's jinja chat template, rendered in a sandbox.

Templates come from the checkpoint directory, so they are untrusted. They render in a subclass of jinja2's
`ImmutableSandboxedEnvironment`, which refuses any mutation of the data passed in; on top of it:
* reading an attribute the sandbox deems unsafe (`__class__`, `__globals__`, `__init__`, ...) fails the render at
  once (stock jinja2 hands back an undefined value that prints as nothing, so a probing template would render);
* `include`, `import`, `from ... import` and `extends` are refused when the template is compiled: there is no
  loader, and a template may not name other files.
The environment offers what Hugging Face chat templates expect: `trim_blocks` / `lstrip_blocks`, the
`loopcontrols` extension, a `tojson` filter that keeps non-ASCII, `raise_exception(message)` and
`strftime_now(format)`.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Sequence


class TemplateError(ValueError):
    """The chat template failed to render these messages; the message says why."""


def _raise(message: str) -> None:
    raise TemplateError(f"the model's chat template refused the request: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment():
    from jinja2.exceptions import SecurityError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class StrictSandbox(ImmutableSandboxedEnvironment):
        def unsafe_undefined(self, obj: Any, attribute: str):
            raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe")

    environment = StrictSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return environment


@lru_cache(maxsize=8)
def compile_template(source: str):
    """The compiled template (cached: a server renders the same template for every request)."""
    from jinja2 import TemplateSyntaxError, nodes

    environment = _environment()
    try:
        tree = environment.parse(source)
    except TemplateSyntaxError as exc:
        raise TemplateError(f"the model's chat template is not valid jinja (line {exc.lineno}: {exc.message})") \
            from None
    for node in tree.find_all((nodes.Include, nodes.Import, nodes.FromImport, nodes.Extends)):
        kind = type(node).__name__.lower().replace("fromimport", "from-import")
        raise TemplateError(f"the model's chat template uses `{kind}` (line {node.lineno}), which reads another "
                            "template file; k3core renders a checkpoint's template on its own, so inline that file "
                            "into the template")
    return environment.from_string(tree)


def render_template(source: str, messages: Sequence[dict[str, Any]], tools: Sequence[Any] | None = None,
                    add_generation_prompt: bool = True, special_tokens: dict[str, str | None] | None = None,
                    **template_kwargs: Any) -> str:
    """The prompt text of `messages` under the template `source`; `special_tokens` (bos_token, eos_token, ...)
    and `template_kwargs` (a request's chat_template_kwargs) become template variables."""
    from jinja2.exceptions import SecurityError, UndefinedError
    template = compile_template(source)
    variables = {**(special_tokens or {}), **template_kwargs, "messages": list(messages),
                 "tools": list(tools) if tools else None, "add_generation_prompt": add_generation_prompt}
    try:
        return template.render(**variables)
    except SecurityError as exc:
        raise TemplateError(f"the model's chat template tried an operation the sandbox forbids ({exc})") from None
    except (UndefinedError, TypeError, ValueError) as exc:
        if isinstance(exc, TemplateError):
            raise
        raise TemplateError(f"the model's chat template failed on these messages ({type(exc).__name__}: {exc})") \
            from None
