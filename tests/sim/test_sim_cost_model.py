"""The roofline's arithmetic on a toy model small enough to compute by hand."""
import json

import pytest

from pagedserve.model.config import ModelConfig
from pagedserve.sim.cost_model import CostModel
from pagedserve.sim.hardware import Calibration, Hardware, MeasuredRates, rate_at

# h=8, 2 heads x 4 = q 8, 2 KV heads x 4 = kv 8, I=16, 2 layers, vocab 100, tied:
# per layer 8*(8+16) + 8*8 + 3*8*16 = 640; params 2*640 + 800 = 2080, body 1280.
TOY = ModelConfig("llama", 100, 8, 16, 2, 2, 2, 4, 1e-5, 1e4, 1024, True)
HW = Hardware("toy", 10**9, 1000.0, {"bf16": 1e4, "fp8": 2e4, "fp32": 5e3}, 100.0, 0.0, 1.0, 1.0)


def test_prefill_is_compute_bound_by_hand():
    c = CostModel(TOY, HW, "bf16").cost([(100, 0)], 1)
    # linear 2*1280*100 + 2*800*1 = 257,600; attention 4*2*2*4 * 100*101/2 = 323,200
    assert c.flops == 580_800
    assert c.compute_s == pytest.approx(58.08)
    # weights 2080*2 + KV 64 B/token * 100 + activations 2*(32+16+16+48)*2 = 448 B/token * 100
    assert c.bytes == 4160 + 6400 + 44_800
    assert c.compute_bound and c.seconds == pytest.approx(58.08)


def test_decode_is_bandwidth_bound_by_hand():
    c = CostModel(TOY, HW, "bf16").cost([(1, 50)] * 4, 4)
    assert c.compute_s == pytest.approx((2 * 1280 * 4 + 1600 * 4 + 64 * 4 * 51) / 1e4)
    assert c.bytes == 4160 + 64 * 204 + 448 * 4
    assert not c.compute_bound and c.seconds == pytest.approx(19.008)


def test_tensor_parallel_divides_work_and_adds_allreduce():
    one = CostModel(TOY, HW, "bf16").cost([(1, 50)] * 4, 4)
    two = CostModel(TOY, HW, "bf16", tp=2).cost([(1, 50)] * 4, 4)
    assert two.compute_s == pytest.approx(one.compute_s / 2)
    assert two.bytes == pytest.approx(one.bytes / 2)
    # 2 all-reduces/layer x 2 layers x 8 x 2 B per token, ring factor 2*(2-1)/2, 4 tokens, 100 B/s; 10 us each
    assert two.comm_s == pytest.approx(64 * 4 / 100 + 4 * 10e-6)
    assert two.seconds == pytest.approx(9.504 + 2.56004)


def test_fp8_halves_body_weights_and_kv_but_keeps_the_head_bf16():
    bf16 = CostModel(TOY, HW, "bf16")
    fp8 = CostModel(TOY, HW, "fp8")
    # Body 1280 params at 1 B; the (tied) head/embedding's 800 stay at 2 B, as FP8 checkpoints keep them.
    assert fp8.weight_bytes == 1280 + 800 * 2 and bf16.weight_bytes == 2080 * 2
    assert fp8.kv_bytes_per_token == bf16.kv_bytes_per_token / 2
    act = 448 * 4  # activations stay 16-bit
    assert fp8.cost([(1, 50)] * 4, 4).bytes == 2880 + 32 * 204 + act
    # Body GEMMs at the FP8 rate, the head at BF16's, attention at BF16's.
    assert fp8.cost([(100, 0)], 1).compute_s == pytest.approx(256_000 / 2e4 + 1600 / 1e4 + 323_200 / 1e4)
    assert CostModel(TOY, HW, "fp8", kv_dtype="bf16").kv_bytes_per_token == bf16.kv_bytes_per_token


def test_untied_fp8_model_keeps_embedding_and_head_bf16():
    untied = ModelConfig("llama", 100, 8, 16, 2, 2, 2, 4, 1e-5, 1e4, 1024, False)
    assert CostModel(untied, HW, "fp8").weight_bytes == 1280 + 2 * 800 * 2


def test_overhead_is_added_once_and_empty_step_costs_nothing():
    hw = Hardware("toy", 10**9, 1000.0, {"bf16": 1e4}, 100.0, 0.5, 1.0, 1.0)
    assert CostModel(TOY, hw).cost([(1, 50)] * 4, 4).seconds == pytest.approx(19.508)
    assert CostModel(TOY, hw).cost([], 0).seconds == 0.0


