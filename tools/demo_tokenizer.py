"""The demo model's tokenizer in the published Kimi format, and the XTML rendering of its chat examples.

A byte-level BPE is trained with the `tokenizers` library on text pre-split by the Kimi split regex (so the
tiktoken encoder, which splits by the same regex, sees the same pieces), then written as K3 ships it:
`tiktoken.model` (one `base64(bytes) rank` line per token; ranks 0..255 are the single bytes, then the merges in
the order they were learned) and `tokenizer_config.json` whose `added_tokens_decoder` names the 256 reserved
special tokens at ids num_ranks .. num_ranks + 255 at K3's offsets (K3_CHAT_FORMAT.md section 2). Text is encoded
with the `tiktoken` package from those two files only.

XTML (K3_CHAT_FORMAT.md section 3) is rendered as segments: a marker is its special id, every other segment is
BPE-encoded on its own (tag names and attribute pieces are separate segments). Training renders its examples with
the product's renderer (`k3core.chat.xtml`); the small renderer here is written independently from the format
notes and kept as the second opinion that tests compare `k3core.chat` against.
"""
from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Iterable, Sequence

from k3core.tokenizer import KIMI_PAT_STR

NUM_RESERVED_SPECIAL_TOKENS = 256
# Offsets from the first special id, as K3 numbers them (163584 + offset).
NAMED_SPECIAL_OFFSETS = {
    0: "[BOS]", 1: "[EOS]", 2: "<|end_of_msg|>", 3: "<|open|>", 4: "<|close|>", 5: "<|sep|>",
    6: "[start_header_id]", 7: "[end_header_id]", 9: "[EOT]",
    18: "<|media_begin|>", 19: "<|media_content|>", 20: "<|media_end|>", 21: "<|media_pad|>",
    254: "[UNK]", 255: "[PAD]",
}
NON_SPECIAL_MARKERS = ("<|open|>", "<|close|>", "<|sep|>")   # reported as "special": false upstream
OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
TIKTOKEN_FILE = "tiktoken.model"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def special_names(num_ranks: int) -> dict[int, str]:
    """id -> name of the 256 reserved specials; unnamed ones are `<|reserved_token_{id}|>`."""
    out = {}
    for offset in range(NUM_RESERVED_SPECIAL_TOKENS):
        token_id = num_ranks + offset
        out[token_id] = NAMED_SPECIAL_OFFSETS.get(offset, f"<|reserved_token_{token_id}|>")
    return out


def split_pieces(text: str) -> list[str]:
    """The Kimi regex's pieces of `text` (the `regex` module reads the `&&` class intersections in V1 mode)."""
    import regex
    return regex.findall("(?V1)" + KIMI_PAT_STR, text)


def train_bpe_ranks(texts: Iterable[str], num_ranks: int) -> list[bytes]:
    """Byte-level BPE trained on the Kimi-regex pieces of `texts`: the byte string of every rank, 0..num_ranks-1."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    # The pieces are already split: ByteLevel only maps bytes to its printable alphabet, it must not split again.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=num_ranks, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[], show_progress=False)
    tokenizer.train_from_iterator((piece for text in texts for piece in split_pieces(text)), trainer=trainer)
    vocab = tokenizer.get_vocab()                               # printable-alphabet token -> id
    byte_of_char = _byte_level_decoding()
    by_id = sorted(vocab.items(), key=lambda item: item[1])
    singles = [tok for tok, _ in by_id if len(tok) == 1]
    merged = [tok for tok, _ in by_id if len(tok) > 1]          # ids after the alphabet are in merge order
    if len(singles) != 256:
        raise RuntimeError(f"the BPE alphabet has {len(singles)} symbols, expected the 256 bytes")
    ranks = [bytes([b]) for b in range(256)]
    ranks += [bytes(byte_of_char[ch] for ch in tok) for tok in merged]
    return ranks[:num_ranks]


def _byte_level_decoding() -> dict[str, int]:
    """GPT-2's byte <-> printable character map, inverted (the alphabet `tokenizers`' ByteLevel uses)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def write_tokenizer(ranks: Sequence[bytes], directory: Path) -> None:
    """tiktoken.model and tokenizer_config.json in the published layout."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / TIKTOKEN_FILE, "w") as handle:
        for rank, token in enumerate(ranks):
            handle.write(f"{base64.b64encode(token).decode()} {rank}\n")
    decoder = {}
    for token_id, name in special_names(len(ranks)).items():
        decoder[str(token_id)] = {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                                  "single_word": False, "special": name not in NON_SPECIAL_MARKERS}
    config = {
        "tokenizer_class": "TikTokenTokenizer",
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [OPEN, CLOSE, SEP, END_OF_MSG],
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1048576,
    }
    with open(directory / TOKENIZER_CONFIG_FILE, "w") as handle:
        json.dump(config, handle, indent=2, ensure_ascii=False)
        handle.write("\n")


def load_encoding(directory: Path):
    """A `tiktoken.Encoding` from the directory's two files (data only: no code from the directory runs)."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    ranks = load_tiktoken_bpe(str(directory / TIKTOKEN_FILE))
    with open(directory / TOKENIZER_CONFIG_FILE) as handle:
        decoder = json.load(handle)["added_tokens_decoder"]
    specials = {entry["content"]: int(token_id) for token_id, entry in decoder.items()}
    return tiktoken.Encoding(name=directory.name, pat_str=KIMI_PAT_STR, mergeable_ranks=ranks,
                             special_tokens=specials)


