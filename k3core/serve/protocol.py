"""OpenAI request bodies parsed and checked into typed objects; every problem becomes an `APIError`.

Only JSON types are checked here (a string where a number belongs, a negative `n`); limits that depend on the
model (context length, vocabulary) are checked in `app.py`, which knows the model.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

from k3core.serve.fields import (  # noqa: F401  (APIError is part of this module's API)
    MISSING, APIError, bool_field, float_field, int_field, int_list, type_error)

MAX_N = 64
MAX_STOP = 256               # stop strings per request (matched incrementally: the cost is per new character)
MAX_LOGIT_BIAS = 1024        # entries of logit_bias
MAX_COMPLETION_LOGPROBS = 20       # completions: logprobs 0..20 (as vLLM)
MAX_TOP_LOGPROBS = 20             # chat: top_logprobs 0..20
MAX_PROMPT_LOGPROBS = 20          # both: prompt_logprobs 0..20 (vLLM's extension)


@dataclass
class SamplingRequest:
    """What completions and chat share: how to sample and when to stop. `max_tokens` None: the server picks."""
    model: str
    max_tokens: int | None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    n: int = 1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None            # top-N per token, None = no logprobs
    prompt_logprobs: int | None = None     # vLLM's extension: top-N per prompt token, None = none
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    stream: bool = False
    include_usage: bool = False
    structured_outputs: dict[str, Any] | None = None   # vLLM's: exactly one of json / regex / choice / grammar
    given: frozenset[str] = frozenset()    # the fields the body sets (the rest may take the model's defaults)
    ignored: tuple[str, ...] = ()          # unknown fields of the body: ignored, and named in one log line


@dataclass
class CompletionRequest(SamplingRequest):
    prompts: list[str | list[int]] = field(default_factory=list)
    echo: bool = False                     # the text (and logprobs) start with the prompt's


@dataclass
class ChatMessage:
    role: str
    content: str
    name: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)   # assistant: OpenAI tool calls, arguments text
    tool_call_id: str | None = None                                   # tool: the call this result answers
    reasoning_content: str | None = None                              # assistant: its earlier reasoning

    def as_dict(self) -> dict[str, Any]:
        """The message as the chat renderers take it (OpenAI's shape, empty fields left out)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


REASONING_EFFORTS = ("low", "high", "max", "none")


@dataclass
class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None   # "auto" | "none" | "required" | {"type": "function", ...}
    parallel_tool_calls: bool = True          # False: at most one call (enforced by the K3 reply grammar)
    thinking: bool | None = None              # None: the model's default (on for K3)
    thinking_effort: str | None = None        # low | high | max
    response_format: dict[str, Any] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)   # chat_template_kwargs, for jinja templates


# ---- field readers: `k3core.serve.fields`; the request-specific ones -----------------------------------
def _stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise type_error("stop", "a string or a list of strings", value)
    if len(value) > MAX_STOP:
        raise APIError(f"'stop' takes at most {MAX_STOP} sequences", param="stop", code="invalid_value")
    return [s for s in value if s]


def _logit_bias(body: dict) -> dict[int, float]:
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise APIError(f"'logit_bias' must be an object of at most {MAX_LOGIT_BIAS} token id -> bias entries",
                       param="logit_bias", code="invalid_value")
    bias = {}
    for key, number in value.items():
        if not (isinstance(key, str) and key.isdigit() and len(key) <= 10) or isinstance(number, bool) \
                or not isinstance(number, (int, float)) or not -100 <= number <= 100:
            raise APIError(f"'logit_bias' maps token ids (strings of digits) to numbers in [-100, 100]; got "
                           f"{key!r:.20}: {number!r:.20}", param="logit_bias", code="invalid_value")
        bias[int(key)] = float(number)
    return bias


def _unsupported(body: dict, echo: bool) -> None:
    if body.get("best_of") not in (None, 1) or (body.get("echo") and not echo):
        name = "echo" if body.get("echo") and not echo else "best_of"
        where = " on chat completions (only on /v1/completions)" if name == "echo" else ""
        raise APIError(f"'{name}' is not supported by this server{where}; leave it out", param=name,
                       code="unsupported_parameter")
    for name in GUIDED_FIELDS:
        if body.get(name) is not None:
            raise APIError(f"'{name}' (vLLM's older spelling) is not supported; send 'structured_outputs' with "
                           f"one of {', '.join(STRUCTURED_OUTPUT_KEYS)} instead", param=name,
                           code="unsupported_parameter")


STRUCTURED_OUTPUT_KEYS = ("json", "regex", "choice", "grammar")
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
                 "guided_whitespace_pattern", "guided_json_object", "structural_tag")


