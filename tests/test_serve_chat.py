"""Chat wiring of the server for a published-layout K3 tokenizer, against a scripted engine.

The engine is replaced by one that records what it was asked to run and answers with a scripted K3 output, so
that the prompt ids (rendered in the HTTP process), the sampling parameters and the parsing of reasoning and tool
calls are checked exactly, without a model. tests/test_serve_chat_checkpoint.py runs the real engine.
"""
from __future__ import annotations

import json
import threading

import openai
import pytest
from fastapi.testclient import TestClient

from k3core.chat import render_messages
from k3core.config import ModelConfig
from k3core.model.tokenizer_writer import prefix_ranks, write_kimi_tokenizer
from k3core.serve.app import create_app
from k3core.serve.args import ServerArgs
from k3core.serve.engine_thread import EngineEvent, ModelInfo
from k3core.serve.metrics import ServerMetrics
from k3core.stop import IncrementalDetokenizer
from k3core.tokenizer import load_tokenizer

CONTEXT = 4096
DEFAULT_CAP = 1000
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"]}}}]
TOOL_REPLY = ("Need the weather.<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|>"
              '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
              '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
              '<|open|>argument key="days" type="number"<|sep|>2<|close|>argument<|sep|>'
              "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>")
ANSWER_REPLY = ("The tool returned the weather.<|close|>think<|sep|><|open|>response<|sep|>It is 18 °C and "
                "sunny.<|close|>response<|sep|><|close|>message<|sep|>")


