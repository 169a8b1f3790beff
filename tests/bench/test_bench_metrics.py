"""The benchmark arithmetic on hand-made records: percentiles, TPOT without the first token, goodput."""
from __future__ import annotations

import math

import pytest

from pagedserve.bench.serve import Outcome, parse_goodput, send_offsets, summary
from pagedserve.workload.serving_stats import SLO, RequestRecord, summarize


def test_tpot_excludes_first_token_and_counts_coalesced_chunks():
    # Sent at 0, first token at 1.0 s, then 4 more by 1.8 s: TPOT = 0.8 / 4.
    r = RequestRecord(0.0, 10, 5, token_times=[1.0, 1.2, 1.4, 1.6, 1.8])
    assert r.ttft == pytest.approx(1.0)
    assert r.tpot == pytest.approx(0.2)
    assert r.e2el == pytest.approx(1.8)
    # The same span streamed as 3 chunks holding 5 tokens: TPOT still over 4 gaps; ITLs are chunk gaps.
    c = RequestRecord(0.0, 10, 5, token_times=[1.0, 1.4, 1.8], num_output_tokens=5)
    assert c.tpot == pytest.approx(0.2)
    assert c.itls == pytest.approx([0.4, 0.4])
    assert RequestRecord(0.0, 1, 1, token_times=[0.5]).tpot is None


def test_summary_percentiles_and_throughput():
    recs = [RequestRecord(0.0, 4, 2, token_times=[t, t + 0.1]) for t in (0.1, 0.2, 0.3, 0.4, 1.0)]
    s = summarize(recs, duration=2.0, slo=SLO(None, None), percentiles=[50, 90])
    assert s["total_output_tokens"] == 10
    assert s["output_throughput"] == pytest.approx(5.0)
    assert s["total_token_throughput"] == pytest.approx(15.0)
    assert s["p50_ttft_ms"] == pytest.approx(300.0)
    assert s["p90_ttft_ms"] == pytest.approx(760.0)  # 0.4 + 0.6 * (1.0 - 0.4)
    assert s["mean_e2el_ms"] == pytest.approx(500.0)
    assert s["mean_tpot_ms"] == pytest.approx(100.0)


def test_goodput_counts_only_requests_meeting_every_target():
    fast = RequestRecord(0.0, 4, 3, token_times=[0.1, 0.15, 0.2])
    slow_first = RequestRecord(0.0, 4, 3, token_times=[0.6, 0.65, 0.7])
    slow_decode = RequestRecord(0.0, 4, 3, token_times=[0.1, 0.4, 0.7])
    recs = [fast, slow_first, slow_decode]
    slo = parse_goodput(["ttft:500", "tpot:100"])
    assert slo == SLO(ttft_s=0.5, itl_s=0.1, e2el_s=None)
    s = summarize(recs, 1.0, slo)
    assert s["goodput_requests"] == 1 and s["goodput"] == pytest.approx(3.0)
    assert summarize(recs, 1.0, parse_goodput(["e2el:650"]))["goodput_requests"] == 1
    assert summarize(recs, 1.0, parse_goodput(["e2el:800"]))["goodput_requests"] == 3


def test_failed_requests_are_counted_but_not_measured():
    ok = Outcome(RequestRecord(0.0, 4, 2, token_times=[0.2, 0.3], num_output_tokens=2), success=True)
    bad = Outcome(RequestRecord(0.0, 4, 2), error="HTTP 500")
    s = summary([ok, bad], 1.0, peak=2, slo=None, percentiles=[99])
    assert (s["successful_requests"], s["failed_requests"], s["peak_concurrency"]) == (1, 1, 2)
    assert s["total_output_tokens"] == 2 and "goodput" not in s
    assert s["p99_ttft_ms"] == pytest.approx(200.0)


@pytest.mark.parametrize("bad", [["ttft"], ["itl:5"], ["ttft:-1"]])
def test_bad_goodput_targets_are_rejected(bad):
    with pytest.raises(ValueError, match="goodput"):
        parse_goodput(bad)


def test_arrivals_have_the_requested_mean_rate_and_burstiness():
    assert send_offsets(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]
    for burstiness in (0.5, 1.0, 4.0):
        t = send_offsets(20_001, 50.0, burstiness, seed=1)
        gaps = [b - a for a, b in zip(t, t[1:])]
        mean = sum(gaps) / len(gaps)
        cv2 = sum((g - mean) ** 2 for g in gaps) / len(gaps) / mean**2
        assert mean == pytest.approx(1 / 50, rel=0.05)
        assert cv2 == pytest.approx(1 / burstiness, rel=0.1)  # gamma: CV^2 = 1 / shape
