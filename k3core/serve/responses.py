"""OpenAI response objects (completions and chat, whole and streamed) built from a `Generation`'s choices."""
from __future__ import annotations

import json
from typing import Any

from k3core.serve import chat
from k3core.serve.generation import Choice, Generation, Usage
from k3core.serve.text import token_text


# Characters that json.dumps(ensure_ascii=False) leaves raw but that line-based SSE readers (Python's
# str.splitlines, JavaScript line terminators) take for line breaks: escaped, the event stays one line.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event; its JSON is one line for every reader."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False).translate(_LINE_BREAKS)
    return f"data: {text}\n\n"


SSE_DONE = sse("[DONE]")


def _top(entry: dict[int, float], num: int) -> list[tuple[int, float]]:
    """The `num` most likely tokens of one logprob entry (the engine adds the chosen token to the top-N)."""
    return sorted(entry.items(), key=lambda item: -item[1])[:num]


# ---- completions --------------------------------------------------------------------------------
def completion_logprobs(tokenizer: Any, choice: Choice, start: int, entries: list[dict[int, float]],
                        num: int) -> dict[str, Any]:
    """Logprobs of the tokens `choice.token_ids[start:]`; `text_offset` counts characters of the output text."""
    tokens, token_logprobs, tops = [], [], []
    for token_id, entry in zip(choice.token_ids[start:], entries):
        tokens.append(token_text(tokenizer, token_id))
        token_logprobs.append(entry.get(token_id))
        tops.append({token_text(tokenizer, t): v for t, v in _top(entry, num)} if num else None)
    offsets = choice.text_offsets(tokenizer, start)[:len(tokens)]
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def completion_choice(gen: Generation, choice: Choice, text: str, num_new_tokens: int,
                      entries: list[dict[int, float]], finish: bool) -> dict[str, Any]:
    """One choice of a response (all tokens) or of a chunk (the last `num_new_tokens` of the choice)."""
    logprobs = None
    if gen.params.logprobs is not None:
        logprobs = completion_logprobs(gen.tokenizer, choice,
                                       len(choice.token_ids) - num_new_tokens, entries, gen.params.logprobs)
    return {"index": choice.index, "text": text, "logprobs": logprobs,
            "finish_reason": choice.finish_reason if finish else None}


def completion_body(gen: Generation, model: str) -> dict[str, Any]:
    choices = [completion_choice(gen, c, c.text, len(c.token_ids), c.logprobs, True) for c in gen.choices]
    return {"id": gen.request_id, "object": "text_completion", "created": gen.created, "model": model,
            "choices": choices, "usage": gen.usage().body()}


def _stream_chunk(kind: str, gen: Generation, model: str, choices: list[dict[str, Any]],
                  usage: Usage | None) -> dict[str, Any]:
    body = {"id": gen.request_id, "object": kind, "created": gen.created, "model": model, "choices": choices}
    if gen.include_usage:                     # every chunk carries the key; only the last one a value
        body["usage"] = usage.body() if usage is not None else None
    return body


def completion_chunk(gen: Generation, model: str, choices: list[dict[str, Any]],
                     usage: Usage | None = None) -> dict[str, Any]:
    return _stream_chunk("text_completion", gen, model, choices, usage)


# ---- chat -----------------------------------------------------------------------------------------
def _token_entry(tokenizer: Any, token_id: int, logprob: float | None) -> dict[str, Any]:
    text = token_text(tokenizer, token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer: Any, token_ids: list[int], entries: list[dict[int, float]],
                  num: int) -> dict[str, Any]:
    content = []
    for token_id, entry in zip(token_ids, entries):
        item = _token_entry(tokenizer, token_id, entry.get(token_id))
        item["top_logprobs"] = [_token_entry(tokenizer, t, v) for t, v in _top(entry, num)]
        content.append(item)
    return {"content": content}


def chat_finish_reason(choice: Choice) -> str | None:
    return chat.finish_reason(choice.finish_reason, bool(choice.parser is not None and choice.parser.tool_calls))


def chat_message(choice: Choice) -> dict[str, Any]:
    """The whole message of a finished choice: its text, or what the K3 parser reads in it."""
    if choice.parser is None:
        return {"role": "assistant", "content": choice.text}
    choice.parser.feed(choice.text)
    choice.parser.finish()
    return chat.message_body(choice.parser.result())


def chat_body(gen: Generation, model: str) -> dict[str, Any]:
    choices = []
    for c in gen.choices:
        logprobs = None
        if gen.params.logprobs is not None:
            logprobs = chat_logprobs(gen.tokenizer, c.token_ids, c.logprobs, gen.params.logprobs)
        message = chat_message(c)
        choices.append({"index": c.index, "message": message, "logprobs": logprobs,
                        "finish_reason": chat_finish_reason(c)})
    return {"id": gen.request_id, "object": "chat.completion", "created": gen.created, "model": model,
            "choices": choices, "usage": gen.usage().body()}


def chat_chunk(gen: Generation, model: str, choices: list[dict[str, Any]],
               usage: Usage | None = None) -> dict[str, Any]:
    return _stream_chunk("chat.completion.chunk", gen, model, choices, usage)


def chat_delta(choice: Choice, text: str) -> dict[str, Any]:
    """A streamed chunk's delta for `text`, the choice's new output: the text itself, or what the K3 parser hands
    out for it (everything it held back too, once the choice has finished)."""
    if choice.parser is None:
        return {"content": text} if text else {}
    parsed = choice.parser.feed(text)
    if choice.finished:
        parsed = chat.merge_deltas(parsed, choice.parser.finish())
    return chat.delta_body(parsed)


def chat_choice_delta(gen: Generation, choice: Choice, delta: dict[str, Any], token_ids: list[int],
                      entries: list[dict[int, float]], finish: bool) -> dict[str, Any]:
    logprobs = None
    if gen.params.logprobs is not None and token_ids:
        logprobs = chat_logprobs(gen.tokenizer, token_ids, entries, gen.params.logprobs)
    return {"index": choice.index, "delta": delta, "logprobs": logprobs,
            "finish_reason": chat_finish_reason(choice) if finish else None}
