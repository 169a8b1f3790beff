"""Chat templates: rendered text identical to transformers' apply_chat_template, in a sandbox."""
from __future__ import annotations

import json

import pytest

from pagedserve.model.chat_template import ChatTemplate, normalize_messages, read_chat_template_file
from pagedserve.model.tokenizer import Tokenizer, load_tokenizer

CONVERSATIONS = {
    "single_user": [{"role": "user", "content": "What is 2 + 2?"}],
    "system_first": [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Hello!"},
    ],
    "multi_turn_no_system": [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one, with emoji 🎨 and 中文?"},
    ],
    "multi_turn_with_system": [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello.\n\nHow can I help?"},
        {"role": "user", "content": "  spaces  and\ttabs  "},
        {"role": "assistant", "content": ""},
    ],
}


@pytest.fixture(scope="session")
def tokenizer(gguf_file):
    return Tokenizer.from_gguf(gguf_file)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_matches_reference(tokenizer, hf_tokenizer, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    ours = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    reference = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == reference


def test_default_system_prompt_and_generation_prompt(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_text_parts_are_joined(tokenizer):
    parts = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    plain = [{"role": "user", "content": "one\ntwo"}]
    assert tokenizer.apply_chat_template(parts) == tokenizer.apply_chat_template(plain)


IMAGE_AND_TEXT = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}},
                                                {"type": "text", "text": "What is this?"}]}]


def test_non_text_part_is_rejected(tokenizer):
    audio = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x"}}]}]
    with pytest.raises(ValueError, match=r"messages\[0\].content parts must be .*'input_audio'"):
        tokenizer.apply_chat_template(audio)
    with pytest.raises(ValueError, match=r"messages\[0\].content has an image part, but this model does not accept"):
        tokenizer.apply_chat_template(IMAGE_AND_TEXT)


def test_image_parts_become_the_placeholder_in_joined_text(tokenizer):
    text = tokenizer.apply_chat_template(IMAGE_AND_TEXT, image_placeholder="<image>")
    assert text == tokenizer.apply_chat_template([{"role": "user", "content": "<image>\nWhat is this?"}])


def test_a_template_that_renders_image_parts_gets_them():
    # Idefics3's way: the template itself writes what an image part is.
    source = ("{% for m in messages %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>"
              "{% else %}[{{ p['text'] }}]{% endif %}{% endfor %}{% endfor %}")
    template = ChatTemplate(source)
    assert template.takes_image_parts
    assert template.render(IMAGE_AND_TEXT, image_placeholder="<image>") == "<image>[What is this?]"


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "messages must be a non-empty list"),
        ("hello", "messages must be a non-empty list"),
        ([{"content": "no role"}], r"messages\[0\] must be a dict with a string 'role'"),
        ([{"role": "user", "content": 3}], r"messages\[0\].content must be a string"),
    ],
)
def test_invalid_messages_are_rejected(messages, message):
    with pytest.raises(ValueError, match=message):
        normalize_messages(messages)


def test_caller_messages_are_not_modified(tokenizer):
    content = [{"type": "text", "text": "a"}]
    messages = [{"role": "user", "content": content}]
    tokenizer.apply_chat_template(messages)
    assert messages == [{"role": "user", "content": [{"type": "text", "text": "a"}]}]


def test_model_without_template_gets_a_clear_error(tokenizer):
    bare = Tokenizer(
        tokenizer.backend, bos_token_id=None, eos_token_id=2, pad_token_id=None, unk_token_id=None,
        chat_template=None,
    )
    with pytest.raises(ValueError, match="this model has no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_sees_special_tokens_tools_and_extra_variables(tokenizer):
    custom = tokenizer.with_chat_template(
        "{{ bos_token }}{% for t in tools %}{{ t.function.name }};{% endfor %}{{ messages[0].content }}"
        "{% if add_generation_prompt %}[gen]{% endif %}{{ eos_token }}{{ enable_thinking }}"
    )
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    text = custom.apply_chat_template([{"role": "user", "content": "q"}], tools=tools, enable_thinking=False)
    assert text == "<|im_start|>get_weather;q[gen]<|im_end|>False"
    assert tokenizer.chat_template != custom.chat_template  # the original keeps the model's template


def test_tojson_keeps_markup_and_takes_options():
    template = ChatTemplate("{{ tools | tojson }}|{{ tools | tojson(indent=2) }}")
    tools = [{"name": "<a&b>", "note": "é"}]
    compact, indented = template.render([{"role": "user", "content": ""}], tools=tools).split("|")
    assert compact == json.dumps(tools, ensure_ascii=False)
    assert indented == json.dumps(tools, ensure_ascii=False, indent=2)


def test_raise_exception_becomes_value_error():
    template = ChatTemplate(
        "{% if messages[0].role != 'user' %}{{ raise_exception('roles must alternate') }}{% endif %}ok"
    )
    assert template.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ValueError, match="roles must alternate"):
        template.render([{"role": "assistant", "content": "x"}])


def test_trim_and_lstrip_blocks_like_hf():
    template = ChatTemplate("{% for m in messages %}\n    {{ m.content }}\n{% endfor %}\n")
    assert template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "    a\n    b\n"


def test_loop_controls_and_generation_blocks():
    template = ChatTemplate(
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    )
    messages = [{"role": "user", "content": c} for c in "abc"]
    assert template.render(messages) == "ab"


def test_namespace_state_across_loop_iterations():
    template = ChatTemplate(
        "{% set ns = namespace(users=0) %}{% for m in messages %}"
        "{% if m.role == 'user' %}{% set ns.users = ns.users + 1 %}{% endif %}{% endfor %}{{ ns.users }}"
    )
    roles = ["system", "user", "assistant", "user"]
    assert template.render([{"role": r, "content": ""} for r in roles]) == "2"


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages.__class__.__mro__ }}",
        "{{ messages.append(1) }}",
        "{% set ns = namespace(_x=1) %}",
        "{% set ns = namespace() %}{% set ns.__dict__ = 1 %}",
        "{{ cycler.__init__.__globals__ }}",
    ],
)
def test_sandbox_blocks_escapes_and_mutation(source):
    with pytest.raises(ValueError, match="chat template rejected"):
        ChatTemplate(source).render([{"role": "user", "content": "x"}])


def test_syntax_error_is_reported():
    with pytest.raises(ValueError, match="chat template does not compile"):
        ChatTemplate("{% for m in messages %}")


def test_server_side_template_files(tokenizer, tmp_path):
    jinja_file = tmp_path / "custom.jinja"
    jinja_file.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    json_file = tmp_path / "tokenizer_config.json"
    json_file.write_text(json.dumps({"chat_template": "json:{{ messages[0].content }}"}))
    assert read_chat_template_file(json_file) == "json:{{ messages[0].content }}"

    tokenizer.save(tmp_path / "model")
    served = load_tokenizer(tmp_path / "model", chat_template_path=jinja_file)
    assert served.apply_chat_template([{"role": "user", "content": "hi"}]) == "<user>hi"

    with pytest.raises(ValueError, match="chat_template_path .* is not a file"):
        read_chat_template_file(tmp_path / "missing.jinja")
