"""The demo model's corpus: the Python standard library's own source (PSF licence) and docstring -> function
chat pairs rendered in K3's XTML format, split into a training and a held-out part by a hash of the file path.

The selection rule is SELECTION_RULE (the model card quotes it).
"""
from __future__ import annotations

import ast
import hashlib
import random
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path

SELECTION_RULE = (
    "every `*.py` file under the running Python's standard library directory, sorted by relative path, "
    "except files under `site-packages/`, `test/`, `tests/`, `idlelib/`, `lib2to3/`, `ensurepip/`, "
    "`turtledemo/` and `__pycache__/`, and files larger than 256 KiB. A file is held out when the first "
    "byte of sha256(relative path) is below 16 (1/16 of the files). A chat pair comes from a function "
    "(or method) of the same file with a docstring of at least 24 characters and a source of at most "
    "1,600 characters; pairs inherit their file's split."
)
EXCLUDED_PARTS = ("site-packages", "test", "tests", "idlelib", "lib2to3", "ensurepip", "turtledemo", "__pycache__")
MAX_FILE_BYTES = 256 << 10
HOLDOUT_BYTE = 16                   # sha256(path)[0] < 16: 1/16 of the files
MIN_DOCSTRING_CHARS = 24
MAX_FUNCTION_CHARS = 1600


@dataclass(frozen=True)
class SourceFile:
    relative_path: str
    text: str
    held_out: bool


@dataclass(frozen=True)
class FunctionPair:
    """A function with a docstring: what the user asks and what the assistant answers."""
    relative_path: str
    name: str
    signature: str
    docstring: str
    source: str                     # dedented, decorators included
    held_out: bool


def describe(root: Path | None = None) -> dict[str, str]:
    """The selection rule and the interpreter it ran on, for the model card."""
    import sys
    return {"rule": SELECTION_RULE, "python_version": sys.version.split()[0],
            "stdlib_dir": str(root or stdlib_dir())}


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relative_path: str) -> bool:
    return hashlib.sha256(relative_path.encode()).digest()[0] < HOLDOUT_BYTE


def select_files(root: Path | None = None) -> list[SourceFile]:
    """The corpus files (see the module docstring), sorted by relative path."""
    root = root or stdlib_dir()
    files = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if any(part in EXCLUDED_PARTS for part in relative.split("/")[:-1]) or path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        files.append(SourceFile(relative, text, is_held_out(relative)))
    return files


def function_pairs(source: SourceFile) -> list[FunctionPair]:
    """Functions of one file with a usable docstring, in source order."""
    try:
        tree = ast.parse(source.text)
    except SyntaxError:
        return []
    lines = source.text.splitlines()
    pairs = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        docstring = ast.get_docstring(node)
        if not docstring or len(docstring) < MIN_DOCSTRING_CHARS:
            continue
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        body = textwrap.dedent("\n".join(lines[first - 1: node.end_lineno]))
        if len(body) > MAX_FUNCTION_CHARS:
            continue
        signature = f"{node.name}({ast.unparse(node.args)})"
        pairs.append(FunctionPair(source.relative_path, node.name, signature, docstring, body, source.held_out))
    pairs.sort(key=lambda p: (p.relative_path, p.source))
    return pairs


# ---- the chat rendering of a pair ---------------------------------------------------------------------------

_ASKS = (
    "Write a Python function `{signature}` that does the following:\n\n{docstring}",
    "Implement `{signature}` in Python. Its docstring says:\n\n{docstring}",
    "I need a Python function named `{name}`.\n\n{docstring}",
    "{docstring}\n\nWrite this as a Python function called `{name}`.",
)
_THINKS = (
    "The user wants `{name}`. I will write it in Python with its docstring, following what the docstring says.",
    "A function `{signature}` is asked for. I will keep the docstring and write the body.",
    "I need to write `{name}`. The docstring describes the behaviour; the answer is one Python function.",
)
_SYSTEMS = ("You are a helpful assistant.", "You are a Python programming assistant.",
            "You are Kimi, a helpful assistant.")
THINKING_EFFORTS = ("low", "high", "max")


@dataclass(frozen=True)
class ChatExample:
    """One rendered conversation: the messages in K3's chat-request shape and the thinking settings."""
    messages: list[dict[str, str]]       # role, content (and reasoning_content for the assistant)
    thinking: bool
    effort: str | None


def chat_example(pair: FunctionPair, rng: random.Random) -> ChatExample:
    """The pair as a conversation: an optional system message, the user's request, the assistant's answer.

    Thinking is on in 3 of 4 examples (effort low / high / max, K3's default max the most often); the answer is
    the function in a fenced code block.
    """
    fields = dict(name=pair.name, signature=pair.signature, docstring=pair.docstring)
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(_SYSTEMS)})
    messages.append({"role": "user", "content": rng.choice(_ASKS).format(**fields)})
    thinking = rng.random() < 0.75
    effort = rng.choice(("low", "high", "max", "max")) if thinking else None
    answer = {"role": "assistant", "content": f"```python\n{pair.source}\n```"}
    if thinking:
        answer["reasoning_content"] = rng.choice(_THINKS).format(**fields)
    messages.append(answer)
    return ChatExample(messages, thinking, effort)