def ranks_sha256(directory: Path) -> str:
    return hashlib.sha256((directory / TIKTOKEN_FILE).read_bytes()).hexdigest()


# ---- XTML segments ----------------------------------------------------------------------------------------------

class Marker(str):
    """A segment that is one of the four XTML control tokens (encoded as its special id)."""


def _escape(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


def open_tag(tag: str, attributes: Sequence[tuple[str, str]] = ()) -> list[str]:
    out: list[str] = [Marker(OPEN), tag]
    for key, value in attributes:
        out += [f" {key}", '="', _escape(value), '"']
    return out + [Marker(SEP)]


def close_tag(tag: str) -> list[str]:
    return [Marker(CLOSE), tag, Marker(SEP)]


def message(role: str, body: Sequence[str], attributes: Sequence[tuple[str, str]] = ()) -> list[str]:
    return [*open_tag("message", [("role", role), *attributes]), *body, *close_tag("message"), Marker(END_OF_MSG)]


def thinking_effort_body(effort: str) -> str:
    return ("`thinking_effort` guides on how much to think in your thinking channel (not including the response "
            "channel), supported values include `low`, `medium`, `high`, and `max`.\n"
            f"Now the system is invoked with `thinking_effort={effort}`.")


def render_conversation(messages: Sequence[dict[str, str]], thinking: bool, effort: str | None) -> list[str]:
    """Segments of a whole conversation whose last message is the assistant's finished answer.

    Order: the thinking-effort system message (thinking on), the messages; an assistant body is an optional think
    pair (present, maybe empty, when thinking is on) then the response pair. The rendering up to the assistant's
    body is exactly the generation prompt (`<|open|>message role="assistant"<|sep|>` then `<|open|>think<|sep|>`
    or `<|open|>response<|sep|>`).
    """
    out: list[str] = []
    if thinking:
        out += message("system", [thinking_effort_body(effort or "max")], [("type", "thinking-effort")])
    for entry in messages:
        if entry["role"] != "assistant":
            out += message(entry["role"], [entry["content"]])
            continue
        body: list[str] = []
        if thinking:
            body += [*open_tag("think"), *_nonempty([entry.get("reasoning_content", "")]), *close_tag("think")]
        body += [*open_tag("response"), *_nonempty([entry["content"]]), *close_tag("response")]
        out += message("assistant", body)
    return out


def generation_prompt(messages: Sequence[dict[str, str]], thinking: bool, effort: str | None) -> list[str]:
    """Segments of a prompt that asks the assistant for the next message."""
    out: list[str] = []
    if thinking:
        out += message("system", [thinking_effort_body(effort or "max")], [("type", "thinking-effort")])
    for entry in messages:
        out += message(entry["role"], [entry["content"]])
    return out + open_tag("message", [("role", "assistant")]) + open_tag("think" if thinking else "response")


def _nonempty(segments: Sequence[str]) -> list[str]:
    return [s for s in segments if s]


def encode_segments(encoding, segments: Sequence[str]) -> list[int]:
    """Markers -> their special ids; every other segment encoded on its own with specials disallowed as text."""
    ids: list[int] = []
    for segment in segments:
        if isinstance(segment, Marker):
            ids.append(encoding.encode_single_token(str(segment)))
        else:
            ids += encoding.encode_ordinary(segment)
    return ids
