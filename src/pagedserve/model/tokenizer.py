"""The tokenizer: a `tokenizers.Tokenizer` plus the special-token facts the engine needs.

Sources (the `Tokenizer.from_*` constructors, or `load_tokenizer` for any of them):

- a GGUF file: byte-level BPE (``tokenizer.ggml.model == "gpt2"``) rebuilt from the
  vocabulary, merges and token types llama.cpp stores as metadata;
- a Hugging Face model folder: ``tokenizer.json`` plus ``tokenizer_config.json``
  (special tokens, chat template) and ``chat_template.jinja`` when present;
- a folder written by `Tokenizer.save`, which is the same format, so a GGUF is
  converted once (~4 s to read the GGUF) and later starts load only the JSON (~0.15 s).
"""
from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from pagedserve.model.chat_template import ChatTemplate, read_chat_template_file
from pagedserve.model.gguf_file import GGUFFile
from pagedserve.model.harmony_template import HARMONY_STOP_MARKERS, default_chat_template, is_harmony_vocabulary

# GGUF token types (llama.cpp's llama_token_type).
_GGUF_CONTROL = 3
_GGUF_USER_DEFINED = 4

# Split regexes llama.cpp applies, one after the other, before byte-level BPE
# (src/llama-vocab.cpp, per `tokenizer.ggml.pre`). Merges were learned on these
# pieces, so a different split gives different ids.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True, slots=True)
class PreTokenizerSpec:
    splits: tuple[str, ...]
    # llama.cpp (and Llama 3's tokenizer.json) take a piece that is already a
    # vocabulary entry whole instead of replaying the merges on it.
    ignore_merges: bool = False


# `tokenizer.ggml.pre` -> how text is cut before BPE.
#   gpt2:      the GPT-2 regex.
#   smollm:    every digit on its own first (StarCoder style; the SmolLM vocabulary has
#              no multi-digit token), then the GPT-2 regex. Differs from plain gpt2 on
#              whitespace runs before a digit: "a  1" -> "a", "  ", "1".
#   llama-bpe: Llama 3's regex (digits in groups of up to three), merges ignored for
#              pieces already in the vocabulary.
#   qwen2:     Qwen2's regex (single digits, letters keep one leading non-letter).
PRE_TOKENIZERS: dict[str, PreTokenizerSpec] = {
    "gpt2": PreTokenizerSpec((_GPT2_SPLIT,)),
    "smollm": PreTokenizerSpec((r"\p{N}", _GPT2_SPLIT)),
    "llama-bpe": PreTokenizerSpec((_LLAMA3_SPLIT,), ignore_merges=True),
    "qwen2": PreTokenizerSpec((_QWEN2_SPLIT,)),
}

# Stop-id rule: the model's EOS plus every *special* token whose text is one of
# these end-of-turn / end-of-text markers (the set llama.cpp treats as
# end-of-generation). A chat model may end a turn with any of them. A harmony vocabulary
# stops on HARMONY_STOP_MARKERS instead (model/harmony_template.py).
END_OF_GENERATION_MARKERS = frozenset({
    "<|im_end|>", "<|endoftext|>", "<|end_of_text|>", "<|eot_id|>", "<|eom_id|>",
    "<|end|>", "<end_of_turn>", "<end_of_utterance>", "<EOT>", "</s>",
})

_CONFIG_FILE = "tokenizer_config.json"
_TOKENIZER_FILE = "tokenizer.json"
_TEMPLATE_FILE = "chat_template.jinja"
_SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
_SPECIAL_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table used to spell byte-level tokens.

    Printable Latin-1 bytes stand for themselves; the remaining 68 bytes
    (controls, space, 0x7F-0xA0, 0xAD) take the code points from U+0100 on, in
    byte order, so every token is a visible, whitespace-free string.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in printable}
    others = (b for b in range(256) if b not in table)
    table.update({b: chr(0x100 + n) for n, b in enumerate(others)})
    return dict(sorted(table.items()))


