"""A published-layout K3 directory, written by the test, served by the real server and driven with `openai`.

The directory holds what Moonshot ships: config.json with the language model under `text_config` and a
`quantization_config`, MXFP4 routed experts, a vision-tower tensor the loader skips, `tiktoken.model` +
`tokenizer_config.json`, `tokenization_kimi.py` and `encoding_k3.py` (both would leave a marker file if anything
ran them) and `generation_config.json`. The weights are random, so the checks are on what the server ran (the
prompt ids equal `render_messages`) and on the output path (the parsed fields equal `parse_k3_output` of the
greedy text, whole and streamed).
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

from k3core.chat import parse_k3_output, render_messages
from k3core.config import ModelConfig, load_config
from k3core.model.checkpoint_writer import save_k3_checkpoint
from k3core.model.tokenizer_writer import prefix_ranks, write_kimi_tokenizer
from k3core.model.weights import init_random_weights
from k3core.serve.args import ServerArgs
from k3core.serve.launch import build_server
from k3core.tokenizer import load_tokenizer

CONTEXT = 2048
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
MESSAGES = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Weather in Paris?"}]


def write_published_k3(directory) -> None:
    ranks = prefix_ranks(["Paris", "weather", "message", " role", "assistant", "think"])
    specials = write_kimi_tokenizer(directory, ranks)
    base = ModelConfig.preset("k3-tiny")
    config = base.replace(vocab_size=len(ranks) + 256, bos_token_id=specials["[BOS]"],
                          eos_token_id=specials["<|end_of_msg|>"], pad_token_id=specials["[PAD]"])
    save_k3_checkpoint(init_random_weights(config, seed=3), config, directory, mxfp4_experts=True)
    config_file = directory / "config.json"
    data = json.loads(config_file.read_text())
    data["text_config"].setdefault("quantization_config", {
        "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
        "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"],
                                      "weights": {"num_bits": 4, "type": "float", "group_size": 32}}},
        "ignore": ["lm_head"]})
    config_file.write_text(json.dumps(data))
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(directory / "model.safetensors"))
    tensors["vision_tower.patch_embed.proj.weight"] = torch.zeros(4, 3, 2, 2)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "generation_config.json").write_text(json.dumps(
        {"temperature": 1.0, "top_p": 0.95, "eos_token_id": specials["<|end_of_msg|>"]}))
    code = f"open({str(directory / 'REMOTE_CODE_RAN')!r}, 'w').write('ran')\n"
    (directory / "tokenization_kimi.py").write_text(code)
    (directory / "encoding_k3.py").write_text(code)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    directory = tmp_path_factory.mktemp("Kimi-K3")
    write_published_k3(directory)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    args = ServerArgs(model=str(directory), served_model_name="kimi-k3", port=port, context_length=CONTEXT,
                      log_level="warning", memory_bytes=64 << 20, device="cpu", dtype="float32",
                      cpu_threads=torch.get_num_threads(), page_size=16, checkpoint_interval=32,
                      chunked_prefill_tokens=256)
    server = build_server(args)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline, status = time.monotonic() + 120, None
    while time.monotonic() < deadline and status != 200:
        try:
            status = httpx.get(base + "/health", timeout=2).status_code
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    assert status == 200, f"server did not start: {server.engine.error}"
    tokenizer = load_tokenizer(directory, load_config(str(directory)))
    yield directory, base, tokenizer, openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)
    server.shutdown()
    thread.join(15)
    sock.close()


def test_nothing_from_the_checkpoint_ran_and_the_tokenizer_is_kimi(served):
    directory, base, _, _ = served
    assert not (directory / "REMOTE_CODE_RAN").exists()
    info = httpx.get(base + "/tokenizer_info").json()
    assert info["tokenizer_class"] == "TiktokenTokenizer" and info["chat_format"] == "xtml"
    assert info["eos_token"] == "<|end_of_msg|>"


def test_chat_with_tools_runs_the_rendered_prompt(served):
    _, base, tokenizer, client = served
    expected = render_messages(tokenizer, MESSAGES, tools=TOOLS)
    assert httpx.post(base + "/tokenize", json={"model": "kimi-k3", "messages": MESSAGES,
                                                "tools": TOOLS}).json()["tokens"] == expected
    out = client.chat.completions.create(model="kimi-k3", messages=MESSAGES, tools=TOOLS, max_tokens=6,
                                         temperature=0)
    assert out.usage.prompt_tokens == len(expected)               # the server ran exactly the rendered prompt
    assert out.choices[0].finish_reason in ("length", "stop", "tool_calls")
    # the reply went through the K3 parser: its fields are the parser's reading of the raw greedy text
    raw = client.completions.create(model="kimi-k3", prompt=expected, max_tokens=6, temperature=0).choices[0].text
    parsed = parse_k3_output(raw)
    message = out.choices[0].message
    assert message.reasoning_content == parsed.reasoning_content and message.content == parsed.content


def test_streaming_with_reasoning_equals_the_whole_reply(served):
    _, _, _, client = served
    history = MESSAGES + [
        {"role": "assistant", "content": None, "reasoning_content": "Need the weather.", "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "18°C, sunny"}]
    whole = client.chat.completions.create(model="kimi-k3", messages=history, tools=TOOLS, max_tokens=8,
                                           temperature=0, reasoning_effort="high").choices[0].message
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(model="kimi-k3", messages=history, tools=TOOLS, max_tokens=8,
                                                temperature=0, reasoning_effort="high", stream=True):
        if chunk.choices:
            reasoning += getattr(chunk.choices[0].delta, "reasoning_content", None) or ""
            content += chunk.choices[0].delta.content or ""
    assert (reasoning, content) == (whole.reasoning_content or "", whole.content)
