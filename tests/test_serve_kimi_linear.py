"""A Kimi-Linear-layout directory, written by the test, served by the real server and driven with `openai`.

The directory holds what Moonshot ships for Kimi-Linear-48B-A3B-Instruct, at tiny sizes: a flat config.json
(`model_type: kimi_linear`, the release's field names: `linear_attn_config` with 1-based layer lists, the MoE and
grouped-routing fields, the misleading top-level `head_dim`, `auto_map`), bf16 safetensors under the release's
tensor names (`block_sparse_moe.*`, per-expert `experts.{e}.w{1,2,3}.weight`, `A_log` as [1, 1, H, 1]),
`tiktoken.model` + `tokenizer_config.json` with the K2 specials in `added_tokens_decoder` and a K2-style jinja
`chat_template`, `generation_config.json`, and `tokenization_kimi.py` / `configuration_kimi.py` / `modeling_kimi.py`
that would leave a marker file if anything ran them.

The template is this test's own, with the structure of the K2 template Kimi-Linear ships (../shared/
K3_CHAT_FORMAT.md section 2): a `tool_declare` system turn with the tools, a default system turn when the chat has
none, `<|im_user|>` / `<|im_assistant|>` / `<|im_system|>` headers closed by `<|im_middle|>`, assistant tool calls
in a `<|tool_calls_section_begin|>` section, tool results as `## Return of ID`, `<|im_end|>` after each turn.

The prompt the server runs is checked against an independent rendering: transformers' own chat-template renderer
and a `tiktoken` Encoding built here from the files. The weights are random, so the output checks are on the path
(the reply equals the K2 parser's reading of the raw greedy text, whole and streamed); a scripted engine then
answers with a K2 tool call to check what the client gets back.
"""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import openai
import pytest
import torch
from fastapi.testclient import TestClient

from k3core.chat import parse_k2_output
from k3core.config import ModelConfig, load_config
from k3core.model.tokenizer_writer import K2_SPECIAL_OFFSETS, prefix_ranks, write_kimi_tokenizer
from k3core.model.weights import init_random_weights
from k3core.serve.args import ServerArgs
from k3core.serve.launch import build_server
from k3core.tokenizer import KIMI_PAT_STR, load_tokenizer

CONTEXT = 2048
SERVED = "kimi-linear"
KIMI_LINEAR_TEMPLATE = (
    "{%- macro text(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content -%}{%- for part in content -%}{%- if part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- set role = message['role'] -%}"
    "{%- if loop.first and role != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>"
    "{%- endif -%}"
    "{%- if role == 'user' -%}<|im_user|>{%- elif role == 'assistant' -%}<|im_assistant|>"
    "{%- else -%}<|im_system|>{%- endif -%}"
    "{{ message['name'] or role }}<|im_middle|>"
    "{%- if role == 'assistant' and message['tool_calls'] -%}"
    "{{ text(message['content']) }}<|tool_calls_section_begin|>"
    "{%- for call in message['tool_calls'] -%}"
    "<|tool_call_begin|>{{ call['id'] }}<|tool_call_argument_begin|>"
    "{%- if call['function']['arguments'] is string -%}{{ call['function']['arguments'] }}"
    "{%- else -%}{{ call['function']['arguments'] | tojson }}{%- endif -%}"
    "<|tool_call_end|>"
    "{%- endfor -%}"
    "<|tool_calls_section_end|>"
    "{%- elif role == 'tool' -%}"
    "## Return of {{ message['tool_call_id'] }}\n{{ text(message['content']) }}"
    "{%- else -%}{{ text(message['content']) }}{%- endif -%}"
    "<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {
                                               "type": "string"}}, "required": ["city"]}}}]
