"""Quantised linear layers against the oneDNN-prepacked fp32 layer, on the model's own
weights and shapes, speed and accuracy, measured in one process.

Variants (each over the same layers):
  * fp32: the default path, oneDNN-prepacked weights (model/llama.py Linear);
  * fbgemm: torch's dynamic int8 linear (per-channel int8 weights, activations quantised
    per tensor at run time, `reduce_range=True`, as torch's dynamic quantisation does);
  * q8_0, q4_0, q4_1: pagedserve's native op on llama.cpp's blocks, quantised from fp32 at
    load (model/quant.py QuantLinear; activations quantised per row per 32 values).

Whole decode steps (--decode-seqs): an engine on the fp32 model and one with
--quantization gguf (the file's own Q4_1 layers, Q8_0 head), N sequences at ~256 tokens of
context each, steps alternating between the engines; median step time.

Speed: for each shape, all 30 layers of that shape in turn (as in a forward, so no weight
stays in cache from one call to the next; the head is one 49152 x 576 matrix), median of
interleaved rounds, at 1-64 rows. Accuracy: ||y - y_fp32|| / ||y_fp32|| on activations
captured from a real prefill (every layer's actual inputs, the head on the final norm).

    .venv/bin/python benchmarks/quant_kernels.py [--rows 1,4,8,32,64] [--rounds 7] [--decode-seqs 1,4,32]
"""
from __future__ import annotations

import argparse
import statistics
import warnings

import torch

from pagedserve.engine_config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.kernels import resolve_kernels
from pagedserve.model.llama import PACK_ROWS_HINT
from pagedserve.model.loader import load_model
from pagedserve.model.quant import QTYPES, QuantLinear
from pagedserve.sampling_params import SamplingParams
from pagedserve.sim.twin import interleaved_medians
from linear_kernels import decode_engine, timed  # benchmarks/ is on sys.path when run as a script

SHAPES = ("qkv", "o", "gate_up", "down", "head")
CAPTURE_TEXT = (
    "The quick brown fox jumps over the lazy dog. Paged attention stores the key and value cache "
    "in fixed-size blocks, so that sequences of any length share one pool of memory without "
    "fragmentation, and continuous batching admits new requests at every step."
)


def layer_weights(model) -> dict[str, list[tuple[torch.Tensor, torch.Tensor | None]]]:
    """(fp32 weight, bias) of every layer of each shape, and the tied or own head."""
    out: dict[str, list] = {name: [] for name in SHAPES}
    for layer in model.layers:
        for name in SHAPES[:-1]:
            m = getattr(layer, name)
            out[name].append((m.weight.detach(), m.bias))
    out["head"].append((model.lm_head.weight.detach(), None))
    return out


def capture_activations(loaded) -> dict[str, list[torch.Tensor]]:
    """Each linear layer's real inputs during one prefill of CAPTURE_TEXT."""
    model = loaded.model
    captured: dict[str, list[torch.Tensor]] = {name: [] for name in SHAPES}
    hooks = []
    for layer in model.layers:
        for name in SHAPES[:-1]:
            hooks.append(getattr(layer, name).register_forward_hook(
                lambda m, args, out, name=name: captured[name].append(args[0].clone())))
    hooks.append(model.layers[-1].register_forward_hook(
        lambda m, args, out: captured["head"].append(model.norm(out).clone())))
    engine = LLMEngine(EngineConfig(kv_cache_memory="64MiB", kernels="torch"), loaded=loaded)
    engine.add_request(CAPTURE_TEXT, SamplingParams(temperature=0, max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    for h in hooks:
        h.remove()
    return captured


class Fp32Packed:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.packed, self.bias = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT), bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class Fbgemm:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        scales = (weight.abs().amax(dim=1) / 127).clamp_min(1e-12).double()
        zeros = torch.zeros(weight.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # the quantized-tensor API is deprecated in 2.13, still shipped
            warnings.simplefilter("ignore")
            q = torch.quantize_per_channel(weight, scales, zeros, 0, torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(q, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x, self.packed, True)


# name -> (fp32 weight, bias) -> a callable layer
VARIANTS = {
    "fp32": Fp32Packed,
    "fbgemm": Fbgemm,
    **{name: lambda w, b, qtype=QTYPES[name]: QuantLinear.from_float(w, qtype, b) for name in ("q8_0", "q4_0", "q4_1")},
}


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y - ref).norm() / ref.norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,8,32,64")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--decode-seqs", default="1,4,32", help="'' to skip the whole-step comparison")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--variants", default="fp32,fbgemm,q8_0,q4_1", help="fp32 (always first), "
                    + ", ".join(list(VARIANTS)[1:]))
    args = ap.parse_args()
    torch.backends.quantized.engine = "fbgemm"
    resolve_kernels("native")
    wanted = {"fp32", *args.variants.split(",")}
    variants = [name for name in VARIANTS if name in wanted]
    loaded = load_model(pack=False)
    weights = layer_weights(loaded.model)
    with torch.inference_mode():
        acts = capture_activations(loaded)
        layers = {v: {s: [VARIANTS[v](w, b) for w, b in weights[s]] for s in SHAPES} for v in variants}
        print(f"threads: {torch.get_num_threads()}")
        print("accuracy: median over layers of ||y - y_fp32|| / ||y_fp32|| on a real prefill's inputs "
              f"({acts['qkv'][0].shape[0]} rows)")
        for v in variants[1:]:
            errs = []
            for s in SHAPES:
                per_layer = [relative_error(q(x), ref(x)) for q, ref, x in
                             zip(layers[v][s], layers["fp32"][s], acts[s])]
                errs.append(f"{s} {sorted(per_layer)[len(per_layer) // 2]:.2%}")
            print(f"  {v}: " + ", ".join(errs))
        print("speed: median ms for all layers of a shape; ratio = fp32 / variant")
        header = f"{'shape':>8} {'rows':>5} " + " ".join(f"{v:>14}" for v in variants)
        print(header)
        for s in SHAPES:
            in_features = weights[s][0][0].shape[1]
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, in_features)
                fns = [lambda mods=layers[v][s]: [m(x) for m in mods] for v in variants]
                times = interleaved_medians(fns, args.rounds)
                cells = [f"{times[0] * 1e3:>8.2f}      "] + [
                    f"{t * 1e3:>7.2f} {times[0] / t:>5.2f}x" for t in times[1:]]
                print(f"{s:>8} {rows:>5} " + " ".join(cells))
    del layers
    if args.decode_seqs:
        decode_steps([int(n) for n in args.decode_seqs.split(",")], args.steps)


def decode_steps(seqs: list[int], steps: int) -> None:
    fp32 = load_model()  # prepacked, as the engine runs it
    gguf = load_model(quantization="gguf")
    for n in seqs:
        engines = decode_engine(fp32, n, 256), decode_engine(gguf, n, 256)
        times: list[list[float]] = [[], []]
        for _ in range(steps):
            for engine, record in zip(engines, times):
                record.append(timed(engine.step))
        tf, tq = (statistics.median(t) for t in times)
        print(f"decode step, {n} seqs x ~256 ctx: fp32 {tf * 1e3:.1f} ms, gguf {tq * 1e3:.1f} ms: {tf / tq:.2f}x")
        del engines


if __name__ == "__main__":
    main()
