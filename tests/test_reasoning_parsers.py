"""Reasoning parsers on text, whole and streamed in every split; the reply parser that
reads tool calls from the answer only; the request plan (budgets, efforts, template
switches) and SamplingParams' two reasoning fields; --reasoning-parser."""
from __future__ import annotations

import pytest

from pagedserve.entrypoints.cli import build_parser
from pagedserve.entrypoints.openai.args import ServerConfig, server_config_from_args, server_reasoning_parser
from pagedserve.http.errors import APIError
from pagedserve.http.reasoning_plan import EFFORT_BUDGETS, plan_reasoning
from pagedserve.http.reasoning_parsers import REASONING_PARSERS, detect_reasoning_parser, split
from pagedserve.http.reply import ReplyParser, parse_reply
from pagedserve.http.tool_parsers import TOOL_PARSERS
from pagedserve.sampling_params import MAX_THINKING_TOKEN_BUDGET, ReasoningMarkers, SamplingParams

QWEN3, R1, GPT_OSS = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_r1"], REASONING_PARSERS["gpt_oss"]
OPEN_PROMPT = "<|im_start|>assistant\n<think>\n"  # R1's template opens the section
PLAIN_PROMPT = "<|im_start|>assistant\n"
CLOSED_PROMPT = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # Qwen3's with enable_thinking false


@pytest.mark.parametrize("fmt, prompt, text, expected", [
    (QWEN3, PLAIN_PROMPT, "<think>\nLet me see.\n</think>\n\nHello!", ("Let me see.", "Hello!")),
    (QWEN3, PLAIN_PROMPT, "Hello!", (None, "Hello!")),  # no section opened: all answer
    (QWEN3, PLAIN_PROMPT, "<think>\nstill thinking", ("still thinking", None)),  # max_tokens hit
    (QWEN3, CLOSED_PROMPT, "<think>a</think>b", (None, "<think>a</think>b")),  # thinking off: not parsed
    (QWEN3, OPEN_PROMPT, "x</think>y", ("x", "y")),
    (R1, OPEN_PROMPT, "Let me see.\n</think>\n\nHello!", ("Let me see.", "Hello!")),
    (R1, OPEN_PROMPT, "<think>\nagain</think>Hello!", ("again", "Hello!")),  # a repeated opening is dropped
    (R1, OPEN_PROMPT, "never ends", ("never ends", None)),
    (R1, PLAIN_PROMPT, "no markers at all", ("no markers at all", None)),  # R1: reasoning first
    (R1, OPEN_PROMPT, "</think>Hello!", (None, "Hello!")),
    (R1, OPEN_PROMPT, "", (None, None)),
    (QWEN3, PLAIN_PROMPT, "<think>a</think>b </think> c", ("a", "b </think> c")),  # one section only
])
def test_whole_replies(fmt, prompt, text, expected):
    assert fmt.parse(prompt, text) == expected


@pytest.mark.parametrize("fmt, prompt, text", [
    (QWEN3, PLAIN_PROMPT, "  <think>\nI reason </thi nk <think here\n\n</think>\n\nThe answer </think> is 42"),
    (R1, OPEN_PROMPT, "I reason\n</think>\n\nThe answer"),
    (R1, OPEN_PROMPT, "<think>\nunfinished </thi"),
    (QWEN3, PLAIN_PROMPT, "<thin>not a marker"),
    (GPT_OSS, "", "<|channel|>analysis<|message|>Think <|e.<|end|><|start|>assistant<|channel|>final<|message|>"
                  "Done.<|return|>"),
])
def test_every_split_of_a_stream_gives_the_whole_reply(fmt, prompt, text):
    whole = fmt.parse(prompt, text)
    for size in (1, 2, 3, 7):
        pieces = [(text[i:i + size], 1) for i in range(0, len(text), size)]
        reasoning, content, _ = split(fmt.for_prompt(prompt).stream(), pieces)
        assert (reasoning, content or None) == whole, size


def test_a_marker_split_across_deltas_is_held_back():
    parser = QWEN3.for_prompt(PLAIN_PROMPT).stream()
    deltas = [parser.feed(piece, 1) for piece in ["<th", "ink>Hmm", " ok</th", "ink>", "\n\nHi"]]
    assert [(d.reasoning, d.content) for d in deltas] == [("", ""), ("Hmm", ""), (" ok", ""), ("", ""), ("", "Hi")]
    assert parser.reasoning_tokens == 4  # the delta that closes the section is reasoning


def test_reasoning_tokens_count_the_section():
    pieces = [("<think>", 1), ("a", 1), (" b", 1), ("</think>", 1), ("\n\n", 1), ("Hi", 1), ("!", 1)]
    assert split(QWEN3.for_prompt(PLAIN_PROMPT).stream(), pieces) == ("a b", "Hi!", 4)
    assert split(QWEN3.for_prompt(PLAIN_PROMPT).stream(), [("Hi", 1), ("!", 1)]) == (None, "Hi!", 0)
    assert split(R1.for_prompt(OPEN_PROMPT).stream(), [("a", 2), ("</think>", 1), ("Hi", 3)]) == ("a", "Hi", 3)


def test_gpt_oss_channels():
    text = ("<|channel|>analysis<|message|>User greets.<|end|>"
            "<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>"
            "<|start|>assistant<|channel|>final<|message|>Hello!<|return|>")
    assert GPT_OSS.parse("", text) == ("User greets.", "{}Hello!")
    assert GPT_OSS.parse("", "<|channel|>analysis<|message|>cut off") == ("cut off", None)
    assert GPT_OSS.parse("", "<|channel|>fin") == (None, None)  # a header cut off says nothing


