"""Tensor parallelism with real ranks (spawned processes over gloo): SmolLM2 at TP=3 and
random-weight Llamas at TP=2 and TP=4 (the latter with its KV heads replicated) give
TP=1's greedy tokens and its log-probabilities within LOGPROB_TOLERANCE; the busy batch,
preemption, prefix-cache and copy-on-write behaviours hold under TP; a killed rank makes
generate raise and the server exit non-zero; two ranks in two network namespaces.

Every engine here runs its ranks on 1 thread each (2 cores are shared by everything)."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from conftest import REFERENCE_NEW_TOKENS
from engine_utils import BUSY_PROBES, KV_BYTES_PER_BLOCK, assert_all_blocks_free, busy_batch, check_busy_batch, make_llm
from pagedserve import LLM, SamplingParams
from pagedserve.engine_config import EngineConfig
from pagedserve.distributed import step_message
from pagedserve.distributed.executor import RankFailedError
from pagedserve.distributed.loading import load_shard
from pagedserve.distributed.sharding import TPShard
from pagedserve.model.config import ModelConfig
from pagedserve.model.loader import load_model
from server.server_process import start_server

transformers = pytest.importorskip("transformers")

# Rank sums are added in another order than one matmul adds them; fp32 rounding moves
# SmolLM2's log-probabilities by ~1e-5 (measured max 3e-5); the bound leaves room.
LOGPROB_TOLERANCE = 1e-3
SRC = str(Path(__file__).resolve().parent.parent / "src")
KILL_BOUND_S = 60.0  # measured under a load average of ~25: generate 0.5 s, the idle server 13 s
TP_OPTIONS = dict(num_threads=1, max_num_batched_tokens=64, max_num_seqs=32)


def tiny_config(**overrides) -> ModelConfig:
    base = dict(architecture="llama", vocab_size=10, hidden_size=16, intermediate_size=24, num_layers=1,
                num_heads=8, num_kv_heads=2, head_dim=2, rms_norm_eps=1e-6, rope_theta=1e4,
                max_position_embeddings=64, tie_word_embeddings=False)
    return ModelConfig(**{**base, **overrides})


# -- the split, without processes ------------------------------------------------------------

@pytest.mark.parametrize("size", [2, 4, 8])
def test_the_shards_put_back_together_are_the_weights(size):
    c = tiny_config()  # 8 heads, 2 KV heads: split at 2, replicated at 4 and 8; vocab 10 pads
    g = torch.Generator().manual_seed(0)
    q, kv, h = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size
    state = {
        "embed.weight": torch.randn(c.vocab_size, h, generator=g),
        "lm_head.weight": torch.randn(c.vocab_size, h, generator=g),
        "layers.0.qkv.weight": torch.randn(q + 2 * kv, h, generator=g),
        "layers.0.o.weight": torch.randn(h, q, generator=g),
        "layers.0.gate_up.weight": torch.randn(2 * c.intermediate_size, h, generator=g),
        "layers.0.down.weight": torch.randn(h, c.intermediate_size, generator=g),
        "layers.0.attn_norm.weight": torch.randn(h, generator=g),
    }
    shards = [TPShard(c, r, size) for r in range(size)]
    parts = [s.shard_fused_state(state) for s in shards]
    local = shards[0].local_config()
    lq, lkv, li = local.num_heads * c.head_dim, local.num_kv_heads * c.head_dim, local.intermediate_size
    for p in parts:  # every rank's tensors have the local model's shapes
        assert p["layers.0.qkv.weight"].shape == (lq + 2 * lkv, h)
        assert p["embed.weight"].shape == (local.vocab_size, h)
        assert p["layers.0.gate_up.weight"].shape == (2 * li, h)
    qkv = [p["layers.0.qkv.weight"].split([lq, lkv, lkv]) for p in parts]
    full_q, full_k, full_v = state["layers.0.qkv.weight"].split([q, kv, kv])
    assert torch.equal(torch.cat([x[0] for x in qkv]), full_q)
    # Rank r's KV head is the one its query heads (r*8/size ...) read: head (r*q_heads_per_rank)//group.
    group = c.num_heads // c.num_kv_heads
    for s, (_, k, v) in zip(shards, qkv):
        head = s.q_heads[0] // group
        assert torch.equal(k[:c.head_dim], full_k[head * c.head_dim:(head + 1) * c.head_dim])
        assert torch.equal(v[:c.head_dim], full_v[head * c.head_dim:(head + 1) * c.head_dim])
    assert torch.equal(torch.cat([p["layers.0.o.weight"] for p in parts], 1), state["layers.0.o.weight"])
    assert torch.equal(torch.cat([p["layers.0.down.weight"] for p in parts], 1), state["layers.0.down.weight"])
    gate = torch.cat([p["layers.0.gate_up.weight"].chunk(2)[0] for p in parts])
    assert torch.equal(gate, state["layers.0.gate_up.weight"].chunk(2)[0])
    vocab = torch.cat([p["embed.weight"] for p in parts])
    assert torch.equal(vocab[:c.vocab_size], state["embed.weight"]) and not vocab[c.vocab_size:].any()
    assert all(torch.equal(p["layers.0.attn_norm.weight"], state["layers.0.attn_norm.weight"]) for p in parts)


def test_splits_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size .2. must divide the model's 9 attention heads"):
        TPShard(tiny_config(num_heads=9, num_kv_heads=3), 0, 2)
    with pytest.raises(ValueError, match="KV heads"):
        TPShard(tiny_config(num_heads=12, num_kv_heads=4, intermediate_size=24), 0, 6)
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(tensor_parallel_size=2, quantization="q8_0").resolve("cpu")
    with pytest.raises(ValueError, match="speculative_config"):
        EngineConfig(tensor_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2}).resolve("cpu")
    with pytest.raises(ValueError, match="nnodes > 1 needs distributed_init_method"):
        EngineConfig(tensor_parallel_size=2, nnodes=2).resolve("cpu")
    with pytest.raises(ValueError, match="multiple of nnodes"):
        EngineConfig(tensor_parallel_size=3, nnodes=2, distributed_init_method="tcp://127.0.0.1:1").resolve("cpu")
    with pytest.raises(ValueError, match="distributed_init_method must be"):
        EngineConfig(tensor_parallel_size=2, distributed_init_method="127.0.0.1:1")


class _Loopback:
    """Stands in for the group's broadcast in one process: what was sent is what is received."""

    def __init__(self, sent: list[torch.Tensor] | None = None):
        self.sent = sent or []
        self.receiving = sent is not None

    def broadcast(self, x: torch.Tensor, idle: bool = False) -> None:
        if self.receiving:
            x.copy_(self.sent.pop(0))
        else:
            self.sent.append(x.clone())


