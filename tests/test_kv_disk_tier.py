"""The prefix cache's disk tier (--kv-offload-dir): exact reuse across restarts and engines,
keys that isolate models, dtypes and tenants, and faults that leave the engine serving."""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine_utils import assert_all_blocks_free, make_llm
from pagedserve import SamplingParams
from pagedserve.core.kv_disk_index import STALE_TEMP_SECONDS, SUFFIX, TEMP_PREFIX, DiskIndex, KVOffloadConfig
from pagedserve.core.kv_disk_tier import DiskBlocks, DiskTierMetadata
from pagedserve.engine_config import EngineConfig
from pagedserve.engine.kv_offload_key import weights_digest
from pagedserve.kv_transfer import disk_block_file
from pagedserve.kv_transfer.disk_tier_worker import DiskTierWorker
from pagedserve.model.loader import load_model
from pagedserve.model.sources import load_model_tokenizer

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2
PROMPT = list(range(100, 170))  # 70 tokens: 4 full blocks of 16 may come from the tier
OTHER = list(range(300, 370))
NUM_TIER_BLOCKS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)


def _save_tiny(folder: Path, tokenizer, seed: int) -> Path:
    """A tiny Llama with random weights (seeded), as an HF folder."""
    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    head_dim = HIDDEN // HEADS

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.2

    weights = {"model.embed_tokens.weight": rand(tokenizer.vocab_size, HIDDEN),
               "lm_head.weight": rand(tokenizer.vocab_size, HIDDEN), "model.norm.weight": torch.ones(HIDDEN)}
    for i in range(LAYERS):
        layer = f"model.layers.{i}."
        weights.update({
            layer + "input_layernorm.weight": torch.ones(HIDDEN),
            layer + "post_attention_layernorm.weight": torch.ones(HIDDEN),
            layer + "self_attn.q_proj.weight": rand(HEADS * head_dim, HIDDEN),
            layer + "self_attn.k_proj.weight": rand(KV_HEADS * head_dim, HIDDEN),
            layer + "self_attn.v_proj.weight": rand(KV_HEADS * head_dim, HIDDEN),
            layer + "self_attn.o_proj.weight": rand(HIDDEN, HEADS * head_dim),
            layer + "mlp.gate_proj.weight": rand(FFN, HIDDEN), layer + "mlp.up_proj.weight": rand(FFN, HIDDEN),
            layer + "mlp.down_proj.weight": rand(HIDDEN, FFN)})
    save_file(weights, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": tokenizer.vocab_size,
        "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256,
        "tie_word_embeddings": False, "torch_dtype": "float32"}))
    tokenizer.save(folder)
    return folder


@pytest.fixture(scope="module")
def folders(gguf_path, tmp_path_factory):
    """Two tiny random models of one shape (different weights), saved as HF folders."""
    tokenizer = load_model_tokenizer(gguf_path)
    root = tmp_path_factory.mktemp("disk-tier-models")
    return _save_tiny(root / "a", tokenizer, 0), _save_tiny(root / "b", tokenizer, 1)


@pytest.fixture(scope="module")
def loaded(folders):
    return load_model(folders[0])


@pytest.fixture(scope="module")
def reference(loaded):
    """PROMPT and OTHER recomputed by an engine without the tier: (token ids, logprobs) each."""
    llm = make_llm(loaded, num_threads=1)
    return {key: _run(llm, prompt) for key, prompt in (("prompt", PROMPT), ("other", OTHER))}


def _tier(loaded, directory: Path, size: str = "1MiB", **options):
    # One thread: the tiny model's matrices gain nothing from more, and a busy machine's cores cost a lot.
    return make_llm(loaded, kv_offload_dir=str(directory), kv_offload_size=size, num_threads=1, **options)


def _run(llm, prompt: list[int], cache_salt: str | None = None) -> tuple[list[int], list]:
    """Greedy tokens and their logprobs (bit for bit comparable)."""
    out = llm._run([partial(llm.engine.add_request, prompt, GREEDY, cache_salt=cache_salt)], use_tqdm=False)[0]
    return out.outputs[0].token_ids, out.outputs[0].logprobs


def _finish(llm) -> dict:
    """Wait for the writer, check that no block leaked, stop the engine; the stats."""
    llm.engine.kv_connector.drain()
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert_all_blocks_free(llm)
    stats = llm.stats()
    llm.engine.shutdown()
    return stats


