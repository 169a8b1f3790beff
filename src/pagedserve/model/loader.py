"""Resolve `--model` to files on disk and load the model fast.

Accepted: None (the embedded SmolLM2-135M-Instruct GGUF), a `.gguf` file, or a
Hugging Face folder (config.json + *.safetensors + tokenizer.json).

A GGUF's metadata costs seconds to read (the `gguf` reader parses the 49k-entry
vocabulary element by element), so the first load keeps what it found in a cache folder
keyed by a hash of the file's header: the model config, the tokenizer and the metadata
without the vocabulary arrays. Quantised matrices that a native kernel reads are then taken from
the file's memory map at every start (GGUFFile.tensors: no copy on disk); only a
model inflated to float32 (the torch kernels, or `gguf_weights="dense"`) also caches its
fused float32 weights there, memory-mapped back on later loads.
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

from .architectures import model_class
from .config import QUANTIZATION_CHOICES, ModelConfig
from .gguf_file import GGUFFile
from .idefics3 import (Idefics3Config, Idefics3Vision, build_vision, check_processor_seq_len, is_idefics3,
                       split_checkpoint)
from .llama import LlamaModel
from .sources import ModelSource, file_digest, gguf_cache_dir, resolve_model  # noqa: F401  (re-exported)
from .tokenizer import Tokenizer
from ..multimodal.idefics3_prompts import Idefics3Prompts
from ..multimodal.image_tiles import ImageTiling
from .weights import (fuse_gguf_blocks, fuse_hf_tensors, fuse_stored_halves, hf_tensors_from_gguf,
                      hf_tensors_from_safetensors)

logger = logging.getLogger(__name__)


def _metadata_without_vocab(meta: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in meta.items() if not isinstance(v, list) or len(v) < 1024}


@dataclass
class ConvertedGGUF:
    """What the engine needs from a GGUF, whether read now or from the cache."""

    config: ModelConfig
    state: dict[str, torch.Tensor] | None  # the fused float32 weights, once converted
    tokenizer: Tokenizer
    metadata: dict[str, Any]  # GGUF metadata (vocabulary arrays only when read fresh)
    cache_dir: Path
    from_cache: bool


def _weights_file(cache_dir: Path, path: Path) -> Path:
    """The float32 conversion of this very file (the folder is keyed by its header only)."""
    return cache_dir / f"weights-{file_digest(path)}.pt"


def cached_gguf(cache_dir: Path, path: Path | None = None) -> ConvertedGGUF | None:
    """A cache entry, or None if there is none; with `path`, its float32 weights memory-mapped
    where that file was converted before."""
    meta_file = cache_dir / "model.json"
    if not meta_file.is_file():  # entries appear whole (see _publish_cache)
        return None
    saved = json.loads(meta_file.read_text())
    config = ModelConfig(**saved["config"])
    weights = _weights_file(cache_dir, path) if path is not None else None
    state = torch.load(weights, mmap=True, weights_only=True) if weights is not None and weights.is_file() else None
    tokenizer = Tokenizer.from_pretrained(cache_dir / "tokenizer")
    return ConvertedGGUF(config, state, tokenizer, saved["metadata"], cache_dir, from_cache=True)


def gguf_header(path: Path, use_cache: bool = True, weights: bool = False,
                gguf: GGUFFile | None = None) -> ConvertedGGUF:
    """The config, tokenizer and metadata of a GGUF; with `weights`, its float32 conversion
    too where one is cached (else state None). `gguf`: the file already read, whose one
    header walk then serves the cache key too (each walk decodes the whole vocabulary)."""
    gguf = gguf if gguf is not None else GGUFFile(path)
    cache_dir = gguf_cache_dir(path, gguf.header_end)
    cached = cached_gguf(cache_dir, path if weights else None) if use_cache else None
    if cached is not None:
        return cached
    config = ModelConfig.from_gguf(gguf)
    tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
    if use_cache:
        _publish_cache(cache_dir, tokenizer, config, gguf.metadata)
    return ConvertedGGUF(config, None, tokenizer, gguf.metadata, cache_dir, from_cache=False)


def convert_gguf(path: Path, use_cache: bool = True) -> ConvertedGGUF:
    """The GGUF with its fused float32 weights (every matrix dequantised), cached."""
    gguf = GGUFFile(path)
    header = gguf_header(path, use_cache, weights=True, gguf=gguf)
    if header.state is not None:
        return header
    hf = hf_tensors_from_gguf(gguf.tensors(), header.config)
    state = fuse_hf_tensors(hf, header.config)
    if use_cache:
        _publish_weights(_weights_file(header.cache_dir, path), state)
    return dataclasses.replace(header, state=state)


def _publish_cache(cache_dir: Path, tokenizer: Tokenizer, config: ModelConfig, metadata: dict) -> None:
    """Write the entry into a private staging folder, then rename it into place: processes
    reading the same file at once never see half an entry."""
    staging = cache_dir.with_name(f"{cache_dir.name}.staging-{os.getpid()}")
    try:
        staging.mkdir(parents=True, exist_ok=True)
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


def _publish_weights(target: Path, state: dict[str, torch.Tensor]) -> None:
    """Readers see the whole file or none."""
    if not target.parent.is_dir():
        return
    staging = target.with_name(f"{target.name}.staging-{os.getpid()}")
    try:
        torch.save(state, staging)
        os.replace(staging, target)
    except OSError as e:
        logger.warning("could not write %s: %s", target, e)
        staging.unlink(missing_ok=True)


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
        model = model_class(config.architecture)(config)
    model.load_weights(state, pack=pack, quantization=quantization, qtypes=qtypes)
    return model.eval()


@dataclass
class LoadedModel:
    name: str
    source: ModelSource
    config: ModelConfig
    model: LlamaModel
    tokenizer: Tokenizer
    quantization: str = "none"  # what load_model built (QUANTIZATION_CHOICES)
    # A vision-language model's image encoder and prompt expansion (model/idefics3.py); None: text only.
    vision: Idefics3Vision | None = None
    image_prompts: Idefics3Prompts | None = None


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
    `keep_blocks` (quantization none, the native kernels): a GGUF's blocks, and the float16 /
    bfloat16 matrices of a GGUF or a safetensors folder, kept as stored and multiplied in
    fp32 (dequant_linear) instead of inflated to fp32 matrices: the same model, ~6x fewer
    weight bytes read per step with Q4_1, 2x with BF16. (F16 / BF16 GGUF tensors are kept
    with quantization gguf too, with fp32 activations: they have no int8 form.)"""
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {quantization!r}")
    source = resolve_model(model)
    if quantization == "gguf" and source.kind != "gguf":
        raise ValueError(f"quantization='gguf' keeps a GGUF file's blocks, but {source.path} is a {source.kind} model")
    qtypes = None
    if source.kind == "gguf" and (quantization == "gguf" or (keep_blocks and quantization == "none")):
        gguf = GGUFFile(source.path)
        header = gguf_header(source.path, use_cache=use_cache, gguf=gguf)
        config, tokenizer = header.config, header.tokenizer
        state, qtypes = fuse_gguf_blocks(gguf.tensors(), config)
    elif source.kind == "gguf":
        converted = convert_gguf(source.path, use_cache=use_cache)
        config, state, tokenizer = converted.config, converted.state, converted.tokenizer
    elif is_idefics3(source.path / "config.json"):
        return _load_idefics3(source, pack, quantization, keep_blocks)
    else:
        config = ModelConfig.from_hf_config(source.path / "config.json")
        state, qtypes = _fused_hf_state(hf_tensors_from_safetensors(source.path, as_stored=keep_blocks), config,
                                        keep_blocks and quantization == "none")
        tokenizer = Tokenizer.from_pretrained(source.path)
    built = build_model(config, state, pack=pack, quantization=quantization, qtypes=qtypes)
    return LoadedModel(source.name, source, config, built, tokenizer, quantization)


