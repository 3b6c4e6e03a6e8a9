"""Tokenizers: the checkpoint's own, or a byte-level one for presets and random-weight models.

`load_tokenizer(model_path_or_preset, config)` picks, in order:
1. `tokenizer.json` in the checkpoint directory, read with the `tokenizers` library;
2. `tiktoken.model` + `tokenizer_config.json` (the Kimi layout), read with the `tiktoken` package as data: the BPE
   ranks file, the Kimi split regex, and the 256 reserved special ids after the ranks, named from
   `added_tokens_decoder` (an unnamed one is `<|reserved_token_{id}|>`). The checkpoint's `tokenization_kimi.py` is
   never imported;
3. otherwise transformers `AutoTokenizer` on the directory with `trust_remote_code=False` and local files only
   (a tokenizer that needs the checkpoint's own Python code is refused: k3core never runs downloaded code);
4. otherwise, when the directory has no tokenizer files (or the argument is a preset), a byte-level tokenizer:
   ids 0..255 are the UTF-8 bytes, bos/eos/pad come from the config, and the config's vocabulary must have room
   for them (vocab_size >= 259);
5. otherwise (a tiny test vocabulary) a token-ids-only tokenizer: the model runs on token ids, `decode` gives ""
   (there is no text to give) and `encode` raises TokenizerError saying to pass token ids.

`encode(text)` never turns text into special tokens; `encode_with_specials(text)` does (for rendered jinja chat
templates and `POST /tokenize`). `decode` drops the tokens marked special, except the markers the chat output
parsers read, which stay as text: XTML's three structure markers `<|open|>`, `<|close|>`, `<|sep|>` and the five
K2-style tool-call markers (`<|tool_calls_section_begin|>` ... `<|tool_call_end|>`) of Kimi-Linear.

Chat formatting lives in `k3core.chat`: K3's XTML for `kimi_k3` models, the checkpoint's jinja template (sandboxed)
when it ships one, else the documented plain template

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n

(one `<|role|>\\n{content}\\n` block per message, then `<|assistant|>\\n` to prompt the reply), written as text
and encoded like any other text, after the bos id when the model has one. transformers is imported only when
it is needed.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from k3core.chat.k2_parsers import K2_TOOL_MARKERS
from k3core.chat.plain import plain_chat_text  # re-exported: the plain template (k3core.chat.plain)
from k3core.config import ModelConfig

NUM_BYTES = 256
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tiktoken.model", "vocab.json")
TIKTOKEN_FILE = "tiktoken.model"
NUM_RESERVED_SPECIAL_TOKENS = 256           # the Kimi tokenizer's special ids follow its ranks
XTML_STRUCTURE_MARKERS = ("<|open|>", "<|close|>", "<|sep|>")
KEPT_MARKERS = XTML_STRUCTURE_MARKERS + K2_TOOL_MARKERS                    # decoded as text even when special

# The Kimi split regex (pat_str): the eight alternatives in order. tiktoken's regex engine reads the `&&` class
# intersections.
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])


class TokenizerError(RuntimeError):
    """No usable tokenizer for this model; the message says what to provide."""


class Tokenizer:
    """encode/decode text and chat messages; `eos_token_ids` are the ids that end a generation.

    `model_type` is the checkpoint's Hugging Face model type (None for presets) and `chat_template` the jinja
    template it ships (None when it ships none): `k3core.chat` picks the chat format from these two."""

    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    model_type: str | None = None
    chat_template: str | None = None

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_with_specials(self, text: str) -> list[int]:
        """Like `encode`, except that the spelling of a special token becomes that token (a rendered template)."""
        return self.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def special_token_id(self, name: str) -> int | None:
        """The id of the special token spelled `name`, or None when this tokenizer has no such token."""
        return None

    def token_name(self, token_id: int | None) -> str | None:
        """The spelling of a special token id (for `/tokenizer_info`), or None."""
        return None

    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Prompt ids of `messages` with an open assistant turn, in this model's chat format (`k3core.chat`)."""
        from k3core.chat import render_messages
        return render_messages(self, messages)