def _files(directory: Path) -> list[Path]:
    """The published block files (not a writer's temp files, which glob's "*" also matches)."""
    return sorted(p for p in directory.glob("*" + SUFFIX) if not p.name.startswith(TEMP_PREFIX))


def test_a_restarted_engine_reads_the_tier_bit_for_bit(loaded, reference, tmp_path):
    first = _tier(loaded, tmp_path)
    assert _run(first, PROMPT) == reference["prompt"]
    stats = _finish(first)
    assert stats["kv_disk_blocks_written"] == NUM_TIER_BLOCKS and stats["kv_disk_hit_blocks"] == 0
    assert len(_files(tmp_path)) == NUM_TIER_BLOCKS

    restarted = _tier(loaded, tmp_path)
    assert restarted.stats()["kv_disk_files"] == NUM_TIER_BLOCKS  # the index rebuilt from the directory
    assert _run(restarted, PROMPT) == reference["prompt"]  # tokens and logprobs, exactly
    stats = _finish(restarted)
    assert stats["kv_disk_hit_blocks"] == stats["kv_disk_blocks_read"] == NUM_TIER_BLOCKS
    assert stats["kv_disk_bytes_read"] > 0 and stats["kv_disk_read_microseconds"] > 0
    assert stats["kv_disk_blocks_written"] == 0  # nothing new to write


def test_ngram_speculation_with_the_tier_gives_the_same_tokens(loaded, reference, tmp_path):
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    repetitive = OTHER[:20] * 3 + OTHER[:10]  # n-gram matches: drafts are proposed
    plain = [_run(make_llm(loaded, num_threads=1), p)[0] for p in (repetitive, PROMPT)]
    first = _tier(loaded, tmp_path, speculative_config=spec)
    assert [_run(first, p)[0] for p in (repetitive, PROMPT)] == plain
    _finish(first)
    restarted = _tier(loaded, tmp_path, speculative_config=spec)
    assert [_run(restarted, p)[0] for p in (repetitive, PROMPT)] == plain == [plain[0], reference["prompt"][0]]
    assert _finish(restarted)["kv_disk_hit_blocks"] == 2 * NUM_TIER_BLOCKS


def test_keys_isolate_tenants_dtypes_and_models(folders, loaded, reference, tmp_path):
    writer = _tier(loaded, tmp_path)
    _run(writer, PROMPT, cache_salt="tenant-a")
    _finish(writer)

    reader = _tier(loaded, tmp_path)
    assert _run(reader, PROMPT, cache_salt="tenant-b") == reference["prompt"]
    assert reader.stats()["kv_disk_hit_blocks"] == 0
    _run(reader, OTHER, cache_salt="tenant-a")
    assert reader.stats()["kv_disk_hit_blocks"] == 0
    assert _run(reader, PROMPT, cache_salt="tenant-a") == reference["prompt"]
    assert reader.stats()["kv_disk_hit_blocks"] == NUM_TIER_BLOCKS
    _finish(reader)

    fp16 = _tier(loaded, tmp_path, kv_cache_dtype="fp16")
    _run(fp16, PROMPT, cache_salt="tenant-a")
    assert _finish(fp16)["kv_disk_hit_blocks"] == 0

    other_model = _tier(load_model(folders[1]), tmp_path)
    _run(other_model, PROMPT, cache_salt="tenant-a")
    assert _finish(other_model)["kv_disk_hit_blocks"] == 0
    assert weights_digest(folders[0], tmp_path) != weights_digest(folders[1], tmp_path)


def test_corrupt_and_torn_files_are_misses_and_deleted(loaded, reference, tmp_path):
    writer = _tier(loaded, tmp_path)
    _run(writer, PROMPT)
    _run(writer, OTHER)
    _finish(writer)
    files = _files(tmp_path)
    assert len(files) == 2 * NUM_TIER_BLOCKS
    flipped, torn = files[0], files[1]
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x40
    flipped.write_bytes(bytes(data))
    torn.write_bytes(torn.read_bytes()[:-100])
    leftover = tmp_path / f"{TEMP_PREFIX}123-456-{files[2].name}"  # a writer killed mid-file, long ago
    leftover.write_bytes(b"partial")
    os.utime(leftover, (time.time() - 2 * STALE_TEMP_SECONDS,) * 2)
    in_progress = tmp_path / f"{TEMP_PREFIX}789-012-{files[3].name}"  # another engine's write, now
    in_progress.write_bytes(b"partial")

    reader = _tier(loaded, tmp_path)
    assert not leftover.exists() and in_progress.exists()
    assert _run(reader, PROMPT) == reference["prompt"]
    assert _run(reader, OTHER) == reference["other"]
    stats = _finish(reader)
    assert stats["kv_disk_corrupt_files"] >= 1 and stats["kv_disk_loads_failed"] >= 1
    # Each damaged file was deleted and, the prompt recomputed, written again whole.
    assert stats["kv_disk_blocks_written"] >= stats["kv_disk_corrupt_files"]

    again = _tier(loaded, tmp_path)
    assert _run(again, PROMPT) == reference["prompt"] and _run(again, OTHER) == reference["other"]
    stats = _finish(again)
    assert stats["kv_disk_hit_blocks"] == 2 * NUM_TIER_BLOCKS and stats["kv_disk_loads_failed"] == 0


