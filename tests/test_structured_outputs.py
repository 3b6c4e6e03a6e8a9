"""Structured outputs on the trained demo model (k3-demo, a tiny model: the grammar does the work).

Every output of every constraint kind parses and validates, greedy and at temperature 1.0 with several seeds; a
batch that mixes constrained and unconstrained requests gives the unconstrained ones the tokens they get alone,
and a batch without constraints builds no mask and keeps its overlap; the server path runs through the `openai`
client (`beta.chat.completions.parse` with a pydantic model, json_schema strict, tool_choice required / named on
K3's XTML format) and refuses what does not compile with a 400 naming the field. The server tests come last in
this file: they drive the same LLM from an engine thread.
"""
from __future__ import annotations

import functools
import json
import re
from typing import Literal

import msgspec
import openai
import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel, Field

from k3core.chat import parse_k3_output
from k3core.chat.k3_grammar import NO_CONTENT, json_content, k3_reply_tag
from k3core.llm import LLM
from k3core.sampling_params import SamplingParams
from k3core.serve.app import create_app
from k3core.serve.args import ServerArgs
from k3core.serve.engine_thread import EngineThread
from k3core.serve.metrics import ServerMetrics
from k3core.structured import StructuredError, StructuredSpec
from k3core.structured.compiler import GrammarCache, compile_spec

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    "pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer",
                                                                                      "minimum": 0, "maximum": 4}},
            "required": ["kind", "legs"], "additionalProperties": False}},
    "required": ["name", "age", "tags", "pet"], "additionalProperties": False}
REGEX = r"[a-z]{2,4}-[0-9]{2}"
CHOICES = ["yes", "no", "maybe later"]
GRAMMAR = 'root ::= "(" expr ")"\nexpr ::= num | num op expr\nop ::= "+" | "*"\nnum ::= [1-9]'
EBNF_SHAPE = re.compile(r"\(([1-9][+*])*[1-9]\)")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}}]


def validate(value, schema, path="$") -> None:
    """A small JSON-schema check (the keywords these tests use); AssertionError names the failing path."""
    if "enum" in schema:
        assert value in schema["enum"], f"{path}: {value!r} not in {schema['enum']}"
    kind = schema.get("type")
    if kind == "object":
        assert isinstance(value, dict), f"{path}: {value!r} is not an object"
        properties = schema.get("properties", {})
        for key in schema.get("required", []):
            assert key in value, f"{path}: missing {key!r}"
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(properties), f"{path}: extra keys {set(value) - set(properties)}"
        for key, item in value.items():
            if key in properties:
                validate(item, properties[key], f"{path}.{key}")
    elif kind == "array":
        assert isinstance(value, list) and len(value) <= schema.get("maxItems", len(value)), f"{path}: {value!r}"
        for index, item in enumerate(value):
            validate(item, schema.get("items", {}), f"{path}[{index}]")
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), f"{path}: {value!r} is not an integer"
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value), f"{path}: {value} out of range"
    elif kind == "string":
        assert isinstance(value, str) and len(value) <= schema.get("maxLength", len(value)), f"{path}: {value!r}"
    elif kind == "boolean":
        assert isinstance(value, bool), f"{path}: {value!r} is not a boolean"


def check_output(kind: str, text: str) -> None:
    if kind == "json_schema":
        validate(json.loads(text), PERSON)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        assert EBNF_SHAPE.fullmatch(text), text


SPECS = {"json_schema": StructuredSpec("json_schema", json.dumps(PERSON)), "json_object": StructuredSpec(
    "json_object"), "regex": StructuredSpec("regex", REGEX), "choice": StructuredSpec("choice", json.dumps(CHOICES)),
    "grammar": StructuredSpec("grammar", GRAMMAR)}


DEMO = dict(backend="torch", device="cpu", dtype="float32", page_size=4, checkpoint_interval=8,
            expert_format="bf16")          # experts unpacked once at load: a CPU step is ~9x cheaper than MXFP4