def _structured_outputs(body: dict) -> dict[str, Any] | None:
    """vLLM's `structured_outputs`: exactly one constraint, its JSON type checked (compiling it is app.py's)."""
    value = body.get("structured_outputs")
    if value is None:
        return None
    name = "structured_outputs"
    if not isinstance(value, dict):
        raise type_error(name, f"an object with one of {', '.join(STRUCTURED_OUTPUT_KEYS)}", value)
    given = {key: item for key, item in value.items() if item is not None}
    unknown = [key for key in given if key not in STRUCTURED_OUTPUT_KEYS]
    if unknown:
        raise APIError(f"'{name}.{unknown[0]}' is not supported by this server; use one of "
                       f"{', '.join(STRUCTURED_OUTPUT_KEYS)}", param=f"{name}.{unknown[0]}",
                       code="unsupported_parameter")
    if len(given) != 1:
        raise APIError(f"'{name}' must set exactly one of {', '.join(STRUCTURED_OUTPUT_KEYS)}, got "
                       f"{len(given)}", param=name, code="invalid_value")
    ((key, item),) = given.items()
    if key == "json" and isinstance(item, str):
        try:
            item = json.loads(item)
        except json.JSONDecodeError as exc:
            raise APIError(f"'{name}.json' is not valid JSON ({exc}); give a JSON schema", param=f"{name}.json",
                           code="invalid_value") from None
    want = {"json": (dict, "a JSON schema (an object)"), "regex": (str, "a string"),
            "choice": (list, "a non-empty list of strings"), "grammar": (str, "an EBNF grammar (a string)")}[key]
    if not isinstance(item, want[0]) or (key == "choice" and (not item or not all(isinstance(c, str)
                                                                                 for c in item))):
        raise type_error(f"{name}.{key}", want[1], item)
    return {key: item}




# ---- which fields each endpoint honours ---------------------------------------------------------------
# Policy (as vLLM): a field the server honours is read below; a known OpenAI/vLLM field it does not honour is a
# 400 naming it whenever it asks for something other than the default; any other field is ignored and named in
# one warning log line. docs/serving.md lists the three sets.
SAMPLING_FIELDS = frozenset({
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed", "stop", "stop_token_ids",
    "ignore_eos", "include_stop_str_in_output", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "min_tokens", "logit_bias", "stream", "stream_options",
    "user",                  # metadata for the caller's own bookkeeping; harmless, accepted as vLLM does
})
COMPLETION_FIELDS = SAMPLING_FIELDS | {"prompt", "logprobs", "echo", "prompt_logprobs", "structured_outputs"}
CHAT_FIELDS = SAMPLING_FIELDS | {
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice", "response_format",
    "structured_outputs", "chat_template_kwargs", "reasoning_effort", "prompt_logprobs", "echo",
    "parallel_tool_calls"}


def _default(*allowed: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or any(value == a and type(value) is type(a) for a in allowed)


# field -> (accepts this value, what to do instead); a value it does not accept is a 400 naming the field
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "best_of": (_default(1), "only best_of 1 is supported; use n for several samples"),
    "suffix": (_default(""), "insertion (suffix) is not supported; leave it out"),
    "use_beam_search": (_default(False), "beam search is not supported; leave it out"),
    "length_penalty": (_default(1, 1.0), "length_penalty applies to beam search, which is not supported"),
    "truncate_prompt_tokens": (_default(), "prompts are never truncated; shorten the prompt instead"),
    "functions": (_default(), "the legacy functions field is not supported; use tools"),
    "function_call": (_default(), "the legacy function_call field is not supported; use tool_choice"),
    "parallel_tool_calls": (_default(True), "parallel_tool_calls false applies to chat tool calls only"),
    "store": (_default(False), "this server stores no completions; leave store out"),
    "audio": (_default(), "audio output is not supported; leave it out"),
    "modalities": (_default(["text"]), "only text output is supported; leave modalities out"),
    "prediction": (_default(), "predicted outputs are not supported; leave prediction out"),
    "web_search_options": (_default(), "web search is not supported; leave web_search_options out"),
}


def _check_fields(body: dict, honoured: frozenset[str]) -> tuple[str, ...]:
    """Refuse a known field the server does not honour (400 naming it); return the unknown fields, sorted."""
    for name, (accepts, advice) in UNSUPPORTED.items():
        if name in body and name not in honoured and not accepts(body[name]):
            raise APIError(f"'{name}' is not supported by this server: {advice}", param=name,
                           code="unsupported_parameter")
    return tuple(sorted(str(name)[:64] for name in body
                        if name not in honoured and name not in UNSUPPORTED and name not in GUIDED_FIELDS))


