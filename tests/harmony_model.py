"""Tiny gpt-oss-like models that speak harmony, for the server tests: SmolLM2's tokenizer
with harmony's special tokens added, harmony's chat template (model/harmony_template.py)
and a bigram table for weights (tests/reasoning_model.py), so each model's reply to any
chat prompt (which ends in `<|start|>assistant`) is known:

- ANSWER_MODEL reasons in `analysis`, then answers in `final` and stops on `<|return|>`;
- CALL_MODEL reasons, then calls get_weather in `commentary` and stops on `<|call|>`.

A bigram model cannot write a token twice, and both replies have two message headers:
the second header's `<|channel|>` and `<|message|>` are written as ordinary tokens added
for it (`<|chan` ...) whose text is the same, which is all the server's parser sees (the
prompt's markers still encode as the special tokens, which match first).
"""
from __future__ import annotations

from pathlib import Path

from safetensors.torch import save_file
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from pagedserve.model.harmony_template import harmony_chat_template
from pagedserve.model.registry import default_model_path
from pagedserve.model.tokenizer import Tokenizer, load_tokenizer
from reasoning_model import HIDDEN, _bigram_weights, write_bigram_config

SPECIAL_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
REASONING = "The user greets."
ANSWER = "Hello!"
CALL_REASONING = "Need a forecast!"
CALL_NAME = "get_weather"
CALL_ARGUMENTS = '{"city": "Paris"}'
# A reply: text the tokenizer encodes, and tuples of ordinary tokens added to spell a marker again.
ANSWER_MODEL = ("<|channel|>analysis<|message|>", REASONING, "<|end|>", ("<|chan", "nel|>final", "<|mess", "age|>"),
                ANSWER, "<|return|>")
CALL_MODEL = ("<|channel|>analysis<|message|>", CALL_REASONING, "<|end|>", ("<|chan", "nel|>commentary"),
              f" to=functions.{CALL_NAME} ", "<|constrain|>json", ("<|mess", "age|>"), CALL_ARGUMENTS, "<|call|>")
WEATHER_TOOL = {"type": "function", "function": {
    "name": CALL_NAME, "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def write_harmony_model(folder: Path, reply: tuple[str | tuple[str, ...], ...]) -> Path:
    """Write the model whose reply is `reply` (ANSWER_MODEL or CALL_MODEL) into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    load_tokenizer(default_model_path()).with_chat_template(harmony_chat_template()).save(folder)
    backend = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    backend.add_special_tokens([AddedToken(token, normalized=False, special=True) for token in SPECIAL_TOKENS])
    spelled = [piece for item in reply if isinstance(item, tuple) for piece in item]
    backend.add_tokens([AddedToken(piece, normalized=False, special=False) for piece in spelled])
    backend.save(str(folder / "tokenizer.json"))
    tokenizer = load_tokenizer(folder)
    chain = tokenizer.encode("<|start|>assistant", add_special_tokens=False)[-1:]
    for item in reply:
        if isinstance(item, tuple):
            chain += [backend.token_to_id(piece) for piece in item]
        else:
            chain += tokenizer.encode(item, add_special_tokens=False)
    assert len(set(chain)) == len(chain) <= HIDDEN, "every token of the chain must be its own"
    vocab_size = backend.get_vocab_size(with_added_tokens=True)
    save_file(_bigram_weights([chain], vocab_size), folder / "model.safetensors")
    write_bigram_config(folder, vocab_size, tokenizer.eos_token_id)
    return folder


def tokens_of(folder: Path, text: str) -> int:
    """How many tokens `text` encodes to with the model's tokenizer."""
    return len(Tokenizer.from_pretrained(folder).encode(text, add_special_tokens=False))
