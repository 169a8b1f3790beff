"""Tokenizer built from the GGUF, checked id for id against transformers' own GGUF conversion."""
from __future__ import annotations

import json
import unicodedata

import pytest

from pagedserve.model.tokenizer import (
    PRE_TOKENIZERS,
    Tokenizer,
    build_pre_tokenizer,
    byte_alphabet,
    load_tokenizer,
)

CORPUS = [
    "",
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "don't I'll we've they're it's HE'S",
    "こんにちは世界。中文字符测试，标点！한국어 텍스트",
    "Ελληνικά русский العربية हिन्दी ภาษาไทย",
    "emoji 😀👍🏽👨‍👩‍👧 🇫🇷 ❤️ 🤖",
    "ÀÉÎÕÜ ß ñ ø å œ ǅ",
    "12345 67890 3.14159 1,234,567 -42 +7 1e-10 0x1F",
    "year2024 v1.2.3 a1b2c3",
    "def f(x):\n    return x ** 2  # square\n\nclass A:\n\tpass\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "   leading spaces",
    "trailing spaces   ",
    "multiple     inner   spaces",
    "\n",
    " ",
    "\n\n\nparagraphs\n\n",
    "tabs\tand\t\ttabs",
    "windows\r\nline\r\nendings",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more",
    "<repo_name>pagedserve<file_sep>x.py",
    "almost special <|im_start and <im_end|>",
    "\u00a0non-breaking\u2009thin\u3000ideographic",
    "½ ² ⅷ ٣ ۴ १२३",
    "zero\u200bwidth\ufeffbom",
    "a  1",
    "x\n\n2024",
    "\t\t42",
    "pad   123 b",
]


def _is_number(char: str) -> bool:
    return unicodedata.category(char).startswith("N")


def _splits_differently_from_reference(text: str) -> bool:
    """Where isolating numbers first changes the pieces: a whitespace run before a
    number, or a space before a number that has a "Ġ<number>" token (like "Ġ²")."""
    return any(
        _is_number(char) and i >= 1 and text[i - 1].isspace()
        and (not char.isascii() or (i >= 2 and text[i - 2].isspace()))
        for i, char in enumerate(text)
    )


def _llamacpp_smollm_pieces(text: str) -> list[str]:
    """llama.cpp's first smollm split: every \\p{N} character isolated."""
    pieces, current = [], ""
    for char in text:
        if _is_number(char):
            pieces += [current, char] if current else [char]
            current = ""
        else:
            current += char
    return pieces + ([current] if current else [])


@pytest.fixture(scope="session")
def tokenizer(gguf_file):
    return Tokenizer.from_gguf(gguf_file)


@pytest.mark.parametrize("text", [t for t in CORPUS if not _splits_differently_from_reference(t)])
def test_ids_match_reference(tokenizer, hf_tokenizer, text):
    assert tokenizer.encode(text) == hf_tokenizer.encode(text)


@pytest.mark.parametrize("text", CORPUS)
def test_ids_follow_llamacpp_smollm_split(tokenizer, hf_tokenizer, text):
    """SmolLM cuts digits off first (llama.cpp, and the model's own tokenizer.json).

    transformers' GGUF conversion has no `smollm` entry and skips that step, which
    only changes whitespace runs before a digit ("a  1": "ĠĠ","1" here, "Ġ","Ġ","1"
    there; " ²": "Ġ","²" here, "Ġ²" there). The reference BPE applied to llama.cpp's
    pieces is the oracle for every text.
    """
    expected = [i for piece in _llamacpp_smollm_pieces(text) for i in hf_tokenizer.encode(piece)]
    assert tokenizer.encode(text) == expected


def test_space_run_before_digit_stays_one_token(tokenizer):
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("a  1")) == ["a", "ĠĠ", "1"]
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("\t\t42")) == ["ĉĉ", "4", "2"]
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("x ²")) == ["x", "Ġ", "Â²"]


@pytest.mark.parametrize("text", CORPUS)
def test_decode_inverts_encode(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_digit_runs_split_into_single_digits(tokenizer):
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("x 31415")) == ["x", "Ġ", "3", "1", "4", "1", "5"]


def test_special_token_text_encodes_to_its_single_id(tokenizer):
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tokenizer.token_to_id("<|im_start|>") == 1
    assert ids[-1] == tokenizer.token_to_id("<|im_end|>") == 2
    assert tokenizer.encode("<jupyter_code>") == [13]


def test_special_ids_and_sizes_match_reference(tokenizer, hf_tokenizer):
    assert tokenizer.vocab_size == len(hf_tokenizer) == 49152
    assert tokenizer.bos_token_id == hf_tokenizer.bos_token_id
    assert tokenizer.eos_token_id == hf_tokenizer.eos_token_id
    assert tokenizer.pad_token_id == hf_tokenizer.pad_token_id
    assert tokenizer.unk_token_id == hf_tokenizer.unk_token_id
    assert tokenizer.special_token_ids == frozenset(hf_tokenizer.all_special_ids) | set(range(17))


def test_stop_ids_are_eos_plus_end_of_turn_markers(tokenizer):
    # eos is <|im_end|>; <|endoftext|> also ends generation; <|im_start|> does not.
    assert tokenizer.stop_token_ids == frozenset({2, 0})


