"""Jinja chat templates from the checkpoint (Kimi-Linear's K2 format and others), rendered in a sandbox."""
from __future__ import annotations

import copy

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


HOSTILE_TEMPLATES = {
    # Python internals reached from data, from jinja's own globals, and through str.format's field lookup
    "{{ ''.__class__.__mro__ }}": "sandbox forbids .*'__class__'",
    "{{ cycler.__init__.__globals__ }}": "sandbox forbids .*'__init__'",
    "{{ lipsum.__globals__ }}": "sandbox forbids .*'__globals__'",
    "{{ raise_exception.__globals__ }}": "sandbox forbids .*'__globals__'",
    "{{ messages.__class__ }}": "sandbox forbids .*'__class__'",
    "{{ messages[0] | attr('__class__') }}": "sandbox forbids .*'__class__'",
    "{{ '{0.__class__}'.format(messages) }}": "sandbox forbids .*'__class__'",
    # other files: refused when the template is compiled, before anything renders
    "{% include '/etc/passwd' %}": "uses `include` \\(line 1\\)",
    "{% import '/etc/passwd' as secrets %}{{ secrets }}": "uses `import`",
    "{% from '/etc/passwd' import root %}": "uses `from-import`",
    "{% extends '/etc/passwd' %}": "uses `extends`",
}


@pytest.mark.parametrize("source", list(HOSTILE_TEMPLATES))
def test_hostile_templates_are_refused_not_rendered(source):
    # stock jinja2 sandboxes render an unsafe attribute as an empty string; k3core's refuses the render instead
    with pytest.raises(TemplateError, match=HOSTILE_TEMPLATES[source]):
        render_template("ok {{ messages[0]['content'] }} " + source, [{"role": "user", "content": "x"}])


def test_sandbox_keeps_what_chat_templates_use():
    template = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
                "{% if m.tool_calls is defined %}!{% endif %}{{ m.get('name', m['role']) }}{% endfor %}"
                "{{ ns.n }}{{ (tools or []) | length }}{{ messages[0].missing }}|{{ bos_token }}")
    assert render_template(template, [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}],
                           special_tokens={"bos_token": "[BOS]"}) == "usertool20|[BOS]"


def test_a_request_silent_about_thinking_leaves_the_template_its_default(k2):
    # Hugging Face passes no thinking variable unless the caller gives one; a template that thinks by default
    # (`enable_thinking is defined and not enable_thinking` -> no thinking) must keep thinking then
    from k3core.serve.chat import chat_prompt_ids
    from k3core.serve.protocol import parse_chat
    tokenizer, _ = k2
    probe = copy.copy(tokenizer)
    probe.chat_template = "{% if enable_thinking is defined %}{{ enable_thinking }}{% else %}unset{% endif %}"

    def rendered(**fields) -> str:
        request = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], **fields})
        return probe.decode(chat_prompt_ids(probe, request))

    assert rendered() == "unset"
    assert rendered(chat_template_kwargs={"enable_thinking": True}) == "True"
    assert rendered(chat_template_kwargs={"enable_thinking": False}) == "False"
    assert rendered(reasoning_effort="none") == "False"
