"""Linear layers with oneDNN-prepacked weights (the default) against plain F.linear.

Two models over the same weights, one packed and one plain, measured in turn so that
load on the shared machine reaches both alike:
  * every layer's qkv, o, gate_up and down (as in a forward: no weight stays in cache)
    and the LM head, at 1-1,024 rows; median of interleaved rounds;
  * whole engine steps: N sequences decoding at ~256 tokens of context, and a
    1,024-token prefill, one engine per model, steps alternating;
  * batch invariance: the largest difference between a row computed alone and the
    same row inside batches of 2-300 rows.

    .venv/bin/python benchmarks/linear_kernels.py [--rows 1,2,4,8,16,32,64,256,1024] [--decode-seqs 1,4,32,64]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedserve.engine_config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.model.loader import load_model
from pagedserve.sim.twin import interleaved_medians
from step_speed import prefill_step_seconds, start_decoding  # benchmarks/ is on sys.path when run as a script


def layer_calls(model, rows: int):
    modules = model.linear_layers()
    x = {m.in_features: torch.randn(rows, m.in_features) for m in modules}
    h = torch.randn(rows, model.config.hidden_size)

    def body() -> None:
        for m in modules:
            m(x[m.in_features])

    return body, lambda: model.lm_head(h)


def decode_engine(loaded, num_seqs: int, context: int) -> LLMEngine:
    engine = LLMEngine(EngineConfig(kv_cache_memory="1GiB"), loaded=loaded)
    start_decoding(engine, num_seqs, context, max_tokens=1000)
    for _ in range(3):
        engine.step()
    return engine


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def batch_invariance(model, max_rows: int = 300) -> float:
    """Largest |difference| over all linear shapes between rows computed one at a time
    and the same rows inside batches of 2..max_rows."""
    worst = 0.0
    layer = model.layers[0]
    for m in (layer.qkv, layer.o, layer.gate_up, layer.down, model.lm_head):
        x = torch.randn(max_rows, m.in_features)
        alone = torch.cat([m(x[i : i + 1]) for i in range(max_rows)])
        for rows in (2, 3, 5, 8, 16, 17, 32, 64, 65, 128, max_rows):
            worst = max(worst, (m(x[:rows]) - alone[:rows]).abs().max().item())
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,256,1024")
    ap.add_argument("--decode-seqs", default="1,4,32,64")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    packed, plain = load_model(pack=True), load_model(pack=False)
    if packed.model.lm_head.weight is not None:
        raise SystemExit("this torch has no oneDNN: nothing was packed")
    c = packed.config
    body_flops = 2 * (c.num_params - c.vocab_size * c.hidden_size)
    head_flops = 2 * c.vocab_size * c.hidden_size
    print(f"threads: {torch.get_num_threads()}")
    print(f"{'rows':>6} {'layers plain':>13} {'packed':>8} {'speedup':>8} {'head plain':>11} {'packed':>8} {'speedup':>8}  (GFLOP/s)")
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            fns = [*layer_calls(plain.model, rows), *layer_calls(packed.model, rows)]
            lp, hp, lk, hk = interleaved_medians(fns, args.rounds)
            g = lambda flops, s: flops * rows / s / 1e9  # noqa: E731
            print(f"{rows:>6} {g(body_flops, lp):>13.1f} {g(body_flops, lk):>8.1f} {lp / lk:>7.2f}x "
                  f"{g(head_flops, hp):>11.1f} {g(head_flops, hk):>8.1f} {hp / hk:>7.2f}x")
        print(f"batch invariance, largest |row alone - row in a batch|: packed {batch_invariance(packed.model):.1e}, "
              f"plain {batch_invariance(plain.model):.1e}")
    for n in (int(s) for s in args.decode_seqs.split(",")):
        engines = decode_engine(plain, n, 256), decode_engine(packed, n, 256)
        times = [[], []]
        for _ in range(args.steps):
            for engine, record in zip(engines, times):
                record.append(timed(engine.step))
        tp, tk = (statistics.median(t) for t in times)
        print(f"decode step, {n} seqs x ~256 ctx: plain {tp * 1e3:.1f} ms, packed {tk * 1e3:.1f} ms: {tp / tk:.2f}x")
        del engines
    engines = [LLMEngine(EngineConfig(kv_cache_memory="512MiB", max_num_batched_tokens=1024), loaded=m)
               for m in (plain, packed)]
    times = [[prefill_step_seconds(e, 1024, r) for e in engines] for r in range(5)]
    tp, tk = (statistics.median(t[i] for t in times) for i in (0, 1))
    print(f"prefill step, 1,024 tokens: plain {tp * 1e3:.0f} ms, packed {tk * 1e3:.0f} ms: {tp / tk:.2f}x")


if __name__ == "__main__":
    main()