@pytest.mark.parametrize("kwargs", [{"weight_dtype": "int3"}, {"kv_dtype": "fp4"}, {"tp": 3}, {"tp": 0}])
def test_invalid_setup_raises(kwargs):
    with pytest.raises(ValueError):
        CostModel(TOY, HW, **kwargs)


# cpu-local: measured rates priced by hand. Ladders of (rows, FLOP/s).
RATES = MeasuredRates(linear=((1, 1e3), (4, 2e3)), head=((1, 500.0), (4, 1e3)), attention_flops=1e4,
                      kv_bandwidth=1e4, attention_call_s=0.01, overhead_per_token_s=0.001, min_prefill_len=16)
CPU = Hardware("cpu-local", 10**9, 1e4, {"fp32": 1e9}, 1e4, 0.5, 1.0, 1.0, measured=RATES)


def test_rate_between_rungs_interpolates_time_not_rate():
    ladder = ((1, 1e3), (4, 2e3), (16, 4e3))
    assert rate_at(ladder, 1) == 1e3 and rate_at(ladder, 4) == 2e3
    # 1 ms per FLOP-row at 1 row, 2 ms at 4: 2 rows take 1 + 1/3 ms per FLOP-row.
    assert rate_at(ladder, 2) == pytest.approx(2 / (4 / 3 * 1e-3))
    assert rate_at(ladder, 100) == 4e3  # beyond the ladder the last rung holds


def test_measured_rates_add_up_serially_by_hand():
    c = CostModel(TOY, CPU, "fp32").cost([(1, 50)] * 4, 4)
    linear = 2 * 1280 * 4 / 2e3  # the rung at 4 rows
    head = 1600 * 4 / 1e3
    kv = 128 * 204 / 1e4  # decodes read their context: fp32 K and V, 2 layers x 2 x 2 heads x 4 x 4 B per token
    overhead = 0.5 + 2 * 0.01 + 0.001 * 4
    assert c.compute_s == pytest.approx(linear + head)  # a decode's attention FLOPs ride on its read
    assert c.memory_s == pytest.approx(kv)
    assert c.seconds == pytest.approx(linear + head + kv + overhead)


def test_measured_prefill_chunk_pays_attention_flops_and_gathers_only_its_context():
    # 20 new tokens (>= min_prefill_len) after 30: 20*30 + 20*21/2 = 810 pairs, 30 tokens gathered.
    c = CostModel(TOY, CPU, "fp32").cost([(20, 30), (1, 9)], 1)
    assert c.memory_s == pytest.approx(128 * (30 + 10) / 1e4)
    attention = 64 * 810 / 1e4
    assert c.compute_s == pytest.approx(2 * 1280 * 21 / 2e3 + 1600 / 500 + attention)


def test_measured_linear_rate_follows_the_step_token_count():
    # 2 tokens: the linear layers run at the interpolated 1,500 FLOP/s; nothing sampled, no head.
    assert CostModel(TOY, CPU, "fp32").cost([(2, 0)], 0).compute_s == pytest.approx(2 * 1280 * 2 / 1500)


def test_measured_hardware_refuses_tensor_parallelism():
    with pytest.raises(ValueError, match="tp"):
        CostModel(TOY, CPU, "fp32", tp=2)


def test_calibration_round_trips_and_rejects_an_old_file(tmp_path):
    cal = Calibration(RATES, 1e9, 0.002, 10**9, 2, "smollm2-135m")
    path = cal.save(tmp_path / "cpu-local.json")
    assert Calibration.load(path) == cal
    assert Calibration.load(path).hardware().measured == RATES
    path.write_text('{"matmul_flops": 1e9, "mem_bandwidth": 1e9, "step_overhead_s": 0.06, '
                    '"memory_bytes": 1, "num_threads": 2}')
    with pytest.raises(ValueError, match="calibrate"):
        Calibration.load(path)


def test_calibration_carries_the_step_spread_and_loads_a_file_without_one(tmp_path):
    cal = Calibration(RATES, 1e9, 0.002, 10**9, 2, "smollm2-135m", step_spread=(0.9, 1.0, 1.1))
    path = cal.save(tmp_path / "cpu-local.json")
    assert Calibration.load(path) == cal
    assert Calibration.load(path).hardware().step_spread == (0.9, 1.0, 1.1)
    older = json.loads(path.read_text())
    del older["step_spread"]
    path.write_text(json.dumps(older))
    assert Calibration.load(path).hardware().step_spread == ()


def test_ladder_rows_must_ascend():
    with pytest.raises(ValueError, match="linear"):
        MeasuredRates(((4, 1.0), (1, 1.0)), ((1, 1.0),), 1.0, 1.0, 0.0, 0.0, 16)
