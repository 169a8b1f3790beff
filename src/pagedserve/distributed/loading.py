"""Load one rank's shard of a model, never the whole of it.

- GGUF with a converted cache entry (model/loader.py): the fused fp32 weights are
  memory-mapped and each rank copies out its rows/columns only; the rest stays unread
  in the shared page cache.
- GGUF without one: the file is read tensor by tensor, and each dequantised tensor is
  cut to the rank's shard at once (weights.hf_tensors_from_gguf's `select`), so a rank
  holds at most one full tensor at a time. No cache entry is written from a shard.
- safetensors: each tensor's slice is read through safe_open's get_slice.
Then the shard is fused, built (and prepacked for oneDNN) like a whole model, and its
row-parallel layers, embedding and head get their collectives (layers.parallelize).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..model.config import ModelConfig
from ..model.gguf_file import GGUFFile
from ..model.idefics3 import is_idefics3
from ..model.llama import LlamaModel
from ..model.loader import build_model, cached_gguf, gguf_cache_dir, resolve_model
from ..model.tokenizer import Tokenizer
from ..model.weights import fuse_hf_tensors, hf_tensors_from_gguf
from .group import TPGroup
from .layers import parallelize
from .sharding import TPShard


@dataclass
class LoadedShard:
    name: str
    config: ModelConfig  # the full model's
    model: LlamaModel  # this rank's shard, with its collectives
    tokenizer: Tokenizer | None  # only where asked for (rank 0)


def _safetensors_shard(folder, config: ModelConfig, rank: int, size: int) -> tuple[dict[str, torch.Tensor], TPShard]:
    from safetensors import safe_open

    shard = TPShard(config, rank, size)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                cut = shard.hf_slice(name)
                if cut is None:
                    out[name] = st.get_tensor(name).float()
                    continue
                part = st.get_slice(name)
                index = (slice(None),) * cut.dim + (slice(cut.start, cut.stop),)
                out[name] = cut.pad(part[index])
                del part
    return out, shard


def load_shard(model: str | None, rank: int, size: int, pack: bool | None = None, use_cache: bool = True,
               with_tokenizer: bool = False) -> tuple[LoadedShard, TPShard]:
    """Rank `rank` of `size` loads its shard of `model` (loader.resolve_model's argument)."""
    source = resolve_model(model)
    tokenizer = None
    if source.kind == "gguf":
        cached = cached_gguf(gguf_cache_dir(source.path), source.path) if use_cache else None
        if cached is not None and cached.state is not None:
            config, tokenizer = cached.config, cached.tokenizer
            shard = TPShard(config, rank, size)
            state = shard.shard_fused_state(cached.state)
            del cached
        else:
            gguf = GGUFFile(source.path)
            config = ModelConfig.from_gguf_metadata(gguf.metadata)
            probe = TPShard(config, rank, size)  # validates the split before anything is read
            hf = hf_tensors_from_gguf(gguf.tensors(), config, select=probe.shard_hf)
            config = dataclasses.replace(config, tie_word_embeddings="lm_head.weight" not in hf)
            shard = TPShard(config, rank, size)
            state = fuse_hf_tensors(hf, shard.local_config())
            if with_tokenizer:
                tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
    elif is_idefics3(source.path / "config.json"):
        raise ValueError(f"tensor_parallel_size: {source.name} is a vision-language model, which runs on one "
                         "rank only (tensor_parallel_size 1)")
    else:
        config = ModelConfig.from_hf_config(source.path / "config.json")
        hf, shard = _safetensors_shard(source.path, config, rank, size)
        state = fuse_hf_tensors(hf, shard.local_config())
        if with_tokenizer:
            tokenizer = Tokenizer.from_pretrained(source.path)
    return LoadedShard(source.name, config, build_model(shard.local_config(), state, pack=pack),
                       tokenizer if with_tokenizer else None), shard


def load_parallel_model(model: str | None, rank: int, size: int, join: Callable[[], TPGroup],
                        pack: bool | None = None, with_tokenizer: bool = False) -> tuple[LoadedShard, TPGroup]:
    """Load the shard, then `join()` the group and wire the shard's collectives: loading
    first lets every rank read its weights while the others are still starting."""
    loaded, shard = load_shard(model, rank, size, pack, with_tokenizer=with_tokenizer)
    group = join()
    parallelize(loaded.model, shard, group)
    return loaded, group
