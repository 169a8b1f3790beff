"""Where a model's files are: `--model` resolved, the GGUF conversion cache's folder, and
the tokenizer alone (a router needs it, not the weights). No torch here: reading these
must not cost a process the seconds importing torch takes.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from ..paths import cache_root
from .registry import DEFAULT_MODEL_NAME, default_model_path
from .tokenizer import Tokenizer, load_tokenizer

CACHE_FORMAT = 3  # bump when the cached layout changes (3: ModelConfig gained the MoE and Gemma/Phi-3 fields)


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "gguf" or "hf"
    path: Path
    name: str  # what /v1/models and logs call it


def resolve_model(model: str | os.PathLike | None) -> ModelSource:
    if model is None or str(model) == "":
        return ModelSource("gguf", default_model_path(), DEFAULT_MODEL_NAME)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", path, path.stem)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
            return ModelSource("hf", path, path.name)
        if len(ggufs) == 1:
            return ModelSource("gguf", ggufs[0], ggufs[0].stem)
    raise FileNotFoundError(
        f"model {str(model)!r} not found: looked for a .gguf file at {path}, or a folder with config.json and "
        "*.safetensors (and tokenizer.json), or a folder holding exactly one .gguf file. "
        "pagedserve never downloads models; omit --model to use the embedded SmolLM2-135M-Instruct."
    )


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()[:24]


def header_digest(path: Path, header_end: int | None = None) -> str:
    """sha256 of a GGUF's size and header: what its cached config, tokenizer and metadata
    come from, read in milliseconds where hashing a 1B model's whole file takes ~0.8 s.
    `header_end`: where the header ends, from a walk the caller made (else walked here)."""
    from .gguf_file import header_bytes

    h = hashlib.sha256(str(path.stat().st_size).encode())
    with open(path, "rb") as f:
        h.update(f.read(header_bytes(path) if header_end is None else header_end))
    return h.hexdigest()[:24]


def gguf_cache_dir(path: Path, header_end: int | None = None) -> Path:
    """The folder the loader keeps a GGUF's header in (keyed by it; a float32 conversion of
    the weights inside is keyed by the whole file: loader.convert_gguf)."""
    return cache_root() / f"v{CACHE_FORMAT}-{header_digest(path, header_end)}"


def load_model_tokenizer(model: str | os.PathLike | None) -> Tokenizer:
    """The tokenizer of `--model` without its weights: from the GGUF conversion cache
    once a server has loaded the model (milliseconds), else parsed from the file (seconds)."""
    source = resolve_model(model)
    if source.kind == "gguf":
        cache_dir = gguf_cache_dir(source.path)
        if (cache_dir / "model.json").is_file():  # entries appear whole
            return Tokenizer.from_pretrained(cache_dir / "tokenizer")
    return load_tokenizer(source.path)
