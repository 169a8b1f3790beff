"""Shared fixtures. The transformers reference model and tokenizer load once per session."""
from __future__ import annotations

import pytest

from pagedserve.model.registry import default_model_path


@pytest.fixture(scope="session")
def gguf_path():
    return default_model_path()


@pytest.fixture(scope="session")
def gguf_file(gguf_path):
    from pagedserve.model.gguf_file import GGUFFile

    return GGUFFile(gguf_path)


@pytest.fixture(scope="session")
def hf_tokenizer(gguf_path):
    """The reference tokenizer: transformers' own GGUF conversion."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="session")
def hf_model(gguf_path):
    """The reference model (float32), loaded from the same GGUF by transformers."""
    import torch
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    model.eval()
    return model
