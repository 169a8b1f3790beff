"""Engine start-up and step times at TP=1 and TP=N on SmolLM2, each rank on --threads threads,
with the ranks started by each --backend (mp: spawned processes; ray: Ray actors, on a local
Ray instance this script starts once, or the cluster RAY_ADDRESS names; its start-up is
reported apart as ray_init_s). With several backends the runs interleave --rounds times,
so a slow patch of a shared machine falls on all of them.

Per setting: the median of --repeats prefill steps (one --prompt-len-token prompt in one
step) and of decode steps with --decode-seqs running sequences. Correctness is what
tensor parallelism is tested for (tests/test_tensor_parallel.py); on a 2-core machine
the extra ranks share the same cores, so no speed-up is expected: these figures show
the cost of the collectives (two all-reduces per layer, the embedding's, the logits
gather) and the step broadcast.

    .venv/bin/python benchmarks/tp_step_times.py [--tp 1,3] [--threads 1] [--decode-seqs 1,8]
    .venv/bin/python benchmarks/tp_step_times.py --tp 2 --backend mp,ray --rounds 3   # Ray's overhead
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from pagedserve.engine_config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.sampling_params import SamplingParams


def timed_steps(engine: LLMEngine, n: int) -> list[float]:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    return times


def measure(tp: int, threads: int, prompt_len: int, decode_seqs: list[int], repeats: int,
            backend: str = "mp") -> dict:
    started = time.perf_counter()
    engine = LLMEngine(EngineConfig(tensor_parallel_size=tp, num_threads=threads, max_num_batched_tokens=prompt_len,
                                    enable_prefix_caching=False, kv_cache_memory=64 << 20,
                                    distributed_executor_backend=backend))
    startup_s = time.perf_counter() - started
    try:
        prompt = [(i * 7919) % 20000 + 100 for i in range(prompt_len)]
        prefill = []
        for _ in range(repeats):
            engine.add_request(prompt, SamplingParams(max_tokens=1))
            prefill += timed_steps(engine, 1)
            while engine.has_unfinished_requests():
                engine.step()
        decode = {}
        for seqs in decode_seqs:
            for i in range(seqs):
                engine.add_request(prompt[: 16 + i], SamplingParams(max_tokens=repeats + 4, ignore_eos=True))
            while len(engine.scheduler.running) < seqs or not all(r.is_decode for r in engine.scheduler.running):
                engine.step()
            decode[seqs] = statistics.median(timed_steps(engine, repeats)) * 1e3
            while engine.has_unfinished_requests():
                engine.step()
        return {"tp": tp, "backend": backend, "threads_per_rank": threads, "startup_s": round(startup_s, 2),
                f"prefill_{prompt_len}_ms": statistics.median(prefill) * 1e3,
                **{f"decode_{k}_ms": v for k, v in decode.items()}}
    finally:
        engine.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", default="1,3")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--decode-seqs", default="1,8")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--backend", default="mp", help="mp, ray or both (mp,ray); ray needs --tp > 1")
    p.add_argument("--rounds", type=int, default=1, help="times each setting runs, interleaved")
    args = p.parse_args()
    backends = args.backend.split(",")
    if "ray" in backends:
        import ray

        started = time.perf_counter()
        # A local instance gets a logical CPU per rank thread even where the host has fewer
        # cores (a 2-core machine runs TP=3): the placement group reserves them.
        most = max(map(int, args.tp.split(","))) * args.threads
        ray.init(**({} if os.environ.get("RAY_ADDRESS") else {"num_cpus": max(os.cpu_count() or 1, most)}))
        print(json.dumps({"ray_init_s": round(time.perf_counter() - started, 2)}), flush=True)
    for _ in range(args.rounds):
        for tp in map(int, args.tp.split(",")):
            for backend in backends:
                print(json.dumps(measure(tp, args.threads, args.prompt_len,
                                         [int(x) for x in args.decode_seqs.split(",")], args.repeats, backend)),
                      flush=True)


if __name__ == "__main__":
    main()
