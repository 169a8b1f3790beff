"""What Ollama's /api/tags, /api/show and /api/ps say about a served model, read from
its engine: the files' size and time, the architecture's numbers, the capabilities the
server's flags give it.

`digest` is Ollama's content address of a model; hashing a multi-GiB file on every
listing is not worth it, so here it is the sha256 of the model's path, size and
modification time: stable while the file is unchanged, never a content hash.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ...engine.llm_engine import LLMEngine


def iso_time(seconds: float) -> str:
    """An epoch time as Ollama writes times: RFC 3339 in UTC."""
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat().replace("+00:00", "Z")


def file_facts(path: str | Path) -> tuple[int, float, str]:
    """A model's files' total size, newest modification time and digest (zeros and the
    path's digest when they cannot be read)."""
    path = Path(path)
    try:
        files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
        stats = [f.stat() for f in files]
    except OSError:
        stats = []
    size = sum(s.st_size for s in stats)
    modified = max((s.st_mtime for s in stats), default=0.0)
    return size, modified, hashlib.sha256(f"{path}:{size}:{modified}".encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class OllamaModelInfo:
    """One served model as Ollama's listing routes describe it."""

    name: str
    size: int  # bytes of its files
    modified: float  # the newest file's modification time
    digest: str
    details: dict[str, Any]
    model_info: dict[str, Any]
    template: str
    capabilities: list[str]
    context_length: int

    @classmethod
    def of(cls, name: str, engine: LLMEngine, context_length: int, tools: bool, thinking: bool) -> OllamaModelInfo:
        """`tools` / `thinking`: whether the server parses tool calls / splits reasoning."""
        loaded = engine.loaded
        size, modified, digest = file_facts(loaded.source.path)
        config = loaded.config
        arch = config.architecture
        details = {"parent_model": "", "format": "gguf" if loaded.source.kind == "gguf" else "safetensors",
                   "family": arch, "families": [arch], "quantization_level": loaded.quantization}
        model_info = {"general.architecture": arch, f"{arch}.context_length": context_length,
                      f"{arch}.embedding_length": config.hidden_size, f"{arch}.block_count": config.num_layers,
                      f"{arch}.feed_forward_length": config.intermediate_size,
                      f"{arch}.attention.head_count": config.num_heads,
                      f"{arch}.attention.head_count_kv": config.num_kv_heads, f"{arch}.vocab_size": config.vocab_size}
        task = engine.config.serving.task
        capabilities = (["completion"] * (task != "embed") + ["embedding"] * (task != "generate")
                        + ["tools"] * (tools and task != "embed") + ["thinking"] * (thinking and task != "embed"))
        return cls(name, size, modified, digest, details, model_info, loaded.tokenizer.chat_template or "",
                   capabilities, context_length)

    def tag(self) -> dict[str, Any]:
        """Its /api/tags entry."""
        return {"name": self.name, "model": self.name, "modified_at": iso_time(self.modified), "size": self.size,
                "digest": self.digest, "details": self.details}

    def show(self) -> dict[str, Any]:
        """Its /api/show answer."""
        return {"modelfile": "", "parameters": "", "template": self.template, "details": self.details,
                "model_info": self.model_info, "capabilities": self.capabilities,
                "modified_at": iso_time(self.modified)}

    def running(self, expires_at: str | None, size_vram: int) -> dict[str, Any]:
        """Its /api/ps entry."""
        return {**self.tag(), "expires_at": expires_at, "size_vram": size_vram, "context_length": self.context_length}