class ScriptedEngine:
    """EngineThread's public surface; every request is answered with `reply`, one token per event."""

    def __init__(self, info: ModelInfo):
        self.info, self.error, self.ready = info, None, threading.Event()
        self.ready.set()
        self.reply = ANSWER_REPLY
        self.submitted: list[tuple[list[int], object]] = []

    def submit(self, request_id, prompt_token_ids, params, sink, arrival, observe=True):
        self.submitted.append((list(prompt_token_ids), params))
        tokenizer = self.info.tokenizer
        ids = tokenizer.encode_with_specials(self.reply) + [tokenizer.eos_token_ids[0]]
        detokenizer = IncrementalDetokenizer(tokenizer)       # the text the real engine hands out
        for position, token_id in enumerate(ids):
            last = position == len(ids) - 1
            text = detokenizer.push([token_id]) + (detokenizer.finish() if last else "")
            sink(EngineEvent([token_id], [], last, "stop" if last else None, new_text=text))

    def abort(self, request_id):
        pass


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    directory = tmp_path_factory.mktemp("k3")
    ranks = prefix_ranks(["Paris", "weather", "message", " role"])
    specials = write_kimi_tokenizer(directory, ranks)
    (directory / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95,
                                                                  "eos_token_id": specials["<|end_of_msg|>"]}))
    base = ModelConfig.preset("k3-tiny")
    config = base.replace(vocab_size=len(ranks) + 256, eos_token_id=specials["<|end_of_msg|>"],
                          extra={**base.extra, "hf_model_type": "kimi_k3"})
    tokenizer = load_tokenizer(directory, config)
    info = ModelInfo(tokenizer, CONTEXT, config.vocab_size, False, 16, 1024, 1024, 1024 * (CONTEXT // 16 + 8), True)
    engine = ScriptedEngine(info)
    args = ServerArgs(model=str(directory), served_model_name="k3", default_max_tokens=DEFAULT_CAP)
    app = create_app(args, engine, ServerMetrics("k3"))
    http = TestClient(app, base_url="http://testserver")
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
    return engine, tokenizer, http, client


MESSAGES = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Weather in Paris?"}]


def test_chat_with_tools_runs_the_xtml_prompt_and_returns_tool_calls(served):
    engine, tokenizer, _, client = served
    engine.reply = TOOL_REPLY
    out = client.chat.completions.create(model="k3", messages=MESSAGES, tools=TOOLS, max_tokens=200)
    prompt, params = engine.submitted[-1]
    assert prompt == render_messages(tokenizer, MESSAGES, tools=TOOLS, thinking=True, thinking_effort="max")
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == "Need the weather." and choice.message.content == ""
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    assert (params.temperature, params.top_p) == (0.6, 0.95)          # generation_config.json defaults
    assert params.max_tokens == 200


def test_tool_results_and_history_render_into_the_prompt(served):
    engine, tokenizer, _, client = served
    engine.reply = ANSWER_REPLY
    history = MESSAGES + [
        {"role": "assistant", "content": None, "reasoning_content": "Need the weather.", "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "18°C, sunny"}]
    out = client.chat.completions.create(model="k3", messages=history, tools=TOOLS, temperature=0.2,
                                         reasoning_effort="low")
    prompt, params = engine.submitted[-1]
    assert prompt == render_messages(tokenizer, history, tools=TOOLS, thinking=True, thinking_effort="low")
    assert 'role="tool" tool="get_weather" index="1"<|sep|>18°C, sunny' in tokenizer.decode(prompt)
    assert out.choices[0].message.content == "It is 18 °C and sunny."
    assert out.choices[0].finish_reason == "stop"
    assert params.temperature == 0.2 and params.top_p == 0.95
    assert params.max_tokens == min(DEFAULT_CAP, CONTEXT - len(prompt))     # no max_tokens: room to think


def test_streaming_carries_reasoning_content_and_tool_call_deltas(served):
    engine, _, _, client = served
    engine.reply = TOOL_REPLY
    reasoning, content, calls, finish = "", "", [], None
    for chunk in client.chat.completions.create(model="k3", messages=MESSAGES, tools=TOOLS, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
        assert "<|" not in (getattr(delta, "reasoning_content", None) or "") + (delta.content or "")
    assert reasoning == "Need the weather." and content == "" and finish == "tool_calls"
    assert [(c.index, c.function.name) for c in calls] == [(0, "get_weather")]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "days": 2} and calls[0].id


def test_thinking_off_by_kwargs_or_effort_none(served):
    engine, tokenizer, _, client = served
    engine.reply = "Plain.<|close|>response<|sep|><|close|>message<|sep|>"
    for extra in ({"extra_body": {"chat_template_kwargs": {"thinking": False}}},
                  {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}},
                  {"reasoning_effort": "none"}):
        out = client.chat.completions.create(model="k3", messages=MESSAGES, max_tokens=50, **extra)
        assert engine.submitted[-1][0] == render_messages(tokenizer, MESSAGES, thinking=False)
        assert out.choices[0].message.content == "Plain."
        assert getattr(out.choices[0].message, "reasoning_content", None) is None


def test_refused_fields_and_enforced_formats(served):
    """json_schema / json_object / a named tool_choice are enforced now: the engine gets the K3 reply grammar
    (compiled in the HTTP process first) and the prompt keeps its XTML notes; no "unenforced" header any more."""
    engine, tokenizer, http, client = served
    for body, param in (({"reasoning_effort": "medium"}, "reasoning_effort"),
                        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS},
                         "tool_choice"),
                        ({"tool_choice": "required"}, "tool_choice"),
                        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                            "type": "object", "properties": {"a": {"type": "nonsense"}}}}}}, "response_format")):
        response = http.post("/v1/chat/completions", json={"model": "k3", "messages": MESSAGES, **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, body
    engine.reply = 'x<|close|>think<|sep|><|open|>response<|sep|>{"a": 1}<|close|>response<|sep|>'
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    for response_format in ({"type": "json_object"}, schema):
        response = http.post("/v1/chat/completions", json={"model": "k3", "messages": MESSAGES, "max_tokens": 20,
                                                           "response_format": response_format})
        assert response.status_code == 200 and "x-k3core-unenforced" not in response.headers
        prompt, params = engine.submitted[-1]
        assert prompt == render_messages(tokenizer, MESSAGES, response_format=response_format)
        assert params.structured.kind == "structural_tag" and params.structured.field == "response_format"
    named = {"type": "function", "function": {"name": "get_weather"}}
    response = http.post("/v1/chat/completions", json={"model": "k3", "messages": MESSAGES, "max_tokens": 20,
                                                       "tools": TOOLS, "tool_choice": named})
    assert response.status_code == 200 and engine.submitted[-1][1].structured.field == "tool_choice"
    assert 'call tool=\\"get_weather\\"' in engine.submitted[-1][1].structured.value


def test_tokenizer_routes(served):
    engine, tokenizer, http, _ = served
    body = {"model": "k3", "messages": MESSAGES, "tools": TOOLS, "chat_template_kwargs": {"thinking": False}}
    tokens = http.post("/tokenize", json=body).json()
    assert tokens["tokens"] == render_messages(tokenizer, MESSAGES, tools=TOOLS, thinking=False)
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == CONTEXT
    no_prompt = http.post("/tokenize", json={**body, "add_generation_prompt": False}).json()["tokens"]
    assert tokens["tokens"][:len(no_prompt)] == no_prompt and len(no_prompt) < len(tokens["tokens"])
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|end_of_msg|>" and info["bos_token"] == "[BOS]"
    assert info["chat_format"] == "xtml" and info["model_max_length"] == CONTEXT
    # what lm-eval's remote tokenizer does: the eos id is /tokenize of the eos token's spelling
    eos = http.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert eos == [tokenizer.eos_token_ids[0]] == [info["eos_token_id"]]
    text = "Weather in Paris, 18 °C"
    ids = http.post("/tokenize", json={"prompt": text}).json()["tokens"]
    assert ids == tokenizer.encode(text)
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": text}
    assert http.post("/detokenize", json={"tokens": [10 ** 9]}).status_code == 400
    assert http.post("/tokenize", json={"model": "other", "prompt": "x"}).status_code == 404
