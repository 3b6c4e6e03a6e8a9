"""Tokenizers: the checkpoint's own, or a byte-level one for presets and random-weight models.

`load_tokenizer(model_path_or_preset, config)` picks, in order:
1. `tokenizer.json` in the checkpoint directory, read with the `tokenizers` library;
2. otherwise transformers `AutoTokenizer` on the directory with `trust_remote_code=False` and local files only
   (a tokenizer that needs the checkpoint's own Python code is refused: k3core never runs downloaded code);
3. otherwise, when the directory has no tokenizer files (or the argument is a preset), a byte-level tokenizer:
   ids 0..255 are the UTF-8 bytes, bos/eos/pad come from the config, and the config's vocabulary must have room
   for them (vocab_size >= 259);
4. otherwise (a tiny test vocabulary) a token-ids-only tokenizer: the model runs on token ids, `decode` gives ""
   (there is no text to give) and `encode` raises TokenizerError saying to pass token ids.

Chat formatting uses the checkpoint's own template through transformers when the checkpoint ships one;
otherwise the documented plain template:

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n

(one `<|role|>\\n{content}\\n` block per message, then `<|assistant|>\\n` to prompt the reply), written as text
and encoded like any other text, after the bos id when the model has one. transformers is imported only when
it is needed.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from k3core.config import ModelConfig

NUM_BYTES = 256
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tiktoken.model", "vocab.json")


class TokenizerError(RuntimeError):
    """No usable tokenizer for this model; the message says what to provide."""


def plain_chat_text(messages: Sequence[dict[str, str]]) -> str:
    """The plain chat template as text (see the module docstring)."""
    blocks = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
    return "".join(blocks) + "<|assistant|>\n"


class Tokenizer:
    """encode/decode text and chat messages; `eos_token_ids` are the ids that end a generation."""

    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def apply_chat_template(self, messages: Sequence[dict[str, str]]) -> list[int]:
        ids = self.encode(plain_chat_text(messages))
        return ([self.bos_token_id] if self.bos_token_id is not None else []) + ids


class ByteTokenizer(Tokenizer):
    """ids 0..255 are UTF-8 bytes; special ids (bos/eos/pad, >= 256) come from the config and never decode to text."""

    def __init__(self, config: ModelConfig) -> None:
        if config.vocab_size < NUM_BYTES + 3:
            raise TokenizerError(f"vocab_size {config.vocab_size} is too small for the byte-level tokenizer "
                                 f"(needs >= {NUM_BYTES + 3}: 256 bytes plus bos/eos/pad)")
        self.bos_token_id, self.pad_token_id = config.bos_token_id, config.pad_token_id
        self.eos_token_ids = _config_eos_ids(config)
        self.vocab_size = config.vocab_size

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < NUM_BYTES).decode("utf-8", errors="replace")


class TokenIdsOnlyTokenizer(Tokenizer):
    """For a model without tokenizer files whose vocabulary is too small for bytes: token ids in, token ids out."""

    def __init__(self, config: ModelConfig) -> None:
        self.name, self.vocab_size = config.name, config.vocab_size
        self.bos_token_id, self.pad_token_id = config.bos_token_id, config.pad_token_id
        self.eos_token_ids = _config_eos_ids(config)

    def encode(self, text: str) -> list[int]:
        raise TokenizerError(f"model {self.name!r} has no tokenizer files and vocab_size {self.vocab_size} is too "
                             f"small for the byte-level tokenizer (needs >= {NUM_BYTES + 3}); pass token ids "
                             "instead of text, or a checkpoint directory with tokenizer.json")

    def decode(self, ids: Sequence[int]) -> str:
        return ""   # no text exists for these ids; callers read the token ids

    def apply_chat_template(self, messages: Sequence[dict[str, str]]) -> list[int]:
        return self.encode(plain_chat_text(messages))


def _config_eos_ids(config: ModelConfig) -> tuple[int, ...]:
    eos = list(config.extra.get("eos_token_ids") or [])
    if config.eos_token_id is not None and config.eos_token_id not in eos:
        eos.insert(0, config.eos_token_id)
    return tuple(eos)


class CheckpointTokenizer(Tokenizer):
    """A checkpoint's tokenizer: `tokenizers` (tokenizer.json) or transformers AutoTokenizer without remote code."""

    def __init__(self, directory: Path, config: ModelConfig) -> None:
        self.directory = directory
        settings = _read_json(directory / "tokenizer_config.json")
        self._auto: Any = None
        self._fast: Any = None
        if (directory / "tokenizer.json").exists():
            from tokenizers import Tokenizer as FastTokenizer
            self._fast = FastTokenizer.from_file(str(directory / "tokenizer.json"))
        else:
            self._auto = self._load_auto()
        self._has_template = bool(settings.get("chat_template")) or (directory / "chat_template.jinja").exists() \
            or (directory / "chat_template.json").exists()
        self.bos_token_id = self._special_id(settings.get("bos_token"), config.bos_token_id)
        self.pad_token_id = self._special_id(settings.get("pad_token"), config.pad_token_id)
        self.eos_token_ids = self._eos_ids(settings, config)

    def _load_auto(self) -> Any:
        from transformers import AutoTokenizer  # lazy: heavy, and only needed for these checkpoints
        try:
            return AutoTokenizer.from_pretrained(str(self.directory), trust_remote_code=False, local_files_only=True)
        except Exception as exc:   # transformers raises many types here; all mean "cannot build it safely"
            raise TokenizerError(f"the tokenizer in {self.directory} cannot be loaded without running its own code "
                                 f"({type(exc).__name__}); add a tokenizer.json (e.g. save it once with "
                                 "a trusted transformers install) next to the weights") from None

    def _special_id(self, token: Any, fallback: int | None) -> int | None:
        if isinstance(token, dict):          # transformers writes AddedToken objects as dicts
            token = token.get("content")
        if isinstance(token, str):
            found = self._token_to_id(token)
            if found is not None:
                return found
        return fallback

    def _token_to_id(self, token: str) -> int | None:
        if self._fast is not None:
            return self._fast.token_to_id(token)
        found = self._auto.convert_tokens_to_ids(token)
        return found if isinstance(found, int) and found != self._auto.unk_token_id else None

    def _eos_ids(self, settings: dict[str, Any], config: ModelConfig) -> tuple[int, ...]:
        eos: list[int] = []
        generation = _read_json(self.directory / "generation_config.json").get("eos_token_id")
        candidates = [self._special_id(settings.get("eos_token"), None), *_config_eos_ids(config),
                      *(generation if isinstance(generation, list) else [generation])]
        for value in candidates:
            if isinstance(value, int) and value not in eos:
                eos.append(value)
        return tuple(eos)

    def encode(self, text: str) -> list[int]:
        if self._fast is not None:
            return list(self._fast.encode(text, add_special_tokens=False).ids)
        return list(self._auto.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        if self._fast is not None:
            return self._fast.decode(list(ids), skip_special_tokens=True)
        return self._auto.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: Sequence[dict[str, str]]) -> list[int]:
        if not self._has_template:
            return super().apply_chat_template(messages)
        if self._auto is None:
            self._auto = self._load_auto()
        ids = self._auto.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):   # some versions return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    with open(path) as handle:
        data = json.load(handle)
    return data if isinstance(data, dict) else {}


def load_tokenizer(model_path_or_preset: str | Path, config: ModelConfig) -> Tokenizer:
    """The checkpoint's tokenizer when the directory has one, else the byte-level tokenizer (see module docstring)."""
    path = Path(model_path_or_preset)
    if path.is_file():
        path = path.parent
    if path.is_dir() and any((path / name).exists() for name in TOKENIZER_FILES):
        return CheckpointTokenizer(path, config)
    return ByteTokenizer(config) if config.vocab_size >= NUM_BYTES + 3 else TokenIdsOnlyTokenizer(config)
