"""Malformed model files give a clear ValueError in bounded time and memory, never a
crash, a hang or a giant allocation: damaged GGUF files (targeted and random), broken
config.json / tokenizer.json, and chat templates that try to escape their sandbox."""
from __future__ import annotations

import json
import struct
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.model.chat_template import ChatTemplate
from pagedserve.model.config import ModelConfig
from pagedserve.model.gguf_file import GGUFFile
from pagedserve.model.tokenizer import Tokenizer

from gguf_samples import sample_gguf_bytes

SAMPLE = sample_gguf_bytes()
# A damaged 2 KB file may cost a few ms and some kilobytes; these are far above that and
# far below what a header-driven allocation or loop would take.
MAX_SECONDS = 2.0
MAX_PEAK_BYTES = 32 << 20
# A template may render up to chat_template.MAX_RENDERED_CHARS before it is stopped
# (under tracemalloc, which slows each of those millions of small allocations).
MAX_RENDER_PEAK_BYTES = 160 << 20
MAX_RENDER_SECONDS = 15.0


def read_model_file(path: Path) -> None:
    """Everything pagedserve reads from a GGUF: metadata, every tensor, config, tokenizer."""
    gguf = GGUFFile(path)
    for tensor in gguf.tensors():
        tensor.to_float32()
    ModelConfig.from_gguf_metadata(gguf.metadata)
    Tokenizer.from_gguf_metadata(gguf.metadata).encode("ab c")


def outcome(path: Path, data: bytes) -> str | None:
    """None if the file reads, else the ValueError's message; fails on any other error,
    on a slow read and on a large allocation."""
    path.write_bytes(data)
    tracemalloc.start()
    start = time.monotonic()
    try:
        read_model_file(path)
        return None
    except ValueError as e:
        return str(e)
    finally:
        elapsed = time.monotonic() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert elapsed < MAX_SECONDS, f"{elapsed:.1f} s reading a damaged file"
        assert peak < MAX_PEAK_BYTES, f"{peak} bytes allocated reading a damaged file"


def test_the_sample_reads(tmp_path):
    assert outcome(tmp_path / "m.gguf", SAMPLE) is None


def _patched(offset: int, fmt: str, value: int) -> bytes:
    data = bytearray(SAMPLE)
    struct.pack_into(fmt, data, offset, value)
    return bytes(data)


def _tensor_info(name: bytes) -> int:
    """Offset of a tensor's n_dims field in the sample's tensor-info table."""
    return SAMPLE.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)


EMBED = _tensor_info(b"token_embd.weight")
# The item count of the tokenizer.ggml.token_type array (after its key, type and item type).
TOKEN_TYPES = SAMPLE.index(b"tokenizer.ggml.token_type") + len(b"tokenizer.ggml.token_type") + 8
TARGETED = [
    ("empty", b"", "too short"),
    ("truncated-header", SAMPLE[:20], "too short"),
    ("truncated-metadata", SAMPLE[:200], "more than its"),
    ("truncated-vocabulary", SAMPLE[:700], "the file ends at 700"),
    ("truncated-tensor-data", SAMPLE[:-100], "runs past the file"),
    ("wrong-magic", b"GGML" + SAMPLE[4:], "not a GGUF file"),
    ("version-1", _patched(4, "<I", 1), "version 1"),
    ("version-99", _patched(4, "<I", 99), "version 99"),
    ("absurd-tensor-count", _patched(8, "<Q", 2**62), "more than its"),
    ("absurd-kv-count", _patched(16, "<Q", 2**40), "more than its"),
    ("key-length-past-the-end", _patched(24, "<Q", 2**60), "the file ends"),
    ("key-length-zero", _patched(24, "<Q", 0), "unknown type"),
    ("absurd-dimension", _patched(EMBED + 4, "<Q", 2**40), "runs past the file"),
    ("zero-dimension", _patched(EMBED + 4, "<Q", 0), "dimensions"),
    ("too-many-dimensions", _patched(EMBED, "<I", 9), "9 dimensions"),
    # Found by atheris: the reader walked a 34-billion-item array item by item past the end of the file.
    ("absurd-array-length", _patched(TOKEN_TYPES, "<Q", 2**35 + 8), "the file ends"),
    ("unknown-tensor-type", _patched(EMBED + 4 + 16, "<I", 250), "unknown GGML type 250"),
    ("unsupported-tensor-type", _patched(EMBED + 4 + 16, "<I", 16), "IQ2_XXS"),
    ("offset-past-the-end", _patched(EMBED + 4 + 16 + 4, "<Q", 2**50), "runs past the file"),
    ("bad-utf8-in-a-key", SAMPLE.replace(b"llama.block_count", b"llama.block_\xff\xfeunt"), "is not UTF-8"),
    ("nan-weights", sample_gguf_bytes(np.full((8, 32), np.nan, dtype=np.float32)), "NaN"),
    ("inf-weights", sample_gguf_bytes(np.full((8, 32), np.inf, dtype=np.float32)), "NaN or infinite"),
]


