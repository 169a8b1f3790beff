"""The calibration's split of a real step: what its timers attribute to linear layers."""
from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.sim.twin import PrimitiveTimers


@pytest.mark.parametrize("options", [{"kernels": "native"}, {"kernels": "native", "gguf_weights": "dense"},
                                     {"kernels": "torch"}])
def test_every_linear_layer_call_is_timed_whatever_the_weights(options):
    llm = LLM(kv_cache_memory=1 << 26, **options)
    engine = llm.engine
    layers = engine.runner.model.linear_layers()
    calls = []
    handles = [m.register_forward_hook(lambda *a: calls.append(1)) for m in layers]
    timers = PrimitiveTimers(engine)
    try:
        engine.add_request(list(range(100, 164)), SamplingParams(max_tokens=2, ignore_eos=True))
        engine.step()
        # One prefill step: every layer ran once, and the timers saw each (GGUF blocks
        # are QuantLinear modules, which an isinstance check on nn.Linear missed).
        assert len(calls) == len(layers) and timers.linear > 0
    finally:
        timers.close()
        for h in handles:
            h.remove()
