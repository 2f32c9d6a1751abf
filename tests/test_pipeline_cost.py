"""The cost model: price x wall time, split over input and output tokens."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from pipeline.cost import TokenCounts, cost_report, format_report, split_cost


def test_cost_and_split():
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    counts = TokenCounts(rows_ok=9, rows_error=1, prompt_tokens=1000, cached_tokens=200, completion_tokens=100)
    r = cost_report(job_id="j", run_id="r", model="m", quantization=None, device="cpu", device_count=2,
                    started_at=t0, finished_at=t0 + timedelta(seconds=1800), price_per_device_hour=3.0,
                    counts=counts, rows_total=20, rows_skipped=10, rows_not_run=0,
                    output_token_weight=4.0)
    assert r.wall_s == 1800 and r.device_s == 3600
    assert r.cost_usd == pytest.approx(3.0)
    # input weight 800 (uncached), output weight 400 -> 2/3 : 1/3
    assert r.input_cost_usd == pytest.approx(2.0) and r.output_cost_usd == pytest.approx(1.0)
    assert r.usd_per_1m_input_tokens == pytest.approx(2.0 / 1000 * 1e6)
    assert r.usd_per_1m_output_tokens == pytest.approx(1.0 / 100 * 1e6)
    assert r.usd_per_1m_tokens == pytest.approx(3.0 / 1100 * 1e6)
    assert r.input_tokens_per_s == pytest.approx(1000 / 1800)
    assert r.rows_per_s == pytest.approx(10 / 1800)
    assert r.prefix_cache_hit_rate == pytest.approx(0.2)
    assert r.quantization == "none"
    text = format_report(r.as_row())
    assert "usd_per_1m_tokens" in text and "cost_usd" in text


def test_split_edge_cases():
    assert split_cost(1.0, TokenCounts(), 4.0) == (0.0, 0.0)  # no token computed: booked as neither
    assert split_cost(1.0, TokenCounts(prompt_tokens=10, cached_tokens=10), 4.0) == (0.0, 0.0)
    assert split_cost(1.0, TokenCounts(prompt_tokens=10), 4.0) == (1.0, 0.0)
    r = cost_report(job_id="j", run_id="r", model="m", quantization="q", device="d", device_count=1,
                    started_at=datetime.now(timezone.utc), finished_at=datetime.now(timezone.utc),
                    price_per_device_hour=1.0, counts=TokenCounts(), rows_total=0, rows_skipped=0,
                    rows_not_run=0)
    assert r.usd_per_1m_tokens is None and r.usd_per_1m_input_tokens is None


def test_counts_add():
    a = TokenCounts(1, 2, 3, 4, 5)
    assert a + a == TokenCounts(2, 4, 6, 8, 10)
