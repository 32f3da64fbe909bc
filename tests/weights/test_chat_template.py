"""Chat templates render like transformers' `apply_chat_template`, inside a sandbox, and fail
with ChatTemplateError."""

from __future__ import annotations

import random
from datetime import datetime

import pytest

from sitsd.weights import ChatTemplateError, load_checkpoint
from sitsd.weights.chat_template import ChatTemplate
from tests.weights.tiny_models import write_tiny_llama


def random_conversation(rng: random.Random) -> list[dict[str, str]]:
    words = ["hello", "Paris", "why?", "42", "caf\u00e9", "\u4f60\u597d", "a\nb", "{{ x }}"]
    turns = [{"role": "system", "content": " ".join(rng.choices(words, k=3))}]
    for i in range(rng.randrange(1, 4) * 2 - 1):
        role = "user" if i % 2 == 0 else "assistant"
        turns.append({"role": role, "content": " ".join(rng.choices(words, k=rng.randrange(1, 6)))})
    return turns


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    from transformers import AutoTokenizer

    model_dir = write_tiny_llama(tmp_path_factory.mktemp("chat") / "m")
    return load_checkpoint(model_dir, load_tensors=False).tokenizer, AutoTokenizer.from_pretrained(
        model_dir
    )


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rendered_text_and_ids_equal_transformers(tiny_pair, seed, add_generation_prompt):
    ours, theirs = tiny_pair
    messages = random_conversation(random.Random(seed))

    text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)

    assert text == theirs.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    want_ids = theirs.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    assert ours.encode(text, add_special_tokens=False) == list(want_ids)


def test_template_sees_bos_token(tiny_pair):
    ours, _ = tiny_pair

    assert ours.apply_chat_template([{"role": "user", "content": "x"}]).startswith("<|endoftext|>")


def test_raise_exception_in_the_template_is_a_chat_template_error(tiny_pair):
    ours, _ = tiny_pair

    with pytest.raises(ChatTemplateError, match="Unknown role: robot"):
        ours.apply_chat_template([{"role": "robot", "content": "beep"}])


def test_model_without_template_raises_chat_template_error(tmp_path):
    import json

    model_dir = write_tiny_llama(tmp_path / "m")
    config_file = model_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    del config["chat_template"]
    config_file.write_text(json.dumps(config))
    tok = load_checkpoint(model_dir, load_tensors=False).tokenizer

    assert not tok.has_chat_template
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_that_does_not_compile_fails_on_use_not_on_load():
    template = ChatTemplate("{% for m in messages %}{{ m.content }")

    with pytest.raises(ChatTemplateError, match="does not compile"):
        template.render([{"role": "user", "content": "hi"}])


def test_tojson_does_not_html_escape():
    template = ChatTemplate("{{ messages[0] | tojson }}")

    text = template.render([{"role": "user", "content": "<a href='x'> & \u00e9"}])

    assert text == '{"role": "user", "content": "<a href=\'x\'> & \u00e9"}'


def test_strftime_now_formats_the_current_date():
    template = ChatTemplate("{{ strftime_now('%Y-%m-%d') }}")

    before = datetime.now().strftime("%Y-%m-%d")
    text = template.render([])
    after = datetime.now().strftime("%Y-%m-%d")

    assert text in {before, after}


def test_loop_controls_are_available():
    template = ChatTemplate(
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{{ m.content }}{% if loop.index > 2 %}{% break %}{% endif %}{% endfor %}"
    )
    messages = [
        {"role": r, "content": c}
        for r, c in [("system", "S"), ("user", "a"), ("assistant", "b"), ("user", "c")]
    ]

    assert template.render(messages) == "ab"


def test_namespace_and_dict_work_like_transformers():
    template = ChatTemplate(
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% endfor %}{{ ns.n }} {{ dict(a=1)['a'] }}"
    )

    assert template.render([{"role": "user", "content": "x"}] * 3) == "3 1"


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),
        ("{{ messages[0].content.__class__.__name__ }}", "unsafe"),
        ("{% set x = messages.append({'role': 'user'}) %}", "unsafe"),
        ("{% set ns = namespace(_hidden=1) %}", "underscore"),
        ("{% set ns = namespace() %}{% set ns._x = 1 %}", "underscore"),
    ],
)
def test_sandbox_refuses_escapes_and_mutation(source, message):
    messages = [{"role": "user", "content": "hi"}]

    with pytest.raises(ChatTemplateError, match=message):
        ChatTemplate(source).render(messages)
    assert messages == [{"role": "user", "content": "hi"}]


def test_messages_must_be_a_list_of_dicts():
    with pytest.raises(ChatTemplateError, match="list of dicts"):
        ChatTemplate("{{ messages }}").render(["hello"])  # type: ignore[list-item]


def test_undefined_variables_render_empty_like_transformers():
    template = ChatTemplate(
        "[{{ bos_token }}|{{ nothing }}|{{ tools is none }}]", {"bos_token": None}
    )

    assert template.render([]) == "[||True]"