def test_a_step_message_reads_back_as_sent():
    from pagedserve.attention.metadata import AttentionMetadata

    meta = AttentionMetadata.for_sequences([3, 1], [3, 18], [[4], [7, 9]], block_size=16)
    step = step_message.StepTensors(torch.tensor([5, 6, 7, 8]), torch.tensor([0, 1, 2, 17]), meta,
                                    torch.tensor([2, 3]), torch.tensor([9]), torch.tensor([11]))
    wire = _Loopback()
    step_message.send_step(wire, step)
    header, payload = wire.sent
    assert header.dtype == torch.int64 and header.numel() == step_message.HEADER_LEN  # 64 bytes
    assert header.tolist()[1:] == [step_message.Kind.RUN, 4, 2, 2, 2, 1, payload.numel()]
    back = _Loopback(wire.sent)
    kind, got = step_message.receive(back, block_size=16)
    assert kind == step_message.Kind.RUN and not back.sent
    for name in ("input_ids", "positions", "logits_indices", "copy_src", "copy_dst"):
        assert torch.equal(getattr(got, name), getattr(step, name)), name
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        assert torch.equal(getattr(got.meta, name), getattr(meta, name)), name
    assert got.meta.query_lens_cpu == [3, 1] and got.meta.seq_lens_cpu == [3, 18]


def test_a_header_from_something_else_is_refused():
    with pytest.raises(ValueError, match="not a pagedserve step header"):
        step_message.receive(_Loopback([torch.tensor([1, 1, 0, 0, 0, 0, 0, 0])]))
    with pytest.raises(ValueError, match="payload length 3 does not match"):
        step_message.receive(_Loopback([torch.tensor([step_message.MAGIC, step_message.Kind.COPY, 0, 0, 0, 0, 2, 3])]))


# -- SmolLM2 at TP=3 ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def loaded():
    return load_model()


