import math

import pytest

from pagedserve.workload.serving_stats import SLO, RequestRecord, percentile, summarize


def test_percentile_interpolates_linearly():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10], 99) == 10
    assert percentile(list(range(101)), 99) == 99
    assert percentile([0, 10], 99) == pytest.approx(9.9)
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1], 101)


def test_summary_ttft_itl_goodput_by_hand():
    fast = RequestRecord(0.0, 10, 3, [0.5, 0.6, 0.7])  # ttft 0.5, itl 0.1 0.1
    slow = RequestRecord(1.0, 10, 2, [4.0, 4.5])  # ttft 3.0, itl 0.5
    s = summarize([fast, slow], duration=5.0, slo=SLO(ttft_s=1.0, itl_s=0.2))
    assert s["output_throughput"] == 1.0
    assert s["mean_ttft_ms"] == pytest.approx(1750)
    assert s["mean_itl_ms"] == pytest.approx(700 / 3)
    assert s["p99_itl_ms"] == pytest.approx(100 + 0.98 * 400)
    # only `fast` met both targets: 3 tokens in 5 s
    assert s["goodput"] == pytest.approx(0.6) and s["goodput_requests"] == 1