@contextlib.contextmanager
def _malformed(what: str) -> Iterator[None]:
    """Any error building a tokenizer from `what` as a ValueError that says so: the files
    come from the user's download, and a KeyError or the `tokenizers` library's bare
    Exception would read as a bug in pagedserve."""
    try:
        yield
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - `tokenizers` raises plain Exception
        raise ValueError(f"{what}: malformed ({type(e).__name__}: {e})") from e


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _special_content(value: Any) -> str | None:
    # tokenizer_config.json writes a special token as a string or as an AddedToken dict.
    if isinstance(value, Mapping):
        return value.get("content")
    return value


def _config_chat_template(config: Mapping[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {entry["name"]: entry["template"] for entry in template}
        return named.get("default")
    return template


class Tokenizer:
    """Encode, decode, special tokens, stop ids and the chat template of one model."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        pad_token_id: int | None,
        unk_token_id: int | None,
        chat_template: str | None,
    ):
        self._backend = backend
        self._bos, self._eos, self._pad, self._unk = bos_token_id, eos_token_id, pad_token_id, unk_token_id
        self._chat_template_source = chat_template
        self._chat_template: ChatTemplate | None = None  # compiled on first use
        specials = {
            token_id: added.content
            for token_id, added in backend.get_added_tokens_decoder().items()
            if added.special
        }
        markers = HARMONY_STOP_MARKERS if is_harmony_vocabulary(set(specials.values())) else END_OF_GENERATION_MARKERS
        stop = {token_id for token_id, text in specials.items() if text in markers}
        if eos_token_id is not None:
            stop.add(eos_token_id)
        self._stop_ids = frozenset(stop)
        self._special_ids = frozenset(specials)

    # ------------------------------------------------------------------ loaders
    @classmethod
    def from_gguf(cls, gguf: str | Path | GGUFFile) -> Tokenizer:
        """Build from a GGUF path or an opened `GGUFFile`."""
        if not isinstance(gguf, GGUFFile):
            gguf = GGUFFile(gguf)
        return cls.from_gguf_metadata(gguf.metadata)

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF metadata already read (it must include the vocabulary arrays)."""
        with _malformed("the GGUF's tokenizer metadata"):
            backend = _backend_from_gguf(metadata)
            num_tokens = len(metadata["tokenizer.ggml.tokens"])
            special_ids = {}
            for name, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown")):
                token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
                in_vocab = token_id is not None and 0 <= token_id < num_tokens
                special_ids[f"{name}_token_id"] = int(token_id) if in_vocab else None
        template = metadata.get("tokenizer.chat_template") or default_chat_template(metadata.get("general.architecture"))
        return cls(backend, chat_template=template, **special_ids)

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> Tokenizer:
        """Load a Hugging Face model folder, or one written by `save`."""
        directory = Path(directory)
        tokenizer_file = directory / _TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise ValueError(f"directory {str(directory)!r} has no {_TOKENIZER_FILE}")
        with _malformed(f"{directory}'s tokenizer files"):
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
            # Older folders name their special tokens only in special_tokens_map.json.
            config = {**_read_json(directory / _SPECIAL_TOKENS_MAP_FILE), **_read_json(directory / _CONFIG_FILE)}
        template_file = directory / _TEMPLATE_FILE
        template = (
            template_file.read_text(encoding="utf-8")
            if template_file.is_file()
            else _config_chat_template(config)
        )
        if not template:  # a gpt-oss folder without a template gets harmony's
            template = default_chat_template(_read_json(directory / "config.json").get("model_type"))

        def special_id(name: str) -> int | None:
            content = _special_content(config.get(name))
            return backend.token_to_id(content) if content is not None else None

        return cls(
            backend,
            bos_token_id=special_id("bos_token"),
            eos_token_id=special_id("eos_token"),
            pad_token_id=special_id("pad_token"),
            unk_token_id=special_id("unk_token"),
            chat_template=template,
        )

    def with_chat_template(self, source: str) -> Tokenizer:
        """The same tokenizer with a server-side chat template in place of the model's."""
        return Tokenizer(
            self._backend,
            bos_token_id=self._bos,
            eos_token_id=self._eos,
            pad_token_id=self._pad,
            unk_token_id=self._unk,
            chat_template=source,
        )

    def save(self, directory: str | Path) -> None:
        """Write ``tokenizer.json`` and a ``tokenizer_config.json`` sidecar (HF layout)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(directory / _TOKENIZER_FILE))
        ids = dict(zip(_SPECIAL_NAMES, (self._bos, self._eos, self._pad, self._unk)))
        config: dict[str, Any] = {
            name: self.id_to_token(token_id) for name, token_id in ids.items() if token_id is not None
        }
        if self._chat_template_source is not None:
            config["chat_template"] = self._chat_template_source
        (directory / _CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")

    # ------------------------------------------------------------------ encode / decode
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token text inside it maps to the single special id.

        `add_special_tokens` adds BOS/EOS only where the model asks for them
        (GGUF `add_bos_token` / the tokenizer.json post-processor).
        """
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        try:
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:
            # `tokenizers` takes only valid Unicode; a lone surrogate ("\\ud800") is the one way a str is not.
            raise ValueError("text is not valid Unicode (it holds an unpaired surrogate)") from None

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary spelling of one id (byte-level form, e.g. ``Ġthe``)."""
        token = self._backend.id_to_token(token_id)
        if token is None:
            raise ValueError(f"token_id must be in [0, {self.vocab_size}), got {token_id}")
        return token

    def convert_ids_to_tokens(self, token_ids: Iterable[int]) -> list[str]:
        return [self.id_to_token(token_id) for token_id in token_ids]

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    # ------------------------------------------------------------------ facts
    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._backend

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def eos_token_id(self) -> int | None:
        return self._eos

    @property
    def pad_token_id(self) -> int | None:
        return self._pad

    @property
    def unk_token_id(self) -> int | None:
        return self._unk

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """Ids a chat model stops on: see `END_OF_GENERATION_MARKERS`."""
        return self._stop_ids

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids that `skip_special_tokens=True` drops from decoded text."""
        return self._special_ids

    @property
    def chat_template(self) -> str | None:
        return self._chat_template_source

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        image_placeholder: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render OpenAI-style `messages` with the model's template (see `ChatTemplate`);
        image parts become `image_placeholder` (None: they are refused)."""
        if self._chat_template is None:
            if self._chat_template_source is None:
                raise ValueError(
                    "this model has no chat template; pass a server-side template file "
                    "(load_tokenizer(..., chat_template_path=...)) or use the completions API"
                )
            specials = dict(zip(_SPECIAL_NAMES, (self._bos, self._eos, self._pad, self._unk)))
            self._chat_template = ChatTemplate(
                self._chat_template_source,
                special_tokens={
                    name: self.id_to_token(token_id) for name, token_id in specials.items() if token_id is not None
                },
            )
        return self._chat_template.render(
            messages, add_generation_prompt=add_generation_prompt, tools=tools,
            image_placeholder=image_placeholder, **template_kwargs
        )


# ---------------------------------------------------------------------- GGUF conversion
def _pre_tokenizer_spec(pre: Any) -> PreTokenizerSpec:
    spec = PRE_TOKENIZERS.get(pre)
    if spec is None:
        raise ValueError(f"tokenizer.ggml.pre is {pre!r}; supported: {', '.join(sorted(PRE_TOKENIZERS))}")
    return spec


def build_pre_tokenizer(pre: str | PreTokenizerSpec) -> pre_tokenizers.PreTokenizer:
    """The llama.cpp split for `pre` (a `PRE_TOKENIZERS` name), then byte-level spelling."""
    spec = pre if isinstance(pre, PreTokenizerSpec) else _pre_tokenizer_spec(pre)
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in spec.splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


def _backend_from_gguf(metadata: Mapping[str, Any]) -> tokenizers.Tokenizer:
    model_type = metadata.get("tokenizer.ggml.model")
    if model_type != "gpt2":
        raise ValueError(
            f"tokenizer.ggml.model is {model_type!r}; only byte-level BPE ('gpt2') GGUF tokenizers are supported"
        )
    spec = _pre_tokenizer_spec(metadata.get("tokenizer.ggml.pre"))
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(merge.split(" ")) for merge in metadata["tokenizer.ggml.merges"]]
    bad = next((m for m in merges if len(m) != 2), None)
    if bad is not None:
        raise ValueError(f"tokenizer.ggml.merges entries must be 'left right', got {' '.join(bad)!r}")

    alphabet = byte_alphabet()
    spelled = set(alphabet.values())
    added_types = (_GGUF_CONTROL, _GGUF_USER_DEFINED)

    def vocab_key(token: str, token_type: int) -> str:
        # Control and user-defined tokens are stored as raw text and matched as
        # raw text; a normal token outside the byte alphabet is raw text that
        # BPE can only reach through its byte spelling.
        if token_type in added_types or set(token) <= spelled:
            return token
        return "".join(alphabet[b] for b in token.encode("utf-8"))

    vocab = {vocab_key(token, kind): index for index, (token, kind) in enumerate(zip(tokens, token_types))}
    backend = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=merges, ignore_merges=spec.ignore_merges, fuse_unk=False)
    )
    backend.pre_tokenizer = build_pre_tokenizer(spec)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([
        AddedToken(token, special=True, normalized=False)
        for token, kind in zip(tokens, token_types)
        if kind == _GGUF_CONTROL
    ])
    backend.add_tokens([
        AddedToken(token, special=False, normalized=False)
        for token, kind in zip(tokens, token_types)
        if kind == _GGUF_USER_DEFINED
    ])
    post = _bos_eos_processor(metadata, tokens)
    if post is not None:
        backend.post_processor = post
    return backend


def _bos_eos_processor(metadata: Mapping[str, Any], tokens: list[str]) -> processors.TemplateProcessing | None:
    """BOS/EOS around each encoded text, as `add_bos_token`/`add_eos_token` say (absent = no)."""
    ends = []
    for flag, key in (("add_bos_token", "bos_token_id"), ("add_eos_token", "eos_token_id")):
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if metadata.get(f"tokenizer.ggml.{flag}", False) and token_id is not None:
            ends.append((tokens[token_id], token_id))
        else:
            ends.append(None)
    bos, eos = ends
    if bos is None and eos is None:
        return None
    template = " ".join([*([bos[0]] if bos else []), "$A", *([eos[0]] if eos else [])])
    return processors.TemplateProcessing(single=template, special_tokens=[end for end in ends if end])


# ---------------------------------------------------------------------- one entry point
def load_tokenizer(model_path: str | Path, *, chat_template_path: str | Path | None = None) -> Tokenizer:
    """The tokenizer for a `.gguf` file or a model folder (HF layout, or one written by `save`).

    `chat_template_path` replaces the model's chat template with a server-side file.
    Caching a GGUF's conversion is the model loader's job: `save` into its cache
    folder, `Tokenizer.from_pretrained` from there.
    """
    path = Path(model_path)
    if path.is_dir():
        tokenizer = Tokenizer.from_pretrained(path)
    elif path.is_file() and path.suffix == ".gguf":
        tokenizer = Tokenizer.from_gguf(path)
    else:
        raise ValueError(f"model_path must be a .gguf file or a model folder, got {str(path)!r}")
    if chat_template_path is not None:
        tokenizer = tokenizer.with_chat_template(read_chat_template_file(chat_template_path))
    return tokenizer
