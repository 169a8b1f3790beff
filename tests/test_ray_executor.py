"""`--distributed-executor-backend ray` on a real two-node Ray cluster on this host (head +
a second node, 2 CPUs each; tests/ray_cluster.py): the ranks are Ray actors in a placement
group, the engine (rank 0) is this process, and the tokens are TP=1's.

Default run: a random-weight Llama at TP=2 with 2 threads a rank, which the engine's node
cannot hold beside rank 0, so the group is SPREAD and rank 1 runs on the second node; its
greedy tokens are TP=1's; then its actor is killed and generate raises. Slow: SmolLM2 at
TP=3 across the nodes against TP=1, and `pagedserve serve` exiting non-zero when a rank
actor is killed."""
from __future__ import annotations

import os
import signal
import time

import pytest

from engine_utils import make_llm
from pagedserve import LLM, SamplingParams
from pagedserve.engine_config import EngineConfig
from pagedserve.distributed.ray_ranks import placement_strategy
from pagedserve.model.loader import load_model
from server.server_process import start_server
from test_tensor_parallel import KILL_BOUND_S, TINY_PROMPTS, assert_a_kill_fails_generate, running, write_tiny_llama

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_the_group_packs_on_one_node_only_when_the_engine_node_holds_every_rank():
    def parallel(**options):
        return EngineConfig(**options).resolve("cpu").parallel

    assert placement_strategy(4, parallel(tensor_parallel_size=2, num_threads=2)) == "STRICT_PACK"
    assert placement_strategy(2, parallel(tensor_parallel_size=2, num_threads=2)) == "SPREAD"
    assert placement_strategy(2, parallel(tensor_parallel_size=3)) == "SPREAD"  # 1 CPU a rank by default
    assert placement_strategy(3, parallel(tensor_parallel_size=3)) == "STRICT_PACK"


@pytest.fixture
def on_cluster(ray_test_cluster, monkeypatch):
    """This process joins the cluster as the engine's driver."""
    monkeypatch.setenv("RAY_ADDRESS", ray_test_cluster.address)
    monkeypatch.setenv("RAY_AUTH_MODE", ray_test_cluster.env["RAY_AUTH_MODE"])
    return ray_test_cluster


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"), load_model().tokenizer, 4, False)


def _greedy(llm: LLM, prompts: list[str]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _nodes(llm: LLM) -> set[str]:
    import ray

    return {ray.get_runtime_context().get_node_id()} | {p.node_id for p in llm.engine.tp.ranks.places}


def test_tp2_spread_over_two_nodes_gives_tp1_tokens_and_a_killed_actor_fails_generate(on_cluster, tiny_folder):
    want = _greedy(make_llm(load_model(tiny_folder), kv_cache_memory=8 << 20, num_threads=1), TINY_PROMPTS)
    started = time.monotonic()
    with running(LLM(str(tiny_folder), tensor_parallel_size=2, distributed_executor_backend="ray", num_threads=2,
                     kv_cache_memory=8 << 20)) as llm:
        print(f"TP=2 engine on Ray up in {time.monotonic() - started:.1f} s")
        assert len(_nodes(llm)) == 2  # rank 0 here, rank 1 on the other node
        assert _greedy(llm, TINY_PROMPTS) == want
        (place,) = llm.engine.tp.ranks.places
        assert_a_kill_fails_generate(llm, place.pid, "tensor-parallel rank 1 .*(died|stopped answering)")


@pytest.mark.slow  # three SmolLM2 shards, two of them in fresh Ray workers: ~1 min under load
def test_smollm2_tp3_across_two_nodes_gives_tp1_tokens(on_cluster, reference_prompts):
    want = _greedy(make_llm(load_model(), kv_cache_memory=16 << 20, num_threads=1), reference_prompts)
    with running(LLM(tensor_parallel_size=3, distributed_executor_backend="ray", num_threads=1,
                     kv_cache_memory=16 << 20)) as llm:
        assert len(_nodes(llm)) == 2  # 3 bundles of 1 CPU do not fit a 2-CPU node: SPREAD
        assert _greedy(llm, reference_prompts) == want


@pytest.mark.slow  # a server process and its rank actor: ~30 s under load
def test_a_killed_rank_actor_makes_the_server_exit_nonzero(on_cluster, tiny_folder, tmp_path):
    server = start_server(tmp_path, "--model", str(tiny_folder), "--tensor-parallel-size", "2", "--num-threads", "1",
                          "--distributed-executor-backend", "ray",
                          env=on_cluster.env)
    try:
        rank_pids = [p for p in on_cluster.pids() if "RankActor" in open(f"/proc/{p}/cmdline").read()]
        assert len(rank_pids) == 1, rank_pids
        os.kill(rank_pids[0], signal.SIGKILL)
        started = time.monotonic()
        code = server.proc.wait(timeout=KILL_BOUND_S)
        print(f"server exited {code} {time.monotonic() - started:.1f} s after its rank actor was killed")
        assert code != 0
        assert "tensor-parallel rank 1" in server.log()
    finally:
        server.stop()