def test_lru_keeps_the_directory_within_its_size(loaded, reference, tmp_path):
    probe = _tier(loaded, tmp_path / "probe")
    _run(probe, PROMPT)
    file_bytes = _finish(probe)["kv_disk_bytes_written"] // NUM_TIER_BLOCKS

    llm = _tier(loaded, tmp_path / "tier", size=str(6 * file_bytes))
    _run(llm, PROMPT)
    _run(llm, OTHER)
    stats = _finish(llm)
    assert stats["kv_disk_evictions"] == 2 and stats["kv_disk_files"] == 6
    assert sum(f.stat().st_size for f in _files(tmp_path / "tier")) <= 6 * file_bytes
    # The oldest files went: OTHER's blocks are all still there.
    restarted = _tier(loaded, tmp_path / "tier", size=str(6 * file_bytes))
    assert _run(restarted, OTHER) == reference["other"]
    assert _finish(restarted)["kv_disk_hit_blocks"] == NUM_TIER_BLOCKS


def test_two_engines_share_a_directory(loaded, reference, tmp_path):
    # Both start on an empty directory: the second learns of the first's files as it looks.
    first, second = _tier(loaded, tmp_path), _tier(loaded, tmp_path)
    _run(first, PROMPT)
    _finish(first)
    assert _run(second, PROMPT) == reference["prompt"]
    assert _finish(second)["kv_disk_hit_blocks"] == NUM_TIER_BLOCKS


def test_the_directory_deleted_under_a_running_engine(loaded, reference, tmp_path):
    writer = _tier(loaded, tmp_path)
    _run(writer, PROMPT)
    _finish(writer)
    llm = _tier(loaded, tmp_path)  # indexes PROMPT's files
    shutil.rmtree(tmp_path)
    assert _run(llm, PROMPT) == reference["prompt"]  # the load misses: recomputed
    assert llm.stats()["kv_disk_loads_failed"] == 1
    llm.engine.kv_connector.drain()
    assert _run(llm, OTHER) == reference["other"]  # written into the directory made again
    stats = _finish(llm)
    assert stats["kv_disk_write_errors"] == 1 and stats["kv_disk_writes_disabled"] == 0
    assert len(_files(tmp_path)) == 2 * NUM_TIER_BLOCKS


def _failing_writes(monkeypatch, code: int) -> None:
    real = os.open

    def failing(path, flags, *args):
        if flags & os.O_CREAT:
            raise OSError(code, os.strerror(code), path)
        return real(path, flags, *args)

    monkeypatch.setattr(disk_block_file.os, "open", failing)


def test_a_read_only_directory_stops_writes_not_reads(loaded, reference, tmp_path, monkeypatch):
    writer = _tier(loaded, tmp_path)
    _run(writer, PROMPT)
    _finish(writer)
    _failing_writes(monkeypatch, errno.EROFS)
    llm = _tier(loaded, tmp_path)
    assert _run(llm, OTHER) == reference["other"]
    llm.engine.kv_connector.drain()
    assert llm.stats()["kv_disk_writes_disabled"] == 1 and llm.stats()["kv_disk_write_errors"] == 1
    assert _run(llm, PROMPT) == reference["prompt"]  # what is there is still read
    stats = _finish(llm)
    assert stats["kv_disk_hit_blocks"] == NUM_TIER_BLOCKS
    assert not list(tmp_path.glob(TEMP_PREFIX + "*"))
    assert len(_files(tmp_path)) == NUM_TIER_BLOCKS


