"""p95 TTFT and TPOT per worker from the workers' histograms, over each scrape interval."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from adaptermesh.control_plane.metrics_source import Target, _observe, _WorkerHistory
from adaptermesh.worker_scrape import interval_quantile, parse_metrics

BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)


def exposition() -> tuple[CollectorRegistry, Histogram, Histogram]:
    r = CollectorRegistry()
    ttft = Histogram("adaptermesh_time_to_first_token_seconds", "t", registry=r, buckets=BUCKETS)
    tpot = Histogram("adaptermesh_time_per_output_token_seconds", "t", registry=r, buckets=BUCKETS)
    return r, ttft, tpot


def test_interval_p95_comes_from_the_new_observations_only() -> None:
    r, ttft, tpot = exposition()
    for _ in range(100):
        ttft.observe(0.015)  # before the interval: fast
    before = parse_metrics(generate_latest(r).decode())
    for i in range(100):
        ttft.observe(0.3 if i < 90 else 1.5)  # in the interval: slow, with a tail
        tpot.observe(0.04)
    now = parse_metrics(generate_latest(r).decode())
    p95 = interval_quantile(0.95, now.ttft_buckets, before.ttft_buckets)
    assert p95 is not None
    assert 1.0 < p95 <= 2.0  # the tail bucket, not the earlier fast requests
    hist = _WorkerHistory(sample=before, at=0.0)
    obs = _observe(Target("s", "10.0.0.1", 1), hist, now, 5.0)
    assert obs.ttft_p95_s == pytest.approx(p95)
    assert obs.tpot_p95_s is not None
    assert 0.02 < obs.tpot_p95_s <= 0.05


def test_no_new_observation_or_a_reset_gives_none() -> None:
    r, ttft, _ = exposition()
    ttft.observe(0.1)
    a = parse_metrics(generate_latest(r).decode())
    assert interval_quantile(0.95, a.ttft_buckets, a.ttft_buckets) is None
    r2, _, _ = exposition()  # a restarted worker: counters start again
    b = parse_metrics(generate_latest(r2).decode())
    assert interval_quantile(0.95, b.ttft_buckets, a.ttft_buckets) is None
    assert interval_quantile(0.95, (), ()) is None


@settings(max_examples=200, deadline=None)
@given(
    before=st.lists(st.integers(0, 50), min_size=len(BUCKETS) + 1, max_size=len(BUCKETS) + 1),
    added=st.lists(st.integers(0, 50), min_size=len(BUCKETS) + 1, max_size=len(BUCKETS) + 1),
    q=st.floats(0.01, 0.99),
)
def test_interval_quantile_stays_inside_the_buckets(
    before: list[int], added: list[int], q: float
) -> None:
    bounds = (*BUCKETS, math.inf)

    def cumulative(counts: list[int]) -> tuple[tuple[float, float], ...]:
        out, acc = [], 0.0
        for le, c in zip(bounds, counts, strict=True):
            acc += c
            out.append((le, acc))
        return tuple(out)

    b = cumulative(before)
    n = cumulative([x + y for x, y in zip(before, added, strict=True)])
    got = interval_quantile(q, n, b)
    if sum(added) == 0:
        assert got is None
        return
    if got is None:  # only when the quantile falls in +Inf with nothing finite below it
        assert sum(added[:-1]) == 0
        return
    assert 0.0 <= got <= BUCKETS[-1]
    assert math.isfinite(got)
