"""Coverage-guided fuzzing (atheris, libFuzzer) of the GGUF reader and the tokenizer
builder: any exception but ValueError is a finding, and so is a slow input (libFuzzer's
-timeout) or a large allocation (-rss_limit_mb / -malloc_limit_mb).

    python tests/atheris_gguf.py -max_total_time=600 -rss_limit_mb=2048 -timeout=10 [corpus_dir]

The seed is the valid sample file of tests/gguf_samples.py; `make fuzz` runs this.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import atheris

with atheris.instrument_imports():
    import gguf  # noqa: F401 - instrumented: the reader's branches guide the search
    from pagedserve.model import config, gguf_file, tokenizer

sys.path.insert(0, str(Path(__file__).parent))
from gguf_samples import sample_gguf_bytes  # noqa: E402

_PATH = Path(tempfile.mkdtemp(prefix="atheris-gguf-")) / "input.gguf"


def test_one_input(data: bytes) -> None:
    _PATH.write_bytes(data)
    try:
        model_file = gguf_file.GGUFFile(_PATH)
        for tensor in model_file.tensors():
            tensor.to_float32()
        config.ModelConfig.from_gguf_metadata(model_file.metadata)
        tokenizer.Tokenizer.from_gguf_metadata(model_file.metadata).encode("ab c")
    except ValueError:
        pass  # a clear refusal is the expected outcome for a damaged file


def main() -> None:
    corpus = [arg for arg in sys.argv[1:] if not arg.startswith("-")]
    if corpus:  # seed an empty corpus folder with the valid sample
        folder = Path(corpus[0])
        folder.mkdir(parents=True, exist_ok=True)
        if not any(folder.iterdir()):
            (folder / "sample.gguf").write_bytes(sample_gguf_bytes())
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