CHAT = [{"role": "user", "content": "Weather in Paris?"}]
HISTORY = [
    {"role": "system", "content": "You are Kimi."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                                                           "function": {"name": "get_weather",
                                                                        "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "18°C, sunny"},
    {"role": "assistant", "content": "It is 18°C and sunny."},
    {"role": "user", "content": [{"type": "text", "text": "And "}, {"type": "text", "text": "tomorrow?"}]}]


def kimi_linear_config(vocab_size: int, specials: dict[str, int]) -> dict:
    """config.json as the Kimi-Linear-48B-A3B-Instruct release writes it (its field names and fixed values), with
    tiny sizes: 4 layers, KDA at 1-based 1-3 and MLA at 4, layer 0 dense."""
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_kimi.KimiLinearConfig",
                     "AutoModel": "modeling_kimi.KimiLinearModel",
                     "AutoModelForCausalLM": "modeling_kimi.KimiLinearForCausalLM"},
        "model_type": "kimi_linear", "dtype": "bfloat16", "transformers_version": "4.56.2",
        "vocab_size": vocab_size, "bos_token_id": specials["[BOS]"], "eos_token_id": specials["<|im_end|>"],
        "pad_token_id": specials["[PAD]"], "hidden_size": 64, "num_hidden_layers": 4, "hidden_act": "silu",
        "intermediate_size": 96, "initializer_range": 0.02, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "model_max_length": 1048576, "use_cache": True, "rope_theta": 10000.0, "rope_scaling": None,
        "head_dim": 8,            # = qk_rope_head_dim, as released: neither the KDA nor the MLA head size
        "linear_attn_config": {"full_attn_layers": [4], "kda_layers": [1, 2, 3], "head_dim": 16, "num_heads": 2,
                               "short_conv_kernel_size": 4},
        "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": None, "kv_lora_rank": 16,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "mla_use_nope": True,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_experts": 4, "num_experts_per_token": 2,
        "num_shared_experts": 1, "moe_intermediate_size": 32, "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid", "routed_scaling_factor": 2.446, "use_grouped_topk": True,
        "num_expert_group": 1, "topk_group": 1, "num_nextn_predict_layers": 0,
    }