def test_markers_in_token_ids():
    def encode(text: str) -> list[int]:
        return [ord(c) for c in text]

    opened = R1.for_prompt(OPEN_PROMPT)
    assert opened.markers(encode) == ReasoningMarkers(tuple(encode("</think>\n\n")), True, ())
    fresh = QWEN3.for_prompt(PLAIN_PROMPT)
    assert fresh.markers(encode) == ReasoningMarkers(tuple(encode("</think>\n\n")), False, tuple(encode("<think>")))
    assert QWEN3.for_prompt(CLOSED_PROMPT) is None


@pytest.mark.parametrize("template, name", [
    ("{{ '<think>\\n' }}{% if enable_thinking is false %}x{% endif %}", "qwen3"),
    ("{{ message.content.split('</think>')[-1] }}{{ '<｜Assistant｜><think>\\n' }}", "deepseek_r1"),
    ("<|start|>assistant<|channel|>final<|message|>", "gpt_oss"),
    ("<|im_start|>assistant\n", None),
    (None, None),
])
def test_detection_from_the_chat_template(template, name):
    found = detect_reasoning_parser(template)
    assert (found.name if found else None) == name


def test_tool_calls_are_read_from_the_answer_only():
    hermes = TOOL_PARSERS["hermes"]
    call = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    text = f"<think>Maybe {call}?</think>\n\n{call}"
    reply = parse_reply([(text, 9)], QWEN3.for_prompt(PLAIN_PROMPT), hermes)
    assert reply.reasoning == f"Maybe {call}?" and reply.content is None
    assert [(c.name, c.arguments) for c in reply.calls] == [("f", '{"a": 1}')]
    parser = ReplyParser(QWEN3.for_prompt(PLAIN_PROMPT), hermes)
    deltas = [parser.feed(text[i:i + 5], 1, i + 5 >= len(text)) for i in range(0, len(text), 5)]
    assert "".join(d.reasoning for d in deltas) == reply.reasoning
    assert "".join(p.arguments for d in deltas for p in d.tool_calls) == '{"a": 1}' and parser.num_calls == 1


def test_plan_resolves_budgets():
    params = SamplingParams(max_tokens=2000)
    setup = QWEN3.for_prompt(PLAIN_PROMPT)
    encode = lambda text: [len(text)]  # noqa: E731
    for effort, budget in EFFORT_BUDGETS.items():
        plan = plan_reasoning(QWEN3, effort=effort)
        assert plan.apply(params, setup, encode).thinking_token_budget == min(budget, 2000)  # clamped
    applied = plan_reasoning(QWEN3, budget=5000).apply(params, setup, encode)
    assert applied.thinking_token_budget == 5000 and applied.reasoning == setup.markers(encode)
    assert plan_reasoning(QWEN3, budget=0).apply(params, setup, encode).thinking_token_budget == 0
    # Thinking turned off by the prompt, or no budget: nothing to cap.
    assert plan_reasoning(QWEN3, budget=8).apply(params, None, encode).thinking_token_budget is None
    assert plan_reasoning(QWEN3).apply(params, setup, encode).reasoning is None


@pytest.mark.parametrize("kwargs, param", [
    ({"budget": 8}, "thinking_token_budget"),  # no parser
    ({"effort": "low"}, "reasoning_effort"),
])
def test_budgets_need_a_parser(kwargs, param):
    with pytest.raises(APIError) as e:
        plan_reasoning(None, **kwargs)
    assert e.value.status == 400 and e.value.param == param and "--reasoning-parser" in e.value.message


@pytest.mark.parametrize("kwargs, param", [
    ({"budget": 8, "effort": "low"}, "thinking_token_budget"),
    ({"effort": "huge"}, "reasoning_effort"),
    ({"template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"template_kwargs": {"_private": 1}}, "chat_template_kwargs"),
    ({"template_kwargs": {"self": 1}}, "chat_template_kwargs"),
    ({"template_kwargs": {"not a name": 1}}, "chat_template_kwargs"),
])
def test_bad_reasoning_fields(kwargs, param):
    with pytest.raises(APIError) as e:
        plan_reasoning(QWEN3, **kwargs)
    assert e.value.status == 400 and e.value.param == param


def test_sampling_params_reasoning_fields():
    markers = ReasoningMarkers((5, 6), False, (4,))
    params = SamplingParams(thinking_token_budget=0, reasoning=markers)
    assert params.thinking_token_budget == 0 and params.reasoning == markers
    assert SamplingParams(thinking_token_budget=MAX_THINKING_TOKEN_BUDGET,
                          reasoning=markers).thinking_token_budget == 10**9
    for bad in (-1, MAX_THINKING_TOKEN_BUDGET + 1, 10**12, 1.5, True):
        with pytest.raises(ValueError, match="^thinking_token_budget"):
            SamplingParams(thinking_token_budget=bad, reasoning=markers)
    with pytest.raises(ValueError, match="^reasoning"):
        SamplingParams(reasoning=(5, 6))


def _config(*flags: str) -> ServerConfig:
    return server_config_from_args(build_parser().parse_args(["serve", *flags]))


def test_the_flag():
    assert _config().reasoning_parser == "auto"
    assert _config("--reasoning-parser", "qwen3").reasoning_parser == "qwen3"
    assert _config("--reasoning-parser", "none").reasoning_parser is None
    with pytest.raises(SystemExit):
        _config("--reasoning-parser", "granite")
    with pytest.raises(ValueError, match="reasoning_parser"):
        ServerConfig(reasoning_parser="granite")
    assert server_reasoning_parser("auto", "<think>") is R1
    assert server_reasoning_parser("qwen3", None) is QWEN3  # named: whatever the template
    assert server_reasoning_parser("auto", "no markers") is None and server_reasoning_parser(None, "<think>") is None