def test_no_bos_added_when_the_model_says_not_to(tokenizer):
    assert tokenizer.encode("hi") == tokenizer.encode("hi", add_special_tokens=False)


def test_bos_added_when_the_model_asks(gguf_file):
    metadata = dict(gguf_file.metadata)
    metadata["tokenizer.ggml.add_bos_token"] = True
    with_bos = Tokenizer.from_gguf_metadata(metadata)
    assert with_bos.encode("hi") == [1, *with_bos.encode("hi", add_special_tokens=False)]


@pytest.mark.parametrize("skip", [False, True])
def test_decode_matches_reference(tokenizer, hf_tokenizer, skip):
    ids = tokenizer.encode("<|im_start|>assistant\nSure, 123 😀<|im_end|>\n")
    assert tokenizer.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(ids, skip_special_tokens=skip)


def test_tokens_spelled_like_reference(tokenizer, hf_tokenizer):
    ids = tokenizer.encode("Hello, wörld 😀\n\t<|im_end|>")
    assert tokenizer.convert_ids_to_tokens(ids) == hf_tokenizer.convert_ids_to_tokens(ids)
    assert tokenizer.id_to_token(ids[0]) == "Hello"


def test_id_to_token_rejects_out_of_range(tokenizer):
    with pytest.raises(ValueError, match=r"token_id must be in \[0, 49152\)"):
        tokenizer.id_to_token(49152)


def test_encode_rejects_non_text(tokenizer):
    with pytest.raises(ValueError, match="text must be a str"):
        tokenizer.encode([1, 2])  # type: ignore[arg-type]


def test_byte_alphabet_spells_every_byte_visibly():
    alphabet = byte_alphabet()
    assert len(set(alphabet.values())) == 256
    assert alphabet[ord("a")] == "a" and alphabet[ord(" ")] == "Ġ" and alphabet[ord("\n")] == "Ċ"
    assert not any(char.isspace() for char in alphabet.values())


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("gpt2", ["x", "Ġ12345", "ĠĠ", "Ġ7"]),
        ("smollm", ["x", "Ġ", "1", "2", "3", "4", "5", "ĠĠĠ", "7"]),
        ("llama-bpe", ["x", "Ġ", "123", "45", "ĠĠ", "Ġ", "7"]),
        ("qwen2", ["x", "Ġ", "1", "2", "3", "4", "5", "ĠĠ", "Ġ", "7"]),
    ],
)
def test_pre_tokenizer_table_splits_digits_per_model(pre, pieces):
    assert [piece for piece, _ in build_pre_tokenizer(pre).pre_tokenize_str("x 12345   7")] == pieces


def test_pre_tokenizer_table_names():
    assert set(PRE_TOKENIZERS) == {"gpt2", "smollm", "llama-bpe", "qwen2"}


def test_unknown_pre_tokenizer_is_rejected(gguf_file):
    metadata = dict(gguf_file.metadata, **{"tokenizer.ggml.pre": "mystery"})
    with pytest.raises(ValueError, match=r"tokenizer.ggml.pre is 'mystery'; supported: gpt2, llama-bpe"):
        Tokenizer.from_gguf_metadata(metadata)


def test_non_bpe_gguf_is_rejected(gguf_file):
    metadata = dict(gguf_file.metadata, **{"tokenizer.ggml.model": "llama"})
    with pytest.raises(ValueError, match="tokenizer.ggml.model is 'llama'"):
        Tokenizer.from_gguf_metadata(metadata)


def test_saved_tokenizer_reloads_identically(tokenizer, tmp_path):
    tokenizer.save(tmp_path)
    reloaded = Tokenizer.from_pretrained(tmp_path)
    for text in CORPUS:
        assert reloaded.encode(text) == tokenizer.encode(text)
    assert (reloaded.bos_token_id, reloaded.eos_token_id, reloaded.pad_token_id, reloaded.unk_token_id) == (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id,
    )
    assert reloaded.stop_token_ids == tokenizer.stop_token_ids
    assert reloaded.special_token_ids == tokenizer.special_token_ids
    assert reloaded.chat_template == tokenizer.chat_template


def test_hf_folder_template_sources(tokenizer, tmp_path):
    tokenizer.save(tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["eos_token"] = {"content": "<|endoftext|>", "special": True}
    config["chat_template"] = [{"name": "default", "template": "named"}, {"name": "tool_use", "template": "t"}]
    config_path.write_text(json.dumps(config))
    folder = Tokenizer.from_pretrained(tmp_path)
    assert folder.eos_token_id == 0
    assert folder.chat_template == "named"
    (tmp_path / "chat_template.jinja").write_text("from jinja file")
    assert Tokenizer.from_pretrained(tmp_path).chat_template == "from jinja file"


def test_folder_without_tokenizer_json_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)


def test_load_tokenizer_reads_a_saved_folder(tokenizer, tmp_path):
    tokenizer.save(tmp_path)
    text = "cached 123 <|im_end|>"
    assert load_tokenizer(tmp_path).encode(text) == tokenizer.encode(text)


def test_load_tokenizer_rejects_other_paths(tmp_path):
    stray = tmp_path / "weights.bin"
    stray.write_bytes(b"")
    with pytest.raises(ValueError, match="model_path must be a .gguf file or a model folder"):
        load_tokenizer(stray)
