"""Resolve `--model` to files on disk and load the model fast.

Accepted: None (the embedded SmolLM2-135M-Instruct GGUF), a `.gguf` file, or a
Hugging Face folder (config.json + *.safetensors + tokenizer.json).

Reading a GGUF costs seconds (the `gguf` reader parses the 49k-entry vocabulary
element by element, then every tensor is dequantised), so the first load converts
the file once into a cache folder keyed by the file's content hash: the fused
float32 weights (memory-mapped back on later loads), the model config and the
model's GGUF metadata without the vocabulary arrays.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .config import QUANTIZATION_CHOICES, ModelConfig
from .gguf_file import GGUFFile
from .llama import LlamaModel
from .sources import ModelSource, file_digest, gguf_cache_dir, resolve_model  # noqa: F401  (re-exported)
from .tokenizer import Tokenizer
from .weights import fuse_gguf_blocks, fuse_hf_tensors, hf_tensors_from_gguf, hf_tensors_from_safetensors

logger = logging.getLogger(__name__)

def _metadata_without_vocab(meta: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in meta.items() if not isinstance(v, list) or len(v) < 1024}


@dataclass
class ConvertedGGUF:
    """What the engine needs from a GGUF, whether read now or from the cache."""

    config: ModelConfig
    state: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    metadata: dict[str, Any]  # GGUF metadata (vocabulary arrays only when read fresh)
    cache_dir: Path
    from_cache: bool




def cached_gguf(cache_dir: Path) -> ConvertedGGUF | None:
    """A converted cache entry (weights memory-mapped), or None if there is none."""
    meta_file = cache_dir / "model.json"
    if not meta_file.is_file():  # entries appear whole (see _publish_cache)
        return None
    saved = json.loads(meta_file.read_text())
    config = ModelConfig(**saved["config"])
    state = torch.load(cache_dir / "weights.pt", mmap=True, weights_only=True)
    tokenizer = Tokenizer.from_pretrained(cache_dir / "tokenizer")
    return ConvertedGGUF(config, state, tokenizer, saved["metadata"], cache_dir, from_cache=True)


def convert_gguf(path: Path, use_cache: bool = True) -> ConvertedGGUF:
    cache_dir = gguf_cache_dir(path)
    cached = cached_gguf(cache_dir) if use_cache else None
    if cached is not None:
        return cached
    gguf = GGUFFile(path)
    config = ModelConfig.from_gguf_metadata(gguf.metadata)
    hf = hf_tensors_from_gguf(gguf, config)
    config = dataclasses.replace(config, tie_word_embeddings="lm_head.weight" not in hf)
    state = fuse_hf_tensors(hf, config)
    tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
    if use_cache:
        _publish_cache(cache_dir, state, tokenizer, config, gguf.metadata)
    return ConvertedGGUF(config, state, tokenizer, gguf.metadata, cache_dir, from_cache=False)


def _publish_cache(cache_dir: Path, state, tokenizer: Tokenizer, config: ModelConfig, metadata: dict) -> None:
    """Write the converted model into a private staging folder, then rename it into
    place: processes converting the same file at once never see half an entry."""
    staging = cache_dir.with_name(f"{cache_dir.name}.staging-{os.getpid()}")
    try:
        staging.mkdir(parents=True, exist_ok=True)
        torch.save(state, staging / "weights.pt")
        tokenizer.save(staging / "tokenizer")
        (staging / "model.json").write_text(
            json.dumps({"config": config.to_dict(), "metadata": _metadata_without_vocab(metadata)})
        )
        os.rename(staging, cache_dir)
    except OSError as e:  # another process published first, or a read-only home
        if not (cache_dir / "model.json").is_file():
            logger.warning("could not write the model cache at %s: %s", cache_dir, e)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def gguf_blocks(path: Path, config: ModelConfig, cache_dir: Path, use_cache: bool = True) -> dict[str, Any]:
    """{"state": the fused state with quantised matrices in their GGUF blocks, "qtypes":
    their GGML types} (weights.fuse_gguf_blocks), cached next to the fp32 conversion: it
    needs the file parsed again, which costs seconds."""
    blocks_file = cache_dir / "blocks.pt"
    if use_cache and blocks_file.is_file():
        return torch.load(blocks_file, mmap=True, weights_only=True)
    state, qtypes = fuse_gguf_blocks(GGUFFile(path), config)
    entry = {"state": state, "qtypes": qtypes}
    if use_cache and cache_dir.is_dir():
        staging = blocks_file.with_name(f"blocks.pt.staging-{os.getpid()}")
        try:
            torch.save(entry, staging)
            os.replace(staging, blocks_file)  # readers see the whole file or none
        except OSError as e:
            logger.warning("could not write %s: %s", blocks_file, e)
            staging.unlink(missing_ok=True)
    return entry


def build_model(
    config: ModelConfig,
    state: dict[str, torch.Tensor],
    pack: bool | None = None,
    quantization: str = "none",
    qtypes: dict[str, int] | None = None,
) -> LlamaModel:
    """`pack`: prepack linear weights for oneDNN (LlamaModel.load_weights); default when available.
    `quantization`, `qtypes`: see LlamaModel.load_weights."""
    with torch.device("meta"):
        model = LlamaModel(config)
    model.load_weights(state, pack=pack, quantization=quantization, qtypes=qtypes)
    return model.eval()


@dataclass
class LoadedModel:
    name: str
    source: ModelSource
    config: ModelConfig
    model: LlamaModel
    tokenizer: Tokenizer


def load_model(
    model: str | os.PathLike | None = None,
    use_cache: bool = True,
    pack: bool | None = None,
    quantization: str = "none",
    keep_blocks: bool = False,
) -> LoadedModel:
    """`pack`: prepack linear weights for oneDNN (build_model); default when available.
    `quantization`: none (fp32), q8_0 / q4_0 / q4_1 (quantised from fp32 at load), or gguf
    (a GGUF's matrices kept in the file's own blocks where a native kernel reads them).
    `keep_blocks` (quantization none, a GGUF file, the native kernels): the same blocks kept,
    multiplied in fp32 (dequant_linear) instead of inflated to fp32 matrices: the same
    model, ~6x fewer weight bytes read per step with Q4_1; ignored for other sources."""
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {quantization!r}")
    source = resolve_model(model)
    if quantization == "gguf" and source.kind != "gguf":
        raise ValueError(f"quantization='gguf' keeps a GGUF file's blocks, but {source.path} is a {source.kind} model")
    qtypes = None
    if source.kind == "gguf":
        converted = convert_gguf(source.path, use_cache=use_cache)
        config, state, tokenizer = converted.config, converted.state, converted.tokenizer
        if quantization == "gguf" or (keep_blocks and quantization == "none"):
            entry = gguf_blocks(source.path, config, converted.cache_dir, use_cache=use_cache)
            state, qtypes = entry["state"], entry["qtypes"]
    else:
        config = ModelConfig.from_hf_config(source.path / "config.json")
        state = fuse_hf_tensors(hf_tensors_from_safetensors(source.path), config)
        tokenizer = Tokenizer.from_pretrained(source.path)
    built = build_model(config, state, pack=pack, quantization=quantization, qtypes=qtypes)
    return LoadedModel(source.name, source, config, built, tokenizer)