@contextmanager
def running(llm: LLM) -> Iterator[LLM]:
    """The engine, its ranks stopped at the end whatever happens."""
    try:
        yield llm
    finally:
        llm.engine.shutdown()


def _prompt_logprobs(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    """log p(prompt token | the tokens before it) at every position after the first."""
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return [torch.tensor([e[t].logprob for e, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])])
            for o in outs]


def _assert_close_to_tp1(tp: LLM, tp1: LLM, prompts: list[list[int]]) -> float:
    params = SamplingParams(temperature=0, max_tokens=REFERENCE_NEW_TOKENS, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in tp.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in tp1.generate(prompts, params, use_tqdm=False)]
    assert got == want
    diffs = [(a - b).abs() for a, b in zip(_prompt_logprobs(tp, prompts), _prompt_logprobs(tp1, prompts))]
    worst = float(torch.cat(diffs).max())
    assert worst <= LOGPROB_TOLERANCE
    print(f"largest log-probability difference from TP=1: {worst:.2e}")
    assert_all_blocks_free(tp)
    return worst


@pytest.mark.slow  # parses the whole GGUF again: ~12 s on a quiet machine
def test_a_gguf_read_without_the_cache_gives_the_cached_shard(loaded):
    # `loaded` made sure the converted cache exists; the fresh read cuts each tensor as it is dequantised.
    fresh, _ = load_shard(None, 1, 3, pack=False, use_cache=False)
    cached, _ = load_shard(None, 1, 3, pack=False)
    a, b = fresh.model.state_dict(), cached.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert a["layers.0.qkv.weight"].shape == ((3 + 2) * 64, 576)  # 3 query heads and 1 KV head of 64


# Engines live for one class: a process holds one torch.distributed group, so each class's
# engine is shut down before the next one starts.

@pytest.fixture(scope="class")
def smollm_tp3():
    # A pool of 40 blocks per rank (each rank holds a third of every block's heads).
    with running(LLM(tensor_parallel_size=3, kv_cache_memory=40 * KV_BYTES_PER_BLOCK // 3, **TP_OPTIONS)) as llm:
        yield llm


@pytest.fixture(scope="class")
def smollm_tp1(loaded):
    return make_llm(loaded, kv_cache_memory=40 * KV_BYTES_PER_BLOCK, **TP_OPTIONS)


class TestSmolLM2AtTP3:
    @pytest.fixture
    def tp3(self, smollm_tp3):
        return smollm_tp3

    @pytest.fixture
    def tp1(self, smollm_tp1):
        return smollm_tp1

    def test_greedy_and_logprobs_match_tp1(self, tp3, tp1, reference_prompts):
        assert tp3.engine.runner.kv_caches[0].shape[-2] == 1  # one of the 3 KV heads per rank
        # Every rank resolved --kernels on its own and runs the native ones (it says so at start).
        from pagedserve.kernels import kernel_report

        assert tp3.engine.tp.rank_kernels == [kernel_report("native")] * 3
        _assert_close_to_tp1(tp3, tp1, reference_prompts)

    def test_same_tokens_alone_and_in_a_batch(self, tp3):
        # With 3 ranks the order of a sum matters (a+b+c); the all-reduce adds in rank order
        # whatever the batch, so a row's tokens do not depend on its neighbours.
        prompts, params = busy_batch(tp3.tokenizer)
        # Six requests of 12 tokens: three processes share two cores here.
        prompts, params = prompts[:6], [dataclasses.replace(p, max_tokens=12) for p in params[:6]]
        alone = [tp3.generate([prompts[i]], params[i], use_tqdm=False)[0].outputs[0].token_ids for i in (0, 1, 5)]
        batch = tp3.generate(prompts, params, use_tqdm=False)
        assert [batch[i].outputs[0].token_ids for i in (0, 1, 5)] == alone
        assert_all_blocks_free(tp3)

    def test_copy_on_write(self, tp3, tp1):
        prompt = tp3.tokenizer.encode("Write a haiku about the sea. " * 8)[:40]  # a shared partial block
        params = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=6, ignore_eos=True)
        got = tp3.generate([prompt], params, use_tqdm=False)[0]
        want = tp1.generate([prompt], params, use_tqdm=False)[0]
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
        assert_all_blocks_free(tp3)


# -- random-weight Llamas at TP=2 and TP=4 -------------------------------------------------------

def write_tiny_llama(folder: Path, tokenizer, num_kv_heads: int, tie: bool) -> Path:
    torch.manual_seed(0)
    # A wide init keeps the top two logits apart, so greedy does not hinge on fp32 rounding.
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=num_kv_heads, max_position_embeddings=512,
        initializer_range=0.2, tie_word_embeddings=tie)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save(folder)
    return folder