def test_a_full_disk_shrinks_the_tier_then_stops_writing(loaded, reference, tmp_path, monkeypatch):
    writer = _tier(loaded, tmp_path)
    _run(writer, PROMPT)
    _finish(writer)
    _failing_writes(monkeypatch, errno.ENOSPC)
    llm = _tier(loaded, tmp_path)
    assert _run(llm, OTHER) == reference["other"]
    stats = _finish(llm)
    # Each failed write gave back the least recently used tenth, until under one block.
    assert stats["kv_disk_write_errors"] == NUM_TIER_BLOCKS and stats["kv_disk_evictions"] == NUM_TIER_BLOCKS - 1
    assert stats["kv_disk_writes_disabled"] == 1 and stats["kv_disk_capacity_bytes"] < (1 << 20)
    assert len(_files(tmp_path)) == 1 and not list(tmp_path.glob(TEMP_PREFIX + "*"))


def test_a_full_disk_shrinks_the_tier_to_what_it_holds(tmp_path):
    index = DiskIndex(str(tmp_path), 10_000)
    for i in range(5):
        (tmp_path / f"ns-{i:02x}{SUFFIX}").write_bytes(b"x" * 1000)
        os.utime(tmp_path / f"ns-{i:02x}{SUFFIX}", ns=(i * 10**9, i * 10**9))
    assert index.rebuild() == []
    assert index.shrink(int(index.num_bytes * 0.5)) == [f"ns-{i:02x}{SUFFIX}" for i in range(3)]
    assert index.num_bytes == 2000 and len(index) == 2


def test_a_full_write_queue_drops_the_write_and_frees_the_blocks(tmp_path):
    worker = DiskTierWorker(DiskIndex(str(tmp_path), 1 << 20), "00" * 16, queue_blocks=3)
    worker.register_kv_caches([torch.zeros(2, 4, 16, 2, 8)])
    worker.shutdown()  # the writer stops: what is queued stays queued
    worker._writer.join()
    names = [f"{'00' * 16}-{i:064x}{SUFFIX}" for i in range(6)]
    # An empty queue takes r0 though it is longer than the bound; then 4 + 2 blocks > 3: r1 is dropped.
    saves = [DiskBlocks("r0", tuple(names[:4]), (0, 1, 2, 3)), DiskBlocks("r1", tuple(names[4:]), (0, 1))]
    worker.bind_connector_metadata(DiskTierMetadata(saves=saves))
    assert worker.get_finished().finished_sending == {"r1"}  # freed at once
    assert worker.stats()["kv_disk_writes_dropped"] == 2


def test_options_are_checked_by_name():
    with pytest.raises(ValueError, match="kv_offload_dir needs kv_layout='paged'"):
        EngineConfig(kv_offload_dir="/tmp/x", kv_offload_size="1GiB", kv_layout="contiguous").resolve("cpu")
    with pytest.raises(ValueError, match="kv_offload_dir needs kv_offload_size"):
        EngineConfig(kv_offload_dir="/tmp/x").resolve("cpu")
    with pytest.raises(ValueError, match="kv_offload_size needs kv_offload_dir"):
        EngineConfig(kv_offload_size="1GiB").resolve("cpu")
    with pytest.raises(ValueError, match="kv_offload_size must be a size"):
        EngineConfig(kv_offload_dir="/tmp/x", kv_offload_size="lots")
    with pytest.raises(ValueError, match="kv_offload_dir needs enable_prefix_caching"):
        EngineConfig(kv_offload_dir="/tmp/x", kv_offload_size="1GiB", enable_prefix_caching=False).resolve("cpu")
    with pytest.raises(ValueError, match="kv_offload_dir is not supported with kv_transfer_config"):
        EngineConfig(kv_offload_dir="/tmp/x", kv_offload_size="1GiB", kv_transfer_config={}).resolve("cpu")
    with pytest.raises(ValueError, match="kv_offload_dir '/proc/pagedserve-kv' cannot be read or made"):
        DiskTierWorker(DiskIndex("/proc/pagedserve-kv", 1 << 20), "00" * 16)
    resolved = EngineConfig(kv_offload_dir="/tmp/x", kv_offload_size="2KiB").resolve("cpu")
    assert resolved.kv.offload == KVOffloadConfig("/tmp/x", 2048)
    assert EngineConfig.from_resolved(resolved).resolve("cpu") == resolved


# -- other processes: a replica beside this one, a killed writer, a file-size limit ------------