@pytest.fixture(scope="module")
def llm():
    return LLM("k3-demo", **DEMO)


def test_every_output_matches_its_constraint_greedy_and_sampled(llm):
    """Five kinds x (greedy, temperature 1.0 with two seeds), one batch; every output ends by the grammar."""
    cases = [(kind, temperature, seed) for kind in SPECS for temperature, seed in ((0.0, None), (1.0, 0), (1.0, 1))]
    params = [SamplingParams(max_tokens=96, temperature=temperature, seed=seed, structured=SPECS[kind])
              for kind, temperature, seed in cases]
    outputs = llm.generate(["Return a record as JSON: "] * len(cases), params)
    for (kind, temperature, seed), out in zip(cases, outputs):
        assert out.finish_reason == "stop", (kind, temperature, seed, out.text)
        assert out.token_ids[-1] in llm.engine.eos_token_ids          # the grammar ended, then its stop token
        check_output(kind, out.text)
    assert llm.engine.constraints is not None and len(llm.engine.constraints) == 0      # every matcher freed


def test_unconstrained_rows_are_untouched_and_pay_nothing(llm, monkeypatch):
    engine = llm.engine
    grammars = []
    sample = engine.sampler.sample
    monkeypatch.setattr(engine.sampler, "sample", lambda logits, rows, grammar=None: (
        grammars.append((len(rows), grammar)), sample(logits, rows, grammar))[1])
    prompts = ["def main():", "import os\n"]
    plain = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True) for _ in prompts]
    masks, resolved = engine.constraints.num_masks, engine.num_resolved_steps
    alone = [out.token_ids for out in llm.generate(prompts, plain)]
    assert grammars and all(g is None for _, g in grammars)       # no mask built, no mask applied
    assert engine.constraints.num_masks == masks and engine.num_resolved_steps == resolved   # overlap kept
    grammars.clear()
    mixed = llm.generate(prompts + ["x = "] * 2, plain + [
        SamplingParams(max_tokens=40, temperature=0.0, structured=SPECS["regex"]),
        SamplingParams(max_tokens=40, temperature=1.0, seed=3, structured=SPECS["choice"])])
    assert [out.token_ids for out in mixed[:2]] == alone            # greedy tokens identical with masked neighbours
    check_output("regex", mixed[2].text)
    check_output("choice", mixed[3].text)
    # the mask covered only the constrained rows of steps that also sampled the unconstrained ones
    assert any(g is not None and g.bitmask.shape[0] == len(g.rows) < num_rows for num_rows, g in grammars)
    assert engine.num_resolved_steps > resolved


def test_sampler_masks_exactly_the_grammar_rows_as_xgrammar_does():
    """The sampler's device unpacking of a bitmask equals xgrammar's own apply_token_bitmask_inplace (random bits,
    a vocabulary that is not a multiple of 32), on the masked rows only; the other rows are untouched."""
    import torch
    import xgrammar

    from k3core.sampler import SampleRow, Sampler
    from k3core.structured.matchers import GrammarMask
    vocab, num_rows = 203, 4
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(num_rows, vocab, generator=generator)
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (2, -(-vocab // 32)), dtype=torch.int32, generator=generator)
    sampler = Sampler(vocab, "cpu", set())
    rows = []
    for index in range(num_rows):
        sampler.add_request(f"r{index}", SamplingParams(temperature=0.0), [1])
        rows.append(SampleRow(f"r{index}", SamplingParams(temperature=0.0), [], [1]))
    masked = sampler.processed_logits(logits, rows, GrammarMask([1, 3], bitmask))
    expected, full = logits.clone(), torch.zeros(num_rows, bitmask.shape[1], dtype=torch.int32)
    full[[1, 3]] = bitmask                                  # xgrammar's indices select rows of both tensors
    xgrammar.apply_token_bitmask_inplace(expected, full, indices=[1, 3])
    assert torch.equal(masked, expected)
    assert torch.equal(masked[[0, 2]], logits[[0, 2]]) and torch.isinf(masked[[1, 3]]).any()


def test_invalid_specs_name_their_field_and_compiles_are_cached(llm):
    tokenizer, vocab_size, eos = llm.tokenizer, llm.config.vocab_size, llm.engine.eos_token_ids
    for spec in (StructuredSpec("regex", "([a-z", "structured_outputs.regex"),
                 StructuredSpec("grammar", "root ::= (", "structured_outputs.grammar"),
                 StructuredSpec("json_schema", '{"type": "nonsense"}', "response_format"),
                 StructuredSpec("json_schema", "[1, 2]", "response_format"),
                 StructuredSpec("choice", "[]", "structured_outputs.choice")):
        with pytest.raises(StructuredError) as caught:
            compile_spec(tokenizer, vocab_size, eos, spec)
        assert caught.value.field == spec.field and spec.field in str(caught.value)
    cache = GrammarCache(tokenizer, vocab_size, tuple(eos), capacity=2)
    for pattern in ("a+", "b+", "a+", "c+", "a+"):
        cache.compile(StructuredSpec("regex", pattern))
    assert cache.num_compiles == 3 and len(cache) == 2           # a+ stayed recent; b+ was dropped, never reused
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured=SPECS["regex"])
    # the engine process receives SamplingParams as msgpack: the spec crosses intact
    params = SamplingParams(max_tokens=5, structured=SPECS["json_schema"])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams) == params