class ByteTokenizer(Tokenizer):
    """ids 0..255 are UTF-8 bytes; special ids (bos/eos/pad, >= 256) come from the config and never decode to text;
    every other id decodes to the visible word ` w<id>` (a preset's random model streams text a client can see and
    time, instead of ids that show nothing), which encodes back as bytes.
    Their names (`<|bos|>`, `<|eos|>`, `<|pad|>`) exist only for `encode_with_specials` and `/tokenizer_info`."""

    def __init__(self, config: ModelConfig) -> None:
        if config.vocab_size < NUM_BYTES + 3:
            raise TokenizerError(f"vocab_size {config.vocab_size} is too small for the byte-level tokenizer "
                                 f"(needs >= {NUM_BYTES + 3}: 256 bytes plus bos/eos/pad)")
        self.bos_token_id, self.pad_token_id = config.bos_token_id, config.pad_token_id
        self.eos_token_ids = _config_eos_ids(config)
        self.vocab_size = config.vocab_size
        self._specials = {name: token_id for name, token_id in (("<|bos|>", self.bos_token_id),
                          ("<|eos|>", self.eos_token_ids[0] if self.eos_token_ids else None),
                          ("<|pad|>", self.pad_token_id)) if token_id is not None}

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_with_specials(self, text: str) -> list[int]:
        return _split_specials(text, self._specials, self.encode)

    def decode(self, ids: Sequence[int]) -> str:
        special = set(self._specials.values())
        data = bytearray()
        for i in ids:
            if 0 <= i < NUM_BYTES:
                data.append(i)
            elif i not in special and NUM_BYTES <= i < self.vocab_size:
                data += f" w{i}".encode()            # every id shows: a random preset streams visible text
        return data.decode("utf-8", errors="replace")

    def special_token_id(self, name: str) -> int | None:
        return self._specials.get(name)

    def token_name(self, token_id: int | None) -> str | None:
        return next((name for name, i in self._specials.items() if i == token_id), None)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        ids = self.encode(plain_chat_text(messages))
        return ([self.bos_token_id] if self.bos_token_id is not None else []) + ids


def _split_specials(text: str, specials: dict[str, int], encode) -> list[int]:
    """Encode `text` with every occurrence of a special token's spelling replaced by its id (longest first)."""
    import re
    if not specials:
        return encode(text)
    pattern = re.compile("|".join(re.escape(n) for n in sorted(specials, key=len, reverse=True)))
    ids: list[int] = []
    start = 0
    for match in pattern.finditer(text):
        ids += encode(text[start:match.start()]) if match.start() > start else []
        ids.append(specials[match.group()])
        start = match.end()
    return ids + (encode(text[start:]) if start < len(text) else [])


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

    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        return self.encode(plain_chat_text(messages))


def _config_eos_ids(config: ModelConfig) -> tuple[int, ...]:
    eos = list(config.extra.get("eos_token_ids") or [])
    if config.eos_token_id is not None and config.eos_token_id not in eos:
        eos.insert(0, config.eos_token_id)
    return tuple(eos)


def _read_chat_template(directory: Path, settings: dict[str, Any]) -> str | None:
    """The jinja chat template a checkpoint ships: chat_template.jinja, chat_template.json, or tokenizer_config's
    `chat_template` (a string, or a list of named templates of which "default" is used)."""
    if (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text()
    template = _read_json(directory / "chat_template.json").get("chat_template") or settings.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) and template else None


class _FileTokenizer(Tokenizer):
    """What the checkpoint tokenizers share: the directory's settings, template, and stop ids."""

    def _setup(self, directory: Path, config: ModelConfig) -> dict[str, Any]:
        self.directory = directory
        settings = _read_json(directory / "tokenizer_config.json")
        self.model_type = config.extra.get("hf_model_type")
        self.chat_template = _read_chat_template(directory, settings)
        return settings

    def _finish_setup(self, settings: dict[str, Any], config: ModelConfig) -> None:
        self.bos_token_id = self._special_id(settings.get("bos_token"), config.bos_token_id)
        self.pad_token_id = self._special_id(settings.get("pad_token"), config.pad_token_id)
        self.eos_token_ids = self._eos_ids(settings, config)

    def _special_id(self, token: Any, fallback: int | None) -> int | None:
        if isinstance(token, dict):          # transformers writes AddedToken objects as dicts
            token = token.get("content")
        if isinstance(token, str):
            found = self.special_token_id(token)
            if found is not None:
                return found
        return fallback

    def _eos_ids(self, settings: dict[str, Any], config: ModelConfig) -> tuple[int, ...]:
        eos: list[int] = []
        generation = _read_json(self.directory / "generation_config.json").get("eos_token_id")
        candidates = [*_config_eos_ids(config), *(generation if isinstance(generation, list) else [generation]),
                      self._special_id(settings.get("eos_token"), None)]
        for value in candidates:
            if isinstance(value, int) and value not in eos:
                eos.append(value)
        return tuple(eos)