_CHILD = """
import json, resource, sys
folder, tier, mode = sys.argv[1:4]
prompts = json.loads(sys.argv[4])
if mode == "fsize":  # every file write past 4 KiB fails (EFBIG), as on a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
from pagedserve import LLM, SamplingParams
llm = LLM(folder, kv_offload_dir=tier, kv_offload_size="1MiB", kv_cache_memory="8MiB", num_threads=1)
greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
if mode == "loop":  # writes new prompts' blocks until killed
    for i in range(10**6):
        llm.generate([list(range(1000 + 80 * i, 1070 + 80 * i))], greedy, use_tqdm=False)
tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
llm.engine.kv_connector.drain()
print(json.dumps({"tokens": tokens, "stats": llm.stats()}))
"""


def _child(folder: Path, tier: Path, mode: str, prompts: list[list[int]]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _CHILD, str(folder), str(tier), mode, json.dumps(prompts)],
                            stdout=subprocess.PIPE, text=True)


def _child_result(child: subprocess.Popen) -> dict:
    out, _ = child.communicate(timeout=300)
    assert child.returncode == 0
    return json.loads(out.splitlines()[-1])


@pytest.mark.slow
def test_two_processes_share_a_directory(folders, loaded, reference, tmp_path):
    llm = _tier(loaded, tmp_path)
    _run(llm, OTHER)
    llm.engine.kv_connector.drain()
    child = _child_result(_child(folders[0], tmp_path, "once", [PROMPT, OTHER]))
    assert child["tokens"] == [reference["prompt"][0], reference["other"][0]]
    assert child["stats"]["kv_disk_hit_blocks"] == NUM_TIER_BLOCKS  # OTHER, written by this process
    assert _run(llm, PROMPT) == reference["prompt"]
    assert _finish(llm)["kv_disk_hit_blocks"] == NUM_TIER_BLOCKS  # PROMPT, written by the child


@pytest.mark.slow
def test_kill_9_during_write_back_leaves_no_corrupt_file(folders, loaded, tmp_path):
    child = _child(folders[0], tmp_path, "loop", [])
    deadline = time.monotonic() + 300
    while len(_files(tmp_path)) < 3 * NUM_TIER_BLOCKS and time.monotonic() < deadline and child.poll() is None:
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert len(_files(tmp_path)) >= 3 * NUM_TIER_BLOCKS
    llm = _tier(loaded, tmp_path)  # the killed writer's temp files (if any) are never read
    worker = llm.engine.kv_connector
    for path in _files(tmp_path):  # every published file is whole
        disk_block_file.read_block_file(str(path), worker._shape, bytes.fromhex(path.stem.split("-")[1]))
    prompts = [list(range(1000 + 80 * i, 1070 + 80 * i)) for i in range(3)]
    plain = make_llm(loaded, num_threads=1)
    assert [_run(llm, p) for p in prompts] == [_run(plain, p) for p in prompts]
    stats = _finish(llm)
    assert stats["kv_disk_hit_blocks"] == 3 * NUM_TIER_BLOCKS and stats["kv_disk_loads_failed"] == 0


@pytest.mark.slow
def test_a_file_size_limit_disables_writes_in_a_serving_process(folders, reference, tmp_path):
    child = _child_result(_child(folders[0], tmp_path, "fsize", [PROMPT]))
    assert child["tokens"] == [reference["prompt"][0]]
    stats = child["stats"]
    assert stats["kv_disk_write_errors"] == 1 and stats["kv_disk_writes_disabled"] == 1
    assert stats["kv_disk_writes_dropped"] == NUM_TIER_BLOCKS - 1
    assert not _files(tmp_path) and not list(tmp_path.glob(TEMP_PREFIX + "*"))


def test_the_tier_counters_on_metrics(loaded, tmp_path):
    from types import SimpleNamespace

    from prometheus_client.parser import text_string_to_metric_families

    from pagedserve.engine.async_engine import EngineSnapshot
    from pagedserve.entrypoints.openai.metrics import ServerMetrics

    llm = _tier(loaded, tmp_path)
    _run(llm, PROMPT)
    stats = _finish(llm)
    counters = {k: v for k, v in stats.items() if k.startswith("kv_disk_")}
    server = ServerMetrics("tiny")
    server.watch(SimpleNamespace(snapshot=EngineSnapshot(kv_transfer=counters), num_waiting=0))
    families = {f.name: f for f in text_string_to_metric_families(server.render().decode())}
    assert families["pagedserve:kv_disk_blocks_written"].type == "counter"
    assert families["pagedserve:kv_disk_blocks_written"].samples[0].value == NUM_TIER_BLOCKS
    assert families["pagedserve:kv_disk_files"].type == "gauge"
    assert families["pagedserve:kv_disk_read_seconds"].type == "counter"
    assert "pagedserve:kv_disk_read_microseconds" not in families