def test_k3_reply_grammar_keeps_reasoning_free(llm):
    """Thinking on: any reasoning (here JSON-looking text too) before `<|close|>think<|sep|>`, then the schema."""
    import xgrammar
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    spec = StructuredSpec("structural_tag", k3_reply_tag(True, json_content(schema)))
    compiled = compile_spec(llm.tokenizer, llm.config.vocab_size, llm.engine.eos_token_ids, spec)
    tail = "<|close|>response<|sep|><|close|>message<|sep|>"
    for text, ok in (('I think {"b": x}!<|close|>think<|sep|><|open|>response<|sep|>{"a": 3}' + tail, True),
                     ('{"a": 3}' + tail, False),                                # the reasoning never closed
                     ('ok<|close|>think<|sep|><|open|>response<|sep|>{"b": 3}' + tail, False)):
        matcher = xgrammar.GrammarMatcher(compiled)
        accepted = matcher.accept_string(text) and matcher.is_completed()
        assert accepted == ok, text
    # tool arguments: string values are raw text for the parser, so no blank may pad an enum value
    spec = StructuredSpec("structural_tag", k3_reply_tag(False, NO_CONTENT, TOOLS[1:], "required", True))
    compiled = compile_spec(llm.tokenizer, llm.config.vocab_size, llm.engine.eos_token_ids, spec)
    for value, ok in (("UTC", True), (" UTC", False), ("UTC\n", False), ("GMT", False)):
        reply = ('<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="get_time" index="1"<|sep|>'
                 f'<|open|>argument key="zone" type="string"<|sep|>{value}<|close|>argument<|sep|><|close|>call<|sep|>'
                 "<|close|>tools<|sep|><|close|>message<|sep|>")
        matcher = xgrammar.GrammarMatcher(compiled)
        assert (matcher.accept_string(reply) and matcher.is_completed()) == ok, value
        if ok:
            (call,) = parse_k3_output(reply, thinking=False).tool_calls
            assert json.loads(call.arguments) == {"zone": value}


def _tp_rank_main(rank: int, plan, device):
    llm = LLM("k3-demo", **{**DEMO, "device": str(device)}, plan=plan, rank=rank, memory_bytes=64 << 20)
    outputs = llm.generate(TP_PROMPTS, TP_PARAMS)
    return [(out.token_ids, out.finish_reason) for out in outputs], llm.engine.constraints.num_masks


TP_PROMPTS = ["Answer: ", "x = "]
TP_PARAMS = [SamplingParams(max_tokens=16, temperature=0.0, structured=SPECS["choice"]),
             SamplingParams(max_tokens=16, temperature=0.0, structured=SPECS["regex"])]