TINY_PROMPTS = ["The capital of France is", "1, 2, 3, 5, 8,", "def f(x):\n    return", "Once upon a time " * 12]


TINY_KV_BYTES_PER_BLOCK = 2 * 2 * 4 * 8 * 4 * 16  # 2 layers, K and V, 4 KV heads of 8, fp32, block 16


@pytest.fixture(scope="module")
def tiny_folder(loaded, tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"), loaded.tokenizer, 4, False)


@pytest.fixture(scope="class")
def tiny_tp1(tiny_folder):
    return make_llm(load_model(tiny_folder), kv_cache_memory=40 * TINY_KV_BYTES_PER_BLOCK, **TP_OPTIONS)


@pytest.fixture(scope="class")
def tiny_tp2(tiny_folder):
    # 40 blocks per rank (half of each block's heads apiece): small enough to force preemption.
    with running(LLM(str(tiny_folder), tensor_parallel_size=2, kv_cache_memory=40 * TINY_KV_BYTES_PER_BLOCK // 2,
                     **TP_OPTIONS)) as llm:
        yield llm


class TestRandomLlamaAtTP2:
    """The last test kills a rank: the class's engine is spent after it."""

    @pytest.fixture
    def tp2(self, tiny_tp2):
        return tiny_tp2

    @pytest.fixture
    def tp1(self, tiny_tp1):
        return tiny_tp1

    def test_greedy_and_logprobs_match_tp1(self, tp2, tp1):
        assert tp2.engine.runner.kv_caches[0].shape[-2] == 2  # 2 of the 4 KV heads per rank
        _assert_close_to_tp1(tp2, tp1, [tp1.tokenizer.encode(p) for p in TINY_PROMPTS])

    def test_same_tokens_alone_in_a_busy_batch_with_preemption_and_prefix_hits(self, tp2, tp1):
        alone = check_busy_batch(tp2, expect_preemption=True)
        prompts, params = busy_batch(tp1.tokenizer)
        for i in BUSY_PROBES:
            if params[i].temperature == 0:
                assert alone[i] == tp1.generate([prompts[i]], params[i], use_tqdm=False)[0].outputs[0].token_ids

    def test_a_second_engine_in_the_process_is_refused(self, tiny_folder, tp2):
        with pytest.raises(ValueError, match="one per process"):
            LLM(str(tiny_folder), tensor_parallel_size=2, num_threads=1)

    def test_a_killed_rank_makes_generate_raise(self, tp2):
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        assert len(tp2.generate(["warm up"], params, use_tqdm=False)[0].outputs[0].token_ids) == 4
        (worker,) = tp2.engine.tp.ranks.procs
        assert_a_kill_fails_generate(tp2, worker.pid, "tensor-parallel rank 1 .* exited with code -9")


def assert_a_kill_fails_generate(llm: LLM, pid: int, match: str) -> None:
    """SIGKILL a rank's process: the next generate raises RankFailedError (`match`) within KILL_BOUND_S."""
    os.kill(pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(RankFailedError, match=match):
        llm.generate(["after the kill"], SamplingParams(max_tokens=200, ignore_eos=True), use_tqdm=False)
    print(f"generate raised {time.monotonic() - started:.1f} s after the kill")
    assert time.monotonic() - started < KILL_BOUND_S


def test_random_llama_tp4_with_replicated_kv_heads_matches_tp1(loaded, tmp_path):
    folder = write_tiny_llama(tmp_path / "tiny", loaded.tokenizer, 2, True)  # 2 KV heads, 4 ranks; tied head
    tp1 = make_llm(load_model(folder), kv_cache_memory=8 << 20, num_threads=1)
    with running(LLM(str(folder), tensor_parallel_size=4, kv_cache_memory=8 << 20, num_threads=1)) as llm:
        assert llm.engine.runner.kv_caches[0].shape[-2] == 1  # each KV head on the 2 ranks that read it
        _assert_close_to_tp1(llm, tp1, [tp1.tokenizer.encode(p) for p in TINY_PROMPTS])


# -- failures ------------------------------------------------------------------------------------

def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def test_a_killed_rank_makes_the_server_exit_nonzero(tiny_folder, tmp_path):
    server = start_server(tmp_path, "--model", str(tiny_folder), "--tensor-parallel-size", "2", "--num-threads", "1",
                          env={"PYTHONPATH": SRC})
    try:
        # The spawn machinery's resource tracker is a child too; the rank is the one running pagedserve.
        ranks = [p for p in _children(server.proc.pid)
                 if "multiprocessing.spawn" in Path(f"/proc/{p}/cmdline").read_text()
                 and "resource_tracker" not in Path(f"/proc/{p}/cmdline").read_text()]
        assert len(ranks) == 1, ranks
        os.kill(ranks[0], signal.SIGKILL)
        started = time.monotonic()
        code = server.proc.wait(timeout=KILL_BOUND_S)  # idle: the watcher notices, the crash path exits
        print(f"server exited {code} {time.monotonic() - started:.1f} s after its rank was killed")
        assert code != 0
        assert "tensor-parallel rank 1" in server.log()
    finally:
        server.stop()


# -- two nodes: two network namespaces joined by veth ---------------------------------------------

NS = ("psv-tp-a", "psv-tp-b")
ADDRS = ("10.213.7.1", "10.213.7.2")  # a private /30 that exists only inside the namespaces


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def veth_pair():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2's `ip` to make network namespaces (CI runs as root)")
    for ns in NS:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # a leftover from a killed run
    try:
        for ns in NS:
            _ip("netns", "add", ns)
        _ip("link", "add", "psv-veth-a", "netns", NS[0], "type", "veth", "peer", "name", "psv-veth-b", "netns", NS[1])
        for ns, dev, addr in zip(NS, ("psv-veth-a", "psv-veth-b"), ADDRS):
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield
    finally:
        for ns in NS:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


ENGINE_SCRIPT = """
import json, sys
from pagedserve import LLM, SamplingParams
if __name__ == "__main__":
    folder, init, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    llm = LLM(folder, tensor_parallel_size=2, nnodes=2, node_rank=0, distributed_init_method=init,
              kv_cache_memory=8 << 20, num_threads=1)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    print(json.dumps([o.outputs[0].token_ids for o in outs]))
    llm.engine.shutdown()
"""


def test_two_ranks_in_two_network_namespaces(veth_pair, tiny_folder, tmp_path):
    init = f"tcp://{ADDRS[0]}:29517"
    env = {**os.environ, "PYTHONPATH": SRC}
    common = ["--model", str(tiny_folder), "--tensor-parallel-size", "2", "--nnodes", "2",
              "--distributed-init-method", init, "--kv-cache-memory", str(8 << 20), "--num-threads", "1"]
    script = tmp_path / "engine.py"
    script.write_text(ENGINE_SCRIPT)
    procs = []
    try:
        with open(tmp_path / "worker.log", "wb") as log:
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", NS[1], sys.executable, "-m", "pagedserve.entrypoints.cli", "worker",
                 *common, "--node-rank", "1"], stdout=log, stderr=subprocess.STDOUT,
                env={**env, "GLOO_SOCKET_IFNAME": "psv-veth-b"}))
        procs.append(subprocess.Popen(
            ["ip", "netns", "exec", NS[0], sys.executable, str(script), str(tiny_folder), init, json.dumps(TINY_PROMPTS)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**env, "GLOO_SOCKET_IFNAME": "psv-veth-a"}))
        out, err = procs[1].communicate(timeout=300)
        assert procs[1].returncode == 0, err.decode()[-3000:]
        assert procs[0].wait(timeout=60) == 0, (tmp_path / "worker.log").read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    # The ranks' traffic (weights stay home; activations, logits and step messages) crossed the veth.
    link = json.loads(subprocess.run(["ip", "-n", NS[1], "-s", "-j", "link", "show", "dev", "psv-veth-b"],
                                     check=True, capture_output=True).stdout)[0]
    assert link["stats64"]["rx"]["bytes"] > 100_000 and link["stats64"]["tx"]["bytes"] > 100_000, link["stats64"]
    tp1 = make_llm(load_model(tiny_folder), kv_cache_memory=8 << 20, num_threads=1)
    want = [o.outputs[0].token_ids for o in tp1.generate(
        TINY_PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)]
    assert json.loads(out.decode().strip().splitlines()[-1]) == want