class CheckpointTokenizer(_FileTokenizer):
    """A checkpoint's tokenizer: `tokenizers` (tokenizer.json) or transformers AutoTokenizer without remote code."""

    def __init__(self, directory: Path, config: ModelConfig) -> None:
        settings = self._setup(directory, config)
        self._auto: Any = None
        self._fast: Any = None
        if (directory / "tokenizer.json").exists():
            from tokenizers import Tokenizer as FastTokenizer
            try:
                self._fast = FastTokenizer.from_file(str(directory / "tokenizer.json"))
            except Exception as exc:   # the tokenizers library raises a bare Exception for a malformed file
                raise TokenizerError(f"{directory / 'tokenizer.json'} is not a tokenizer the tokenizers library can "
                                     f"read ({str(exc).splitlines()[0]}); re-download it") from None
            self._plain = FastTokenizer.from_file(str(directory / "tokenizer.json"))
            self._plain.encode_special_tokens = True        # a special token's spelling in text stays text
        else:
            self._auto = self._load_auto()
        self._finish_setup(settings, config)

    def _load_auto(self) -> Any:
        from transformers import AutoTokenizer  # lazy: heavy, and only needed for these checkpoints
        try:
            return AutoTokenizer.from_pretrained(str(self.directory), trust_remote_code=False, local_files_only=True)
        except Exception as exc:   # transformers raises many types here; all mean "cannot build it safely"
            raise TokenizerError(f"the tokenizer in {self.directory} cannot be loaded without running its own code "
                                 f"({type(exc).__name__}); k3core reads tokenizer.json, or tiktoken.model with "
                                 "tokenizer_config.json: add one of them next to the weights") from None

    def special_token_id(self, name: str) -> int | None:
        if self._fast is not None:
            return self._fast.token_to_id(name)
        found = self._auto.convert_tokens_to_ids(name)
        return found if isinstance(found, int) and found != self._auto.unk_token_id else None

    def token_name(self, token_id: int | None) -> str | None:
        if token_id is None:
            return None
        if self._fast is not None:
            return self._fast.id_to_token(token_id)
        return self._auto.convert_ids_to_tokens(token_id)

    def encode(self, text: str) -> list[int]:
        if self._fast is not None:
            return list(self._plain.encode(text, add_special_tokens=False).ids)
        return list(self._auto.encode(text, add_special_tokens=False, split_special_tokens=True))

    def encode_with_specials(self, text: str) -> list[int]:
        if self._fast is not None:
            return list(self._fast.encode(text, add_special_tokens=False).ids)
        return list(self._auto.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        if self._fast is not None:
            return self._fast.decode(list(ids), skip_special_tokens=True)
        return self._auto.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        if self.chat_template is None and self.model_type != "kimi_k3":
            ids = self.encode(plain_chat_text(messages))
            return ([self.bos_token_id] if self.bos_token_id is not None else []) + ids
        return super().apply_chat_template(messages)


class TiktokenTokenizer(_FileTokenizer):
    """The Kimi tokenizer from `tiktoken.model` + `tokenizer_config.json`, built with the `tiktoken` package.

    Ids 0..num_ranks-1 are the ranks file's tokens; the next 256 are specials named by `added_tokens_decoder`.
    `decode` drops a special whose entry says `"special": true` (and every unnamed reserved one) and keeps the rest,
    the chat parsers' markers (`KEPT_MARKERS`) always, as their spelling."""

    def __init__(self, directory: Path, config: ModelConfig) -> None:
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        settings = self._setup(directory, config)
        try:
            ranks = load_tiktoken_bpe(str(directory / TIKTOKEN_FILE))
        except Exception as exc:       # a malformed line raises ValueError, binascii.Error, IndexError...
            raise TokenizerError(f"{directory / TIKTOKEN_FILE} is not a tiktoken ranks file (one `base64 rank` pair "
                                 f"per line): {type(exc).__name__}: {exc}") from None
        self.num_ranks = len(ranks)
        names = {i: f"<|reserved_token_{i}|>" for i in range(self.num_ranks,
                                                            self.num_ranks + NUM_RESERVED_SPECIAL_TOKENS)}
        hidden = set(names)                                # unnamed reserved ids never show as text
        for key, entry in (settings.get("added_tokens_decoder") or {}).items():
            token_id = int(key)
            name = entry.get("content") if isinstance(entry, dict) else entry
            if not isinstance(name, str) or token_id < self.num_ranks:
                continue
            names[token_id] = name
            special = entry.get("special", True) if isinstance(entry, dict) else True
            (hidden.add if special and name not in KEPT_MARKERS else hidden.discard)(token_id)
        self._names = names
        self._hidden = hidden
        self._special_ids = {name: token_id for token_id, name in names.items()}
        self.vocab_size = max(names) + 1
        if self.vocab_size > config.vocab_size:
            raise TokenizerError(f"{directory} has a tokenizer of {self.vocab_size} ids ({self.num_ranks} ranks in "
                                 f"{TIKTOKEN_FILE} plus specials) but config.json's vocab_size is "
                                 f"{config.vocab_size}; the two files do not belong to the same model")
        self._encoding = tiktoken.Encoding(name=directory.name or "kimi", pat_str=KIMI_PAT_STR,
                                           mergeable_ranks=ranks, special_tokens=self._special_ids)
        self._finish_setup(settings, config)

    def encode(self, text: str) -> list[int]:
        return self._encoding.encode_ordinary(text)

    def encode_with_specials(self, text: str) -> list[int]:
        return self._encoding.encode(text, allowed_special="all")

    def decode(self, ids: Sequence[int]) -> str:
        kept = [i for i in ids if 0 <= i < self.num_ranks or (i in self._names and i not in self._hidden)]
        return self._encoding.decode_bytes(kept).decode("utf-8", errors="replace")

    def special_token_id(self, name: str) -> int | None:
        return self._special_ids.get(name)

    def token_name(self, token_id: int | None) -> str | None:
        return self._names.get(token_id) if token_id is not None else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        with open(path, "rb") as handle:
            data = json.loads(handle.read().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise TokenizerError(f"{path} is not readable JSON ({str(exc).splitlines()[0]}); re-download it or "
                             "remove it") from None
    return data if isinstance(data, dict) else {}


def load_tokenizer(model_path_or_preset: str | Path, config: ModelConfig) -> Tokenizer:
    """The checkpoint's tokenizer when the directory has one, else the byte-level tokenizer (see module docstring).

    Reads data files only. A directory with tokenizer files of which none is readable raises TokenizerError."""
    path = Path(model_path_or_preset)
    if path.is_file():
        path = path.parent
    if path.is_dir() and any((path / name).exists() for name in TOKENIZER_FILES):
        if (path / "tokenizer.json").exists():
            return CheckpointTokenizer(path, config)
        if (path / TIKTOKEN_FILE).exists():
            if not (path / "tokenizer_config.json").exists():
                raise TokenizerError(f"{path} has {TIKTOKEN_FILE} but no tokenizer_config.json, which names its "
                                     "special tokens; copy it from the model's release next to the weights")
            return TiktokenTokenizer(path, config)
        if _read_json(path / "tokenizer_config.json").get("auto_map"):
            raise TokenizerError(f"{path} has neither tokenizer.json nor {TIKTOKEN_FILE}, and its tokenizer_config.json "
                                 "names a tokenizer that only its own Python code can build (k3core never runs it): "
                                 "add tokenizer.json or tiktoken.model next to the weights")
        return CheckpointTokenizer(path, config)
    return ByteTokenizer(config) if config.vocab_size >= NUM_BYTES + 3 else TokenIdsOnlyTokenizer(config)