def test_tp2_ranks_apply_the_same_constraint(llm):
    """Under tp=2 (gloo) the sampler rank masks and every rank's matchers accept the broadcast tokens: both ranks
    finish each request at the same token, with the single process's greedy output."""
    from k3core.parallel.launch import spawn
    from k3core.parallel.plan import ParallelPlan
    single = [(out.token_ids, out.finish_reason) for out in llm.generate(TP_PROMPTS, TP_PARAMS)]
    results = spawn(_tp_rank_main, ParallelPlan(tp=2))
    for rank, (outputs, num_masks) in enumerate(results):
        assert outputs == single, f"rank {rank}"
    assert [num_masks > 0 for _, num_masks in results] == [True, False]     # rank 0 samples; rank 1 only accepts


# ---- the server (an engine thread on the same LLM: these tests must stay last) -----------------------------------
class Weather(BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    days: int = Field(ge=1, le=9)
    sunny: bool


@pytest.fixture(scope="module")
def client(llm):
    args = ServerArgs(model="k3-demo", served_model_name="k3-demo", default_max_tokens=64)
    metrics = ServerMetrics("k3-demo")
    engine = EngineThread(functools.partial(lambda model: model, llm), metrics)
    engine.start()
    assert engine.ready.wait(120) and engine.error is None, engine.error
    http = TestClient(create_app(args, engine, metrics), base_url="http://testserver")
    yield openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
    engine.stop()


NO_THINKING = {"chat_template_kwargs": {"thinking": False}}
ASK = [{"role": "user", "content": "Weather in Paris for 3 days?"}]


def test_openai_parse_with_a_pydantic_model(client):
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    for temperature, seed in ((0.0, None), (1.0, 7)):
        out = parse(model="k3-demo", messages=ASK, response_format=Weather, max_tokens=64, temperature=temperature,
                    seed=seed, extra_body=NO_THINKING)
        choice = out.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Weather), choice.message.content
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                               "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    out = client.chat.completions.create(model="k3-demo", messages=ASK, max_tokens=48, temperature=1.0, seed=2,
                                         n=2, extra_body=NO_THINKING, response_format={"type": "json_schema",
                                         "json_schema": {"name": "answer", "schema": schema, "strict": True}})
    for choice in out.choices:
        validate(json.loads(choice.message.content), schema)
    text = client.completions.create(model="k3-demo", prompt="Code: ", max_tokens=24, temperature=1.0, seed=1,
                                     extra_body={"structured_outputs": {"regex": REGEX}}).choices[0].text
    check_output("regex", text)


def test_tool_choice_required_and_named_give_valid_calls(client):
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    # the tiny model spells the grammar's fixed text in short tokens: a call takes ~150 tokens
    for choice, temperature, n in (("required", 0.0, 1), ({"type": "function", "function": {"name": "get_time"}},
                                                          1.0, 2)):
        out = client.chat.completions.create(model="k3-demo", messages=ASK, tools=TOOLS, tool_choice=choice,
                                             max_tokens=400, temperature=temperature, seed=5, n=n,
                                             parallel_tool_calls=False, extra_body=NO_THINKING)
        assert len(out.choices) == n
        for result in out.choices:
            message = result.message
            assert result.finish_reason == "tool_calls" and message.tool_calls and not message.content, message
            assert len(message.tool_calls) == 1
            if isinstance(choice, dict):
                assert message.tool_calls[0].function.name == "get_time"
            call = message.tool_calls[0].function
            validate(json.loads(call.arguments), schemas[call.name])


def test_server_refuses_what_does_not_compile(client):
    bad = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}}, "response_format"),
           ({"extra_body": {"structured_outputs": {"regex": "([a-z"}}}, "structured_outputs.regex"),
           ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "structured_outputs"),
           ({"extra_body": {"guided_json": {"type": "object"}}}, "guided_json"),
           ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice")]
    for body, param in bad:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="k3-demo", messages=ASK, max_tokens=4, **body)
        assert caught.value.body["param"] == param, body
