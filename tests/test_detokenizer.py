"""Incremental detokenization and stop strings on the real SmolLM2 vocabulary."""
from __future__ import annotations

import pytest

from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.model.tokenizer import Tokenizer

LONG_TEXT = (
    "Streaming test. Héllo wörld! こんにちは、世界。中文字符和标点符号。한국어 문장입니다.\n"
    "Emoji: 😀 👍🏽 👨‍👩‍👧 🇫🇷 🧑🏿‍🚀 ❤️‍🔥 — Ελληνικά, русский, العربية, हिन्दी, ภาษาไทย.\n"
    "def area(r: float) -> float:\n\treturn 3.14159 * r ** 2  # ≈ πr²\n"
    "Numbers 1234567890 and whitespace     runs\n\n\n  end."
) * 3

PROMPT = "<|im_start|>user\nSay something long<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="session")
def tokenizer(gguf_file):
    return Tokenizer.from_gguf(gguf_file)


def stream(detokenizer: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    """Feed `ids` `chunk` at a time until a stop matches; then flush. Returns every delta."""
    deltas = []
    for start in range(0, len(ids), chunk):
        delta, matched = detokenizer.update(ids[start : start + chunk])
        deltas.append(delta)
        if matched is not None:
            return deltas
    deltas.append(detokenizer.finish())
    return deltas


def test_long_text_splits_characters_across_tokens(tokenizer):
    """Precondition for the streaming tests: some tokens hold only part of a character."""
    ids = tokenizer.encode(LONG_TEXT)
    assert sum("\ufffd" in tokenizer.decode([i]) for i in ids) > 20


@pytest.mark.parametrize("chunk", [1, 2, 5])
@pytest.mark.parametrize("with_prompt", [False, True])
def test_deltas_concatenate_to_the_full_decode(tokenizer, chunk, with_prompt):
    ids = tokenizer.encode(LONG_TEXT)
    prompt_ids = tokenizer.encode(PROMPT) if with_prompt else []
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = stream(detokenizer, ids, chunk)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert full == LONG_TEXT
    assert "".join(deltas) == detokenizer.output_text == full
    assert not any("\ufffd" in delta for delta in deltas)


def test_prompt_ending_mid_character_does_not_shift_the_output(tokenizer):
    ids = tokenizer.encode("🧑🏿‍🚀 launch")
    cut = next(i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd"))
    detokenizer = IncrementalDetokenizer(tokenizer, ids[:cut])
    text = "".join(stream(detokenizer, ids[cut:]))
    assert text == tokenizer.decode(ids[cut:])


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_special_tokens(tokenizer, skip):
    ids = tokenizer.encode("Answer: 42<|im_end|>\n<|endoftext|>")
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    text = "".join(stream(detokenizer, ids))
    assert text == tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in text) is not skip


def test_incomplete_character_waits_then_finish_flushes_it(tokenizer):
    ids = tokenizer.encode("ok 👨‍👩‍👧")
    cut = next(i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd"))
    detokenizer = IncrementalDetokenizer(tokenizer)
    streamed = "".join(detokenizer.update([i])[0] for i in ids[:cut])
    assert "\ufffd" not in streamed
    # The request ends here (e.g. max_tokens): the broken tail is all there is.
    assert streamed + detokenizer.finish() == tokenizer.decode(ids[:cut])
    assert detokenizer.finished


def _stop_spanning_tokens(tokenizer, text: str, stop: str) -> list[int]:
    ids = tokenizer.encode(text)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert not any(stop in piece for piece in pieces), "the stop string must span a token boundary"
    return ids


@pytest.mark.parametrize("chunk", [1, 3])
def test_stop_string_across_tokens_is_trimmed(tokenizer, chunk):
    text = "The answer is 42. ###END### then more text that must not appear"
    ids = _stop_spanning_tokens(tokenizer, text, "###END###")
    detokenizer = IncrementalDetokenizer(tokenizer, stop=["###END###"])
    deltas = stream(detokenizer, ids, chunk)
    assert detokenizer.matched_stop == "###END###"
    assert "".join(deltas) == detokenizer.output_text == "The answer is 42. "
    assert not any("#" in delta for delta in deltas)


def test_stop_string_kept_when_asked(tokenizer):
    text = "The answer is 42. ###END### then more text"
    ids = _stop_spanning_tokens(tokenizer, text, "###END###")
    detokenizer = IncrementalDetokenizer(tokenizer, stop=["###END###"], include_stop_str_in_output=True)
    assert "".join(stream(detokenizer, ids)) == "The answer is 42. ###END###"


def test_stop_string_inside_a_multibyte_character_run(tokenizer):
    text = "Great job 👍🏽 see you"
    ids = _stop_spanning_tokens(tokenizer, text, "👍🏽")
    detokenizer = IncrementalDetokenizer(tokenizer, stop=["👍🏽"])
    assert "".join(stream(detokenizer, ids)) == "Great job "
    assert detokenizer.matched_stop == "👍🏽"


def test_possible_stop_prefix_is_held_back_then_released(tokenizer):
    text = "alpha ###ENDLESS omega"
    ids = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer, stop=["###END###"])
    emitted_while_ambiguous = []
    for token_id in ids:
        delta, matched = detokenizer.update([token_id])
        assert matched is None
        if "###ENDL" not in detokenizer.output_text:
            emitted_while_ambiguous.append(delta)
    assert not any("#" in delta for delta in emitted_while_ambiguous)
    assert detokenizer.output_text + detokenizer.finish() == text


def test_held_prefix_is_flushed_on_finish(tokenizer):
    ids = tokenizer.encode("waiting for ###EN")
    detokenizer = IncrementalDetokenizer(tokenizer, stop=["###END###"])
    streamed = "".join(detokenizer.update([i])[0] for i in ids)
    assert streamed == "waiting for "
    assert detokenizer.finish() == "###EN"
    assert detokenizer.output_text == "waiting for ###EN"
    assert detokenizer.matched_stop is None


def test_earliest_stop_wins(tokenizer):
    ids = tokenizer.encode("one two three four")
    detokenizer = IncrementalDetokenizer(tokenizer, stop=["four", "two", "three"])
    assert "".join(stream(detokenizer, ids, chunk=len(ids))) == "one "
    assert detokenizer.matched_stop == "two"


def test_stop_text_in_the_prompt_is_ignored(tokenizer):
    prompt_ids = tokenizer.encode("Reply, then write STOP")
    ids = tokenizer.encode(" Sure thing STOP extra")
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, stop=["STOP"])
    assert "".join(stream(detokenizer, ids)) == " Sure thing "


def test_no_update_after_a_stop(tokenizer):
    detokenizer = IncrementalDetokenizer(tokenizer, stop=["b"])
    detokenizer.update(tokenizer.encode("a b c"))
    assert detokenizer.finished and detokenizer.finish() == ""
    with pytest.raises(RuntimeError, match="after the detokenizer finished"):
        detokenizer.update([1])


@pytest.mark.parametrize("stop", ["###", [""], ["ok", 3]])
def test_invalid_stop_is_rejected(tokenizer, stop):
    with pytest.raises(ValueError, match="stop must be a list of non-empty strings"):
        IncrementalDetokenizer(tokenizer, stop=stop)
