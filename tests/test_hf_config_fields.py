"""No config.json field is silently ignored: for each architecture pagedserve loads from HF
folders, every field of transformers' config class is read by the config loader, listed as
inert (model/refused_fields.py, with why), or refused at a value pagedserve does not implement."""
from __future__ import annotations

from typing import Any

import pytest

from pagedserve.model import variants
from pagedserve.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from pagedserve.model.refused_fields import INERT, NEUTRAL, READ_BY

transformers = pytest.importorskip("transformers")
from transformers import CONFIG_MAPPING  # noqa: E402

# HF model_types pagedserve loads: its architecture names transformers knows, but where a
# name maps from another model_type (gemma3_text -> gemma3), that other one.
HF_MODEL_TYPES = sorted({*(a for a in SUPPORTED_ARCHITECTURES if a in CONFIG_MAPPING
                           and a not in variants.HF_MODEL_TYPES.values()), *variants.HF_MODEL_TYPES})
# A value of each NEUTRAL field that changes transformers' arithmetic.
CHANGING = {"mlp_bias": True, "attention_bias": True, "hidden_act": "gelu", "partial_rotary_factor": 0.5,
            "use_bidirectional_attention": True}


class ReadRecorder(dict):
    """config.json as a dict that records each key the loader looks up."""

    def __init__(self, *args: Any):
        super().__init__(*args)
        self.read: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.read.add(str(key))
        return super().__contains__(key)


def default_config(model_type: str) -> dict[str, Any]:
    return CONFIG_MAPPING[model_type]().to_dict()


def test_every_architecture_is_walked():
    assert {"llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "olmoe", "phi3", "gemma2",
            "gemma3_text", "gpt_oss"} <= set(HF_MODEL_TYPES)


@pytest.mark.parametrize("model_type", HF_MODEL_TYPES)
def test_every_field_is_read_inert_or_refused(model_type):
    cfg = ReadRecorder(default_config(model_type))
    ModelConfig._from_hf_config(cfg)
    unaccounted = sorted(set(cfg) - cfg.read - set(INERT))
    assert not unaccounted, (f"{model_type}: transformers' config has {unaccounted}, which pagedserve neither reads "
                             "nor lists as inert (model/refused_fields.py)")


@pytest.mark.parametrize("model_type", HF_MODEL_TYPES)
def test_a_field_implemented_at_one_value_is_refused_at_another(model_type):
    arch = variants.HF_MODEL_TYPES.get(model_type, model_type)
    ModelConfig._from_hf_config(default_config(model_type))  # the defaults load
    for name in NEUTRAL:
        if arch in READ_BY.get(name, ()):
            continue
        with pytest.raises(ValueError, match=f"{name}={CHANGING[name]!r} is not implemented for {arch}"):
            ModelConfig._from_hf_config({**default_config(model_type), name: CHANGING[name]})


def test_inert_fields_each_say_why():
    assert all(reason.strip() for reason in INERT.values())
    assert set(CHANGING) == set(NEUTRAL)