def _sampling_fields(body: Any, max_tokens_names: tuple[str, ...], honoured: frozenset[str],
                     echo: bool = False) -> dict[str, Any]:
    """The fields both endpoints share; `echo`: the endpoint takes echo (and then max_tokens 0 with it)."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object", code="invalid_json")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError("'model' is required and must be a string naming the model (see GET /v1/models)",
                       param="model", code="invalid_type" if model is not None else "missing_required_parameter")
    ignored = _check_fields(body, honoured)
    _unsupported(body, echo)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise type_error("user", "a string", user)
    max_tokens = None
    for name in max_tokens_names:
        max_tokens = int_field(body, name, max_tokens, low=0 if echo else 1)
    if max_tokens == 0 and not bool_field(body, "echo", False):
        raise APIError("'max_tokens' 0 returns only the prompt, so it needs 'echo': true; otherwise give 1 or more",
                       param="max_tokens", code="invalid_value")
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise type_error("stream_options", "an object", stream_options)
    stream = bool_field(body, "stream", False)
    prompt_logprobs = int_field(body, "prompt_logprobs", None, low=0, high=MAX_PROMPT_LOGPROBS)
    if prompt_logprobs is not None and stream:
        raise APIError("'prompt_logprobs' is returned in whole responses only; set 'stream' to false (or use 'echo' "
                       "with 'logprobs' on completions)", param="prompt_logprobs", code="unsupported_parameter")
    stop_token_ids = body.get("stop_token_ids")
    return dict(
        model=model, max_tokens=max_tokens,
        temperature=float_field(body, "temperature", 1.0, 0.0, 2.0),
        top_p=float_field(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        top_k=max(int_field(body, "top_k", 0, low=-1), 0),      # -1 also means off, as in vLLM
        min_p=float_field(body, "min_p", 0.0, 0.0, 1.0),
        presence_penalty=float_field(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=float_field(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=float_field(body, "repetition_penalty", 1.0, 0.0, 10.0, low_open=True),
        min_tokens=int_field(body, "min_tokens", 0, low=0),
        logit_bias=_logit_bias(body),
        n=int_field(body, "n", 1, low=1, high=MAX_N),
        seed=int_field(body, "seed", None),
        stop=_stop(body),
        stop_token_ids=int_list(stop_token_ids, "stop_token_ids") if stop_token_ids is not None else [],
        ignore_eos=bool_field(body, "ignore_eos", False),
        prompt_logprobs=prompt_logprobs,
        include_stop_str_in_output=bool_field(body, "include_stop_str_in_output", False),
        stream=stream,
        include_usage=stream and bool_field(stream_options or {}, "include_usage", False),
        structured_outputs=_structured_outputs(body),
        given=frozenset(name for name, value in body.items() if value is not None),
        ignored=ignored,
    )


# ---- the two request kinds -----------------------------------------------------------------------
def parse_completion(body: Any) -> CompletionRequest:
    common = _sampling_fields(body, ("max_tokens",), COMPLETION_FIELDS, echo=True)
    prompt = body.get("prompt", MISSING)
    if prompt is MISSING or prompt is None:
        raise APIError("'prompt' is required", param="prompt", code="missing_required_parameter")
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompts = [list(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompts = [int_list(p, "prompt") for p in prompt]
    else:
        raise type_error("prompt", "a string, a list of strings, a list of token ids or a list of such lists",
                          prompt)
    if any(len(p) == 0 for p in prompts):
        raise APIError("'prompt' is empty; give at least one character or token", param="prompt",
                       code="invalid_value")
    if common["max_tokens"] is None:
        common["max_tokens"] = 16                          # the OpenAI completions default
    logprobs = int_field(body, "logprobs", None, low=0, high=MAX_COMPLETION_LOGPROBS)
    return CompletionRequest(**common, logprobs=logprobs, prompts=prompts, echo=bool_field(body, "echo", False))


def _message_content(value: Any, index: int) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, list):
        parts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(f"messages[{index}].content: only text parts ({{'type': 'text', 'text': ...}}) are "
                               f"supported", param=f"messages[{index}].content", code="invalid_value")
            parts.append(part["text"])
        return "".join(parts)
    raise type_error(f"messages[{index}].content", "a string or a list of text parts", value)


def _tool_calls(value: Any, index: int) -> list[dict[str, Any]]:
    name = f"messages[{index}].tool_calls"
    if value is None:
        return []
    if not isinstance(value, list):
        raise type_error(name, "a list of tool calls", value)
    calls = []
    for position, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise APIError(f"{name}[{position}] must be {{'id', 'type': 'function', 'function': {{'name', "
                           f"'arguments'}}}}", param=name, code="invalid_value")
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append({"id": call.get("id"), "type": "function",
                      "function": {"name": function["name"], "arguments": arguments}})
    return calls


def _optional_str(message: dict, key: str, index: int) -> str | None:
    value = message.get(key)
    if value is not None and not isinstance(value, str):
        raise type_error(f"messages[{index}].{key}", "a string", value)
    return value


def _tools(body: dict) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise type_error("tools", "a list of {'type': 'function', 'function': {...}} objects", tools)
    for position, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(
                function, dict) or not isinstance(function.get("name"), str):
            raise APIError(f"tools[{position}] must be {{'type': 'function', 'function': {{'name', ...}}}}",
                           param="tools", code="invalid_value")
    return tools or None


def _tool_choice(body: dict) -> str | dict[str, Any] | None:
    choice = body.get("tool_choice")
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    function = choice.get("function") if isinstance(choice, dict) else None
    if isinstance(function, dict) and choice.get("type", "function") == "function" and isinstance(
            function.get("name"), str) and function["name"]:
        return {"type": "function", "function": {"name": function["name"]}}
    raise APIError(f"'tool_choice' must be \"auto\", \"none\", \"required\" or {{\"type\": \"function\", "
                   f"\"function\": {{\"name\": ...}}}}, got {choice!r:.60}", param="tool_choice",
                   code="invalid_value")


def _response_format(body: dict) -> dict[str, Any] | None:
    value = body.get("response_format")
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise APIError("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                       "{\"type\": \"json_schema\", ...}", param="response_format", code="invalid_value")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            raise APIError("'response_format' of type json_schema needs \"json_schema\": {\"name\": ..., "
                           "\"schema\": {...}}", param="response_format", code="invalid_value")
    return value


def _thinking(body: dict) -> tuple[bool | None, str | None, dict[str, Any]]:
    """(thinking on/off or None for the model's default, effort, chat_template_kwargs)."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise type_error("chat_template_kwargs", "an object", kwargs)
    thinking = None
    for key in ("thinking", "enable_thinking"):
        if kwargs.get(key) is not None:
            if not isinstance(kwargs[key], bool):
                raise type_error(f"chat_template_kwargs.{key}", "a boolean", kwargs[key])
            thinking = kwargs[key]
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise APIError(f"'reasoning_effort' {effort!r:.40} is not supported; choose low, high, max, or none for "
                           "no thinking", param="reasoning_effort", code="invalid_value")
        if effort == "none":
            thinking, effort = False, None
        elif thinking is None:
            thinking = True
    return thinking, effort, kwargs


def parse_chat(body: Any) -> ChatRequest:
    common = _sampling_fields(body, ("max_tokens", "max_completion_tokens"), CHAT_FIELDS)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise APIError("'messages' is required and must be a non-empty list of {role, content} objects",
                       param="messages", code="invalid_type" if raw is not None else "missing_required_parameter")
    messages = []
    for index, message in enumerate(raw):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise APIError(f"messages[{index}] must be an object with a string 'role'", param=f"messages[{index}]",
                           code="invalid_type")
        if message["role"] not in ("system", "developer", "user", "assistant", "tool"):
            raise APIError(f"messages[{index}].role {message['role']!r} is unknown; use system, developer, user, "
                           "assistant or tool", param=f"messages[{index}].role", code="invalid_value")
        messages.append(ChatMessage(
            message["role"], _message_content(message.get("content"), index),
            name=_optional_str(message, "name", index),
            tool_calls=_tool_calls(message.get("tool_calls"), index) if message["role"] == "assistant" else [],
            tool_call_id=_optional_str(message, "tool_call_id", index),
            reasoning_content=_optional_str(message, "reasoning_content", index)))
    want_logprobs = bool_field(body, "logprobs", False)
    top_logprobs = int_field(body, "top_logprobs", None, low=0, high=MAX_TOP_LOGPROBS)
    if top_logprobs is not None and not want_logprobs:
        raise APIError("'top_logprobs' needs 'logprobs': true", param="top_logprobs", code="invalid_value")
    thinking, effort, kwargs = _thinking(body)
    return ChatRequest(**common, logprobs=(top_logprobs or 0) if want_logprobs else None, messages=messages,
                       tools=_tools(body), tool_choice=_tool_choice(body), thinking=thinking,
                       parallel_tool_calls=bool_field(body, "parallel_tool_calls", True),
                       thinking_effort=effort, response_format=_response_format(body), template_kwargs=kwargs)
