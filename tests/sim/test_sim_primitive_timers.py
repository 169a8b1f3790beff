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


def test_step_spread_times_identical_decodes_and_leaves_the_engine_empty(monkeypatch):
    from pagedserve.sim import twin

    monkeypatch.setattr(twin, "SPREAD_STEPS", 12)
    monkeypatch.setattr(twin, "SPREAD_DECODE_ROWS", 4)
    engine = LLM(kv_cache_memory=1 << 26, kernels="native").engine
    spread = twin.measure_step_spread(engine)
    assert len(spread) == 12 and list(spread) == sorted(spread) and all(f > 0 for f in spread)
    assert sum(spread) / len(spread) == pytest.approx(1.0)
    assert not engine.has_unfinished_requests()
    kv = engine.scheduler.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
