"""The harmony format on its own: the chat template pagedserve writes for gpt-oss, the
models that get it, the stop tokens of a harmony vocabulary and the parser on text (the
server tests drive it through every API: tests/server/test_server_harmony.py)."""
from __future__ import annotations

import json

import pytest
from tokenizers import AddedToken

from pagedserve.http.reasoning_parsers import REASONING_PARSERS, detect_reasoning_parser
from pagedserve.http.reply import ReplyParser, parse_reply
from pagedserve.http.tool_parsers import TOOL_PARSERS
from pagedserve.model.chat_template import ChatTemplate
from pagedserve.model.harmony_template import default_chat_template, harmony_chat_template
from pagedserve.model.registry import default_model_path
from pagedserve.model.tokenizer import Tokenizer, load_tokenizer

HARMONY = ChatTemplate(harmony_chat_template())
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "Its name"},
        "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
        "days": {"type": "array", "items": {"type": "integer"}}}}}}
GPT_OSS = REASONING_PARSERS["gpt_oss"]
CALL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'


def test_the_template_renders_each_role():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "Thanks"},
    ]
    text = HARMONY.render(messages, tools=[WEATHER], reasoning_effort="high")
    assert text.startswith("<|start|>system<|message|>You are ChatGPT")
    assert "Reasoning: high\n\n# Valid channels: analysis, commentary, final." in text
    assert "Calls to these tools must go to the commentary channel: 'functions'.<|end|>" in text
    assert ("<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\n"
            "namespace functions {\n\n// The weather in a city.\ntype get_weather = (_: {\n// Its name\n"
            "city: string,\nunit?: \"c\" | \"f\", // default: c\ndays?: number[],\n}) => any;\n\n"
            "} // namespace functions<|end|>") in text
    assert text.endswith(
        "<|start|>user<|message|>Weather?<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris"}<|call|>'
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Sunny.<|end|>"
        "<|start|>user<|message|>Thanks<|end|><|start|>assistant")


def test_the_template_defaults():
    text = HARMONY.render([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert "Reasoning: medium" in text and "developer" not in text and "Calls to these tools" not in text
    assert text.endswith("<|start|>user<|message|>Hi<|end|>")


@pytest.mark.parametrize("messages, error", [
    ([{"role": "tool", "content": "x"}], "tool message must answer"),
    ([{"role": "narrator", "content": "x"}], "no role narrator"),
])
def test_the_template_refuses_what_harmony_cannot_say(messages, error):
    with pytest.raises(ValueError, match=error):
        HARMONY.render(messages)


def test_gpt_oss_models_without_a_template_get_harmony(tmp_path):
    assert default_chat_template("gpt-oss") == default_chat_template("gpt_oss") == harmony_chat_template()
    assert default_chat_template("llama") is None
    tokenizer = load_tokenizer(default_model_path())
    folder = tmp_path / "gpt-oss"
    Tokenizer(tokenizer.backend, bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=None,
              unk_token_id=None, chat_template=None).save(folder)
    assert Tokenizer.from_pretrained(folder).chat_template is None  # no config.json: no architecture
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    assert Tokenizer.from_pretrained(folder).chat_template == harmony_chat_template()
    assert detect_reasoning_parser(harmony_chat_template()) is GPT_OSS
    gguf = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2", "tokenizer.ggml.tokens": ["a", "b"],
            "tokenizer.ggml.merges": [], "general.architecture": "gpt-oss"}
    assert Tokenizer.from_gguf_metadata(gguf).chat_template == harmony_chat_template()
    assert Tokenizer.from_gguf_metadata({**gguf, "tokenizer.chat_template": "own"}).chat_template == "own"


def test_a_harmony_vocabulary_stops_on_return_and_call_not_end(tmp_path):
    folder = tmp_path / "tok"
    load_tokenizer(default_model_path()).save(folder)
    plain = Tokenizer.from_pretrained(folder)
    plain.backend.add_special_tokens([AddedToken("<|end|>", special=True, normalized=False)])
    plain.save(folder)
    end = plain.backend.token_to_id("<|end|>")
    assert end in Tokenizer.from_pretrained(folder).stop_token_ids  # Phi-3's end of turn
    plain.backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                      for t in ("<|channel|>", "<|return|>", "<|call|>")])
    plain.save(folder)
    harmony = Tokenizer.from_pretrained(folder)
    names = {harmony.id_to_token(i) for i in harmony.stop_token_ids}
    assert {"<|return|>", "<|call|>"} <= names and "<|end|>" not in names


def test_unknown_channels_and_preambles_are_content():
    text = ("<|channel|>commentary<|message|>Checking. <|end|><|start|>assistant<|channel|>aside<|message|>odd<|end|>"
            "<|start|>assistant<|channel|>final<|message|>Done.<|return|>")
    reply = parse_reply([(text, 9)], GPT_OSS.for_prompt(""), None)
    assert (reply.reasoning, reply.content, reply.calls) == (None, "Checking. oddDone.", [])


@pytest.mark.parametrize("text", [
    "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant" + CALL + "<|call|>",
    "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant" + CALL,  # <|call|> was the stop token
    "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary "
    '<|constrain|>json<|message|>{"city": "Paris"}<|call|>',  # the recipient after the role
])
def test_a_call_from_the_commentary_channel(text):
    reply = parse_reply([(text, 12)], GPT_OSS.for_prompt(""), TOOL_PARSERS["hermes"])
    [call] = reply.calls
    assert (reply.reasoning, reply.content, call.name, call.arguments) == ("Hm.", None, "get_weather",
                                                                           '{"city": "Paris"}')


def test_a_streamed_call_joins_to_the_whole():
    text = "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant" + CALL
    parser = ReplyParser(GPT_OSS.for_prompt(""), TOOL_PARSERS["hermes"])
    deltas = [parser.feed(text[i:i + 5], 1, i + 5 >= len(text)) for i in range(0, len(text), 5)]
    pieces = [piece for d in deltas for piece in d.tool_calls]
    assert pieces[0].name == "get_weather" and pieces[0].id is not None
    assert "".join(p.arguments for p in pieces) == '{"city": "Paris"}' and parser.num_calls == 1
    assert "".join(d.reasoning for d in deltas) == "Hm." and not "".join(d.content for d in deltas)
    # The header's tokens count with the section they open: all up to <|end|> is reasoning.
    assert parser.reasoning_tokens == -(-len("<|channel|>analysis<|message|>Hm.<|end|>") // 5)


def test_a_call_cut_off_is_content():
    text = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Pa"
    reply = parse_reply([(text, 9)], GPT_OSS.for_prompt(""), TOOL_PARSERS["hermes"])
    assert (reply.content, reply.calls) == ('{"city": "Pa', [])