def release_tensors(weights: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """k3core's canonical weights under the Kimi-Linear release's names and shapes (bf16; A_log and dt_bias fp32)."""
    out: dict[str, torch.Tensor] = {}
    inner = config.moe_intermediate_size
    for name, tensor in weights.items():
        parts = name.split(".")
        if name.startswith("model.layers.") and config.mlp_types[int(parts[2])] == "moe" and parts[3] == "mlp":
            parts[3] = "block_sparse_moe"
        stored = ".".join(parts)
        if name.endswith(".mlp.experts.w13"):
            for expert in range(config.num_experts):
                out[stored[:-3] + f"{expert}.w1.weight"] = tensor[expert, :inner].to(torch.bfloat16)
                out[stored[:-3] + f"{expert}.w3.weight"] = tensor[expert, inner:].to(torch.bfloat16)
        elif name.endswith(".mlp.experts.w2"):
            for expert in range(config.num_experts):
                out[stored[:-2] + f"{expert}.w2.weight"] = tensor[expert].to(torch.bfloat16)
        elif name.endswith(".self_attn.A_log"):
            out[stored] = tensor.float().reshape(1, 1, -1, 1)
        elif name.endswith(".self_attn.dt_bias"):
            out[stored] = tensor.float()
        else:
            out[stored] = tensor.to(torch.bfloat16)
    return {name: value.contiguous() for name, value in out.items()}


def write_kimi_linear(directory) -> None:
    ranks = prefix_ranks(["Paris", "weather", "Weather", "system", "user", "assistant", "tool_declare", "Return",
                          "functions", "get_weather", "city", "sunny", "helpful"])
    specials = write_kimi_tokenizer(directory, ranks, K2_SPECIAL_OFFSETS, chat_template=KIMI_LINEAR_TEMPLATE)
    settings = json.loads((directory / "tokenizer_config.json").read_text())
    settings["eos_token"] = "<|im_end|>"
    (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2, ensure_ascii=False))
    data = kimi_linear_config(len(ranks) + 256, specials)
    (directory / "config.json").write_text(json.dumps(data, indent=2))
    config = ModelConfig.from_hf(directory)
    from safetensors.torch import save_file
    save_file(release_tensors(init_random_weights(config, seed=5), config), str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    (directory / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": specials["[BOS]"], "eos_token_id": specials["<|im_end|>"], "temperature": 0.7}))
    code = f"open({str(directory / 'REMOTE_CODE_RAN')!r}, 'w').write('ran')\n"
    for name in ("tokenization_kimi.py", "configuration_kimi.py", "modeling_kimi.py"):
        (directory / name).write_text(code)


def reference_ids(directory, messages, tools=None, add_generation_prompt=True) -> list[int]:
    """The prompt ids computed without k3core's chat code: transformers renders the template, and a tiktoken
    Encoding built from the two tokenizer files encodes the text with special tokens recognised."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    from transformers.utils.chat_template_utils import render_jinja_template

    settings = json.loads((directory / "tokenizer_config.json").read_text())
    rendered, _ = render_jinja_template([messages], tools=tools, chat_template=settings["chat_template"],
                                        add_generation_prompt=add_generation_prompt)
    ranks = load_tiktoken_bpe(str(directory / "tiktoken.model"))
    specials = {entry["content"]: int(key) for key, entry in settings["added_tokens_decoder"].items()}
    encoding = tiktoken.Encoding("kimi-linear-reference", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks,
                                 special_tokens=specials)
    return encoding.encode(rendered[0], allowed_special="all")


def _wait_healthy(base: str, server) -> None:
    deadline, status = time.monotonic() + 120, None
    while time.monotonic() < deadline and status != 200:
        try:
            status = httpx.get(base + "/health", timeout=2).status_code
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    assert status == 200, f"server did not start: {server.engine.error}"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    directory = tmp_path_factory.mktemp("Kimi-Linear-48B-A3B-Instruct")
    write_kimi_linear(directory)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    args = ServerArgs(model=str(directory), served_model_name=SERVED, port=port, context_length=CONTEXT,
                      log_level="warning", memory_bytes=64 << 20, device="cpu", dtype="float32",
                      cpu_threads=torch.get_num_threads(), page_size=16, checkpoint_interval=32,
                      chunked_prefill_tokens=256)
    server = build_server(args)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    _wait_healthy(base, server)
    yield directory, base, openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)
    server.shutdown()
    thread.join(15)
    sock.close()


def _tokenize(base: str, messages, **fields) -> list[int]:
    response = httpx.post(base + "/tokenize", json={"model": SERVED, "messages": messages, **fields})
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def test_nothing_from_the_checkpoint_ran_and_the_files_were_read_as_data(served):
    directory, base, _ = served
    assert not (directory / "REMOTE_CODE_RAN").exists()
    info = httpx.get(base + "/tokenizer_info").json()
    assert info["tokenizer_class"] == "TiktokenTokenizer" and info["chat_format"] == "jinja"
    assert info["chat_template"] == KIMI_LINEAR_TEMPLATE
    assert (info["eos_token"], info["bos_token"], info["pad_token"]) == ("<|im_end|>", "[BOS]", "[PAD]")
    config = load_config(str(directory))
    assert (config.layer_types, config.mlp_types) == (("kda", "kda", "kda", "mla"), ("dense", "moe", "moe", "moe"))
    assert config.qk_nope_head_dim + config.qk_rope_head_dim == 24 and config.kda_head_dim == 16  # not head_dim 8


@pytest.mark.parametrize("messages, tools", [(CHAT, None), (CHAT, TOOLS), (HISTORY, TOOLS), (HISTORY, None)],
                         ids=["chat", "tools", "history-tools", "history"])
def test_the_prompt_is_the_template_rendered_independently(served, messages, tools):
    directory, base, _ = served
    fields = {"tools": tools} if tools else {}
    expected = reference_ids(directory, messages, tools)
    assert _tokenize(base, messages, **fields) == expected
    text = load_tokenizer(directory, load_config(str(directory))).decode(expected)
    declared = "tool_declare" in text and '[{"type": "function", "function": {"name": "get_weather"' in text
    assert declared == bool(tools)                                     # the template rendered the tools
    without = reference_ids(directory, messages, tools, add_generation_prompt=False)
    assert _tokenize(base, messages, add_generation_prompt=False, **fields) == without
    # the generation prompt is the three tokens <|im_assistant|> assistant <|im_middle|>
    assert expected[:len(without)] == without and len(expected) == len(without) + 3


def test_the_prompt_has_the_k2_specials_as_ids_and_no_bos(served):
    directory, base, _ = served
    tokenizer = load_tokenizer(directory, load_config(str(directory)))
    ids = _tokenize(base, CHAT)
    for name in ("<|im_system|>", "<|im_middle|>", "<|im_end|>", "<|im_user|>", "<|im_assistant|>"):
        assert tokenizer.special_token_id(name) in ids
    assert tokenizer.bos_token_id not in ids                                            # K2 templates add no BOS
    assert ids[-3:] == [tokenizer.special_token_id("<|im_assistant|>"), *tokenizer.encode("assistant"),
                        tokenizer.special_token_id("<|im_middle|>")]


def test_chat_streamed_chat_and_tools_run_the_rendered_prompt(served):
    directory, base, client = served
    for messages, tools in ((CHAT, None), (HISTORY, TOOLS)):
        extra = {"tools": tools} if tools else {}
        expected = reference_ids(directory, messages, tools)
        out = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=6, temperature=0, **extra)
        assert out.usage.prompt_tokens == len(expected)              # the server ran exactly this prompt
        assert out.choices[0].finish_reason in ("length", "stop", "tool_calls")
        message = out.choices[0].message
        assert getattr(message, "reasoning_content", None) is None   # Kimi-Linear-Instruct has no thinking channel
        # the reply went through the K2 parser: its fields are the parser's reading of the raw greedy text
        raw = client.completions.create(model=SERVED, prompt=expected, max_tokens=6, temperature=0).choices[0].text
        parsed = parse_k2_output(raw)
        assert message.content == parsed.content
        assert [c.function.name for c in message.tool_calls or []] == [c.name for c in parsed.tool_calls]
        content = ""
        for chunk in client.chat.completions.create(model=SERVED, messages=messages, max_tokens=6, temperature=0,
                                                    stream=True, **extra):
            if chunk.choices:
                content += chunk.choices[0].delta.content or ""
        assert content == message.content


def test_fields_the_template_cannot_express_are_refused_by_name(served):
    _, base, _ = served
    for fields, param in (({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
                          ({"response_format": {"type": "json_object"}}, "response_format"),
                          ({"reasoning_effort": "high"}, "reasoning_effort")):
        response = httpx.post(base + "/v1/chat/completions", json={"model": SERVED, "messages": CHAT, **fields})
        assert response.status_code == 400, fields
        assert response.json()["error"]["param"] == param
    # "auto" and no thinking are what the template does anyway
    ok = httpx.post(base + "/v1/chat/completions", json={"model": SERVED, "messages": CHAT, "tools": TOOLS,
                                                         "tool_choice": "auto", "reasoning_effort": "none",
                                                         "max_tokens": 1})
    assert ok.status_code == 200, ok.text


# ---- the K2 tool-call reply, from a scripted engine ---------------------------------------------------------------
TOOL_REPLY = ("Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
              '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>')


class ScriptedEngine:
    """EngineThread's public surface; every request is answered with TOOL_REPLY, one token per event."""

    def __init__(self, info):
        self.info, self.error, self.ready = info, None, threading.Event()
        self.ready.set()
        self.submitted: list[list[int]] = []

    def submit(self, request_id, prompt_token_ids, params, sink, arrival, observe=True):
        from k3core.serve.engine_thread import EngineEvent
        from k3core.stop import IncrementalDetokenizer
        self.submitted.append(list(prompt_token_ids))
        tokenizer = self.info.tokenizer
        ids = tokenizer.encode_with_specials(TOOL_REPLY) + [tokenizer.eos_token_ids[0]]
        detokenizer = IncrementalDetokenizer(tokenizer)
        for position, token_id in enumerate(ids):
            last = position == len(ids) - 1
            text = detokenizer.push([token_id]) + (detokenizer.finish() if last else "")
            sink(EngineEvent([token_id], [], last, "stop" if last else None, new_text=text))

    def abort(self, request_id):
        pass


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    from k3core.serve.app import create_app
    from k3core.serve.engine_thread import ModelInfo
    from k3core.serve.metrics import ServerMetrics
    directory = tmp_path_factory.mktemp("Kimi-Linear-scripted")
    write_kimi_linear(directory)
    config = load_config(str(directory))
    tokenizer = load_tokenizer(directory, config)
    info = ModelInfo(tokenizer, CONTEXT, config.vocab_size, False, 16, 1024, 1024, 1024 * (CONTEXT // 16 + 8), True)
    engine = ScriptedEngine(info)
    app = create_app(ServerArgs(model=str(directory), served_model_name=SERVED), engine, ServerMetrics(SERVED))
    http = TestClient(app, base_url="http://testserver")
    return directory, engine, openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http,
                                            max_retries=0)


def test_tool_call_reply_and_the_next_turn(scripted):
    directory, engine, client = scripted
    out = client.chat.completions.create(model=SERVED, messages=CHAT, tools=TOOLS)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    [call] = choice.message.tool_calls
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == \
        ("functions.get_weather:0", "get_weather", {"city": "Paris"})
    # streamed: the same content, and the call in one delta with its index and id
    content, calls, finish = "", [], None
    for chunk in client.chat.completions.create(model=SERVED, messages=CHAT, tools=TOOLS, stream=True):
        if chunk.choices:
            content += chunk.choices[0].delta.content or ""
            calls += chunk.choices[0].delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
    assert content == "Checking." and finish == "tool_calls"
    assert [(c.index, c.id, c.function.name, c.function.arguments) for c in calls] == \
        [(0, call.id, "get_weather", call.function.arguments)]
    # the client sends the call back with its result: the next prompt renders the model's own id in both places
    follow = CHAT + [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "18°C, sunny"}]
    client.chat.completions.create(model=SERVED, messages=follow, tools=TOOLS)
    assert engine.submitted[-1] == reference_ids(directory, follow, TOOLS)
    prompt = engine.info.tokenizer.decode(engine.submitted[-1])
    assert "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>" in prompt
    assert "## Return of functions.get_weather:0\n18°C, sunny" in prompt
