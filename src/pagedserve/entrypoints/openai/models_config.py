"""Which models a multi-model server serves (docs/multi-model.md): --model NAME=PATH,
every model in --models-dir, and an optional --models-config YAML file that gives a
model its own engine options and aliases:

    models:
      smol:
        path: /srv/models/SmolLM2-135M-Instruct.gguf
        aliases: [small, default]
        options: {max_model_len: 2048, kv_cache_memory: 256MiB}

Every problem (a name given twice, an unknown option, a value out of range) is a
ValueError at start-up, before anything is loaded.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ...engine_config import EngineConfig

_SPEC_KEYS = frozenset({"path", "aliases", "options"})


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    path: str
    aliases: tuple[str, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields over the server's

    def engine_config(self, base: EngineConfig) -> EngineConfig:
        return dataclasses.replace(base, model=self.path, **self.options)


def model_specs(named: dict[str, str], models_dir: str | None, config_file: str | None,
                base: EngineConfig) -> dict[str, ModelSpec]:
    """name -> spec, from the three sources in that order; ValueError for a name (or
    alias) given twice, a bad file, or options EngineConfig refuses."""
    specs: list[ModelSpec] = [ModelSpec(name, path) for name, path in named.items()]
    if models_dir is not None:
        specs += _directory_specs(models_dir)
    if config_file is not None:
        specs += _file_specs(config_file)
    if not specs:
        raise ValueError("no models: give --model NAME=PATH, --models-dir or --models-config")
    seen: set[str] = set()
    for spec in specs:
        for name in (spec.name, *spec.aliases):
            if name in seen:
                raise ValueError(f"model name {name!r} is given twice (--model, --models-dir, --models-config)")
            seen.add(name)
        try:
            spec.engine_config(base)
        except (TypeError, ValueError) as e:
            raise ValueError(f"model {spec.name!r}: {e}") from None
    return {spec.name: spec for spec in specs}


def _directory_specs(models_dir: str) -> list[ModelSpec]:
    """Every GGUF file and model folder in `models_dir`, named by its stem."""
    folder = Path(models_dir)
    if not folder.is_dir():
        raise ValueError(f"models_dir {models_dir!r} is not a directory")
    return [ModelSpec(entry.stem if entry.is_file() else entry.name, str(entry)) for entry in sorted(folder.iterdir())
            if (entry.is_file() and entry.suffix == ".gguf") or (entry.is_dir() and (entry / "config.json").is_file())]


def _file_specs(config_file: str) -> list[ModelSpec]:
    try:
        doc = yaml.safe_load(Path(config_file).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ValueError(f"models_config {config_file!r} cannot be read: {e}") from None
    models = doc.get("models") if isinstance(doc, dict) else None
    if not isinstance(models, dict) or not models:
        raise ValueError(f"models_config {config_file!r} must be a mapping with a non-empty 'models' mapping")
    specs = []
    for name, entry in models.items():
        where = f"models_config {config_file!r}: models.{name}"
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            raise ValueError(f"{where} must be a mapping with a 'path' string")
        unknown = set(entry) - _SPEC_KEYS
        if unknown:
            raise ValueError(f"{where} has unknown keys {sorted(unknown)} (known: {sorted(_SPEC_KEYS)})")
        aliases, options = entry.get("aliases") or [], entry.get("options") or {}
        if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
            raise ValueError(f"{where}.aliases must be a list of names")
        if not isinstance(options, dict) or "model" in options:
            raise ValueError(f"{where}.options must be a mapping of engine options other than model (use path)")
        specs.append(ModelSpec(str(name), entry["path"], tuple(aliases), dict(options)))
    return specs
