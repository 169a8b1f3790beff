"""The disk tier's namespace: what two engines must share to read each other's block files.

KV for the same tokens is the same bits only from the same weights through the same
arithmetic: the weight files' contents, how they are held (quantization, gguf_weights),
the device, dtype, kernels and attention backend, the KV dtype, layout and block size,
and the model's shape. The namespace is a digest of all of them (core/kv_disk_index.py
puts it in every file name, disk_block_file.py in every header); the tenant's cache salt
and the tokens are in each block's chain hash.

The weights are hashed whole (blake2b, about a second per GB), once per file version: the
digest is kept in the tier's directory under the file's path, size and modification time,
so a restart or a second replica of the same files reads it instead of the weights.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..core.kv_disk_index import TEMP_PREFIX
from ..model.loader import LoadedModel
from ..resolved_config import ResolvedConfig

_DIGESTS = ".weights-digests"


def offload_namespace(config: ResolvedConfig, loaded: LoadedModel) -> str:
    """32 hex digits naming this engine's KV arithmetic (the module's docstring)."""
    device, kv, load = config.device, config.kv, config.load
    c = loaded.config
    parts = {
        "weights": weights_digest(loaded.source.path, Path(kv.offload.directory)),
        "quantization": load.quantization, "gguf_weights": load.gguf_weights,
        "device": device.name, "dtype": device.dtype, "kernels": device.kernels,
        "attention_backend": device.attention_backend,
        "kv_cache_dtype": kv.kv_cache_dtype, "kv_layout": kv.kv_layout, "block_size": kv.block_size,
        "shape": [c.num_layers, c.num_kv_heads, c.head_dim],
        "model_config": repr(c),
    }
    return hashlib.blake2b(json.dumps(parts, sort_keys=True).encode(), digest_size=16).hexdigest()


def weights_digest(source: Path, directory: Path) -> str:
    """blake2b of the weight files (a .gguf, or a folder's safetensors and config), memoised
    in `directory` under each file's path, size and modification time."""
    files = [source] if source.is_file() else sorted([*source.glob("*.safetensors"), source / "config.json"])
    whole = hashlib.blake2b(digest_size=32)
    for path in files:
        whole.update(path.name.encode() + b"\0" + _file_digest(path, directory / _DIGESTS).encode())
    return whole.hexdigest()


def _file_digest(path: Path, memo_dir: Path) -> str:
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:32]
    memo = memo_dir / key
    try:
        return memo.read_text().strip()
    except OSError:
        pass
    h = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    digest = h.hexdigest()
    try:  # a memo that cannot be written (a read-only tier) only costs the next start a rehash
        memo_dir.mkdir(parents=True, exist_ok=True)
        temp = memo_dir / f"{TEMP_PREFIX}{os.getpid()}-{key}"
        temp.write_text(digest)
        os.replace(temp, memo)
    except OSError:
        pass
    return digest
