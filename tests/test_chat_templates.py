"""Jinja chat templates from the checkpoint (Kimi-Linear's K2 format and others), rendered in a sandbox."""
from __future__ import annotations

import pytest

from k3core.chat import TemplateError, chat_format, render_messages
from k3core.chat.templates import render_template
from k3core.config import ModelConfig
from k3core.model.tokenizer_writer import K2_SPECIAL_OFFSETS, prefix_ranks, write_kimi_tokenizer
from k3core.tokenizer import load_tokenizer

# A K2-style template (the shape Kimi-Linear ships): role headers between <|im_...|> specials, no BOS.
K2_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}<|im_system|>system<|im_middle|>"
    "{% elif m['role'] == 'user' %}<|im_user|>user<|im_middle|>"
    "{% else %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
    "{{ m['content'] }}<|im_end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
    "{% if tools %}[{{ tools | tojson }}]{% endif %}"
    "{% if thinking is defined and not thinking %}(no thinking){% endif %}")


@pytest.fixture(scope="module")
def k2(tmp_path_factory):
    directory = tmp_path_factory.mktemp("kimi_linear")
    ranks = prefix_ranks(["system", "user", "assistant", "Hello"])
    specials = write_kimi_tokenizer(directory, ranks, K2_SPECIAL_OFFSETS, chat_template=K2_TEMPLATE)
    base = ModelConfig.preset("k3-tiny")
    config = base.replace(vocab_size=len(ranks) + 256, eos_token_id=specials["<|im_end|>"],
                          extra={**base.extra, "hf_model_type": "kimi_linear"})
    return load_tokenizer(directory, config), specials


def test_k2_template_renders_with_specials_as_ids(k2):
    tokenizer, specials = k2
    assert chat_format(tokenizer) == "jinja"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    ids = render_messages(tokenizer, messages)
    expected = [specials["<|im_system|>"], *tokenizer.encode("system"), specials["<|im_middle|>"],
                *tokenizer.encode("Be brief."), specials["<|im_end|>"], specials["<|im_user|>"],
                *tokenizer.encode("user"), specials["<|im_middle|>"], *tokenizer.encode("Hello"),
                specials["<|im_end|>"], specials["<|im_assistant|>"], *tokenizer.encode("assistant"),
                specials["<|im_middle|>"]]
    assert ids == expected
    assert tokenizer.bos_token_id not in ids
    assert tokenizer.apply_chat_template(messages) == ids
    tools = [{"type": "function", "function": {"name": "f", "description": "é"}}]
    with_tools = tokenizer.decode(render_messages(tokenizer, messages, tools=tools, thinking=False))
    assert with_tools.endswith('[[{"type": "function", "function": {"name": "f", "description": "é"}}]](no thinking)')


def test_sandbox_refuses_python_internals():
    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(TemplateError, match="sandbox forbids"):
        render_template(escape, [{"role": "user", "content": "x"}])
    mutate = "{% set m = messages.append({'role': 'x'}) %}"
    with pytest.raises(TemplateError, match="sandbox forbids"):
        render_template(mutate, [{"role": "user", "content": "x"}])
    with pytest.raises(TemplateError, match="not valid jinja"):
        render_template("{% for %}", [])
    with pytest.raises(TemplateError, match="refused the request: only user"):
        render_template("{{ raise_exception('only user') }}", [])


def test_chat_template_kwargs_reach_the_template():
    template = "{% if enable_thinking %}T{% else %}F{% endif %}{{ messages[0]['content'] }}"
    assert render_template(template, [{"role": "user", "content": "x"}], enable_thinking=True) == "Tx"
    assert render_template(template, [{"role": "user", "content": "x"}]) == "Fx"