def _fused_hf_state(hf: dict[str, torch.Tensor], config: ModelConfig, keep_halves: bool
                    ) -> tuple[dict[str, torch.Tensor], dict[str, int] | None]:
    """A safetensors checkpoint's fused state (float16 / bfloat16 matrices kept as stored
    with `keep_halves`, else everything in float32) and the kept matrices' types."""
    if keep_halves:
        return fuse_stored_halves(hf, config)
    return fuse_hf_tensors({k: v.float() for k, v in hf.items()}, config), None


def _load_idefics3(source: ModelSource, pack: bool | None, quantization: str, keep_blocks: bool) -> LoadedModel:
    """An Idefics3 / SmolVLM folder: its text decoder built as a Llama, its vision tower and
    connector beside it, and the prompt expansion its processor files describe."""
    config_path = source.path / "config.json"
    vlm = Idefics3Config.from_hf(json.loads(config_path.read_text()), str(config_path))
    check_processor_seq_len(source.path, vlm.image_seq_len)
    text_hf, vision_hf = split_checkpoint(hf_tensors_from_safetensors(source.path, as_stored=keep_blocks))
    state, qtypes = _fused_hf_state(text_hf, vlm.text, keep_blocks and quantization == "none")
    tokenizer = Tokenizer.from_pretrained(source.path)
    prompts = Idefics3Prompts(ImageTiling.from_folder(source.path), vlm.image_seq_len, vlm.image_token_id,
                              lambda text: tokenizer.encode(text, add_special_tokens=False), tokenizer.token_to_id)
    built = build_model(vlm.text, state, pack=pack, quantization=quantization, qtypes=qtypes)
    return LoadedModel(source.name, source, vlm.text, built, tokenizer, quantization, build_vision(vlm, vision_hf),
                       prompts)