@pytest.mark.parametrize(("data", "message"), [c[1:] for c in TARGETED], ids=[c[0] for c in TARGETED])
def test_damaged_gguf_is_a_clear_value_error(tmp_path, data, message):
    error = outcome(tmp_path / "m.gguf", data)
    assert error is not None and message in error, error


@st.composite
def damaged(draw: st.DrawFn) -> bytes:
    data = bytearray(SAMPLE)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["truncate", "bytes", "u64", "u32"]))
        at = draw(st.integers(0, len(data) - 1))
        if kind == "truncate":
            del data[at:]
            break
        if kind == "bytes":
            data[at:at + 4] = draw(st.binary(min_size=1, max_size=4))
        else:
            fmt = "<Q" if kind == "u64" else "<I"
            bits = 64 if kind == "u64" else 32
            value = draw(st.sampled_from([0, 1, 2**(bits - 1), 2**bits - 1]) | st.integers(0, 2**bits - 1))
            if at + struct.calcsize(fmt) <= len(data):
                struct.pack_into(fmt, data, at, value)
    return bytes(data)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=damaged())
def test_randomly_damaged_gguf_reads_or_fails_cleanly(tmp_path, data):
    outcome(tmp_path / "m.gguf", data)


CONFIG = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
          "num_attention_heads": 4, "vocab_size": 8, "max_position_embeddings": 128}
BAD_CONFIGS = [
    ("not-json", "{", "Expecting"),
    ("a-list", "[]", "config"),
    ("missing-key", json.dumps({k: v for k, v in CONFIG.items() if k != "hidden_size"}), "hidden_size"),
    ("string-size", json.dumps({**CONFIG, "hidden_size": "big"}), "big"),
    ("zero-heads", json.dumps({**CONFIG, "num_attention_heads": 0}), "config"),
    ("absurd-hidden", json.dumps({**CONFIG, "hidden_size": 10**12}), "hidden_size"),
    ("absurd-layers", json.dumps({**CONFIG, "num_hidden_layers": 10**9}), "num_layers"),
    ("negative-vocab", json.dumps({**CONFIG, "vocab_size": -1}), "vocab_size"),
    ("nan-eps", json.dumps({**CONFIG, "rms_norm_eps": float("nan")}), "rms_norm_eps"),
    ("unknown-architecture", json.dumps({**CONFIG, "model_type": "gpt9"}), "not supported"),
]


@pytest.mark.parametrize(("text", "message"), [c[1:] for c in BAD_CONFIGS], ids=[c[0] for c in BAD_CONFIGS])
def test_malformed_config_json_is_a_clear_value_error(tmp_path, text, message):
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ValueError) as e:
        ModelConfig.from_hf_config(path)
    assert message in str(e.value) and str(path) in str(e.value)


@pytest.mark.parametrize("text", ["{", "[]", '{"model": {"type": "BPE", "vocab": 5}}', '{"version": "1.0"}',
                                  json.dumps({"model": {"type": "Nope"}})])
def test_malformed_tokenizer_json_is_a_clear_value_error(tmp_path, text):
    (tmp_path / "tokenizer.json").write_text(text)
    with pytest.raises(ValueError, match="malformed"):
        Tokenizer.from_pretrained(tmp_path)


MESSAGES = [{"role": "user", "content": "hi"}]
ESCAPES = [
    ("class-attribute", "{{ ''.__class__.__mro__[1].__subclasses__() }}"),
    ("globals", "{{ raise_exception.__globals__['__builtins__'] }}"),
    ("format-attribute", "{{ '{0.__class__}'.format(messages) }}"),
    ("huge-range", "{% for i in range(10**10) %}x{% endfor %}"),
    ("huge-power", "{{ 2 ** 100000000 }}"),
    ("huge-repeat", "{{ 'x' * 10**10 }}"),
    ("huge-repeat-reversed", "{{ 10**10 * ['x'] }}"),
    ("huge-output", "{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxxxx{% endfor %}{% endfor %}"),
    ("recursion", "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"),
    ("mutate-messages", "{{ messages.append(1) }}"),
    ("bad-syntax", "{% for %}"),
]


@pytest.mark.parametrize("source", [c[1] for c in ESCAPES], ids=[c[0] for c in ESCAPES])
def test_chat_template_escapes_fail_or_yield_nothing(source):
    """Each is refused with a ValueError, or renders harmlessly (the sandbox turns an
    unsafe attribute into an empty value): never a leak, a crash, a hang or a huge allocation."""
    start = time.monotonic()
    tracemalloc.start()
    try:
        text = ChatTemplate(source).render(MESSAGES)
        assert not any(word in text for word in ("class", "function", "module", "built")), text[:200]
    except ValueError:
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert time.monotonic() - start < MAX_RENDER_SECONDS
    assert peak < MAX_RENDER_PEAK_BYTES
