"""The ingress's per-token histogram (``ingress.metrics.TokenHistogram``) exports what
``prometheus_client.Histogram`` would for the same samples: the same series, buckets and counts."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ingress.metrics import ITL_BUCKETS, IngressMetrics, TokenHistogram


def _samples(registry) -> dict:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if not s.name.endswith("_created")
    }


def test_equal_to_prometheus_histogram_for_the_same_samples():
    ours_registry, theirs_registry = CollectorRegistry(), CollectorRegistry()
    ours = TokenHistogram("itl_seconds", "doc", ["model_name"], ITL_BUCKETS, ours_registry)
    theirs = Histogram("itl_seconds", "doc", ["model_name"], buckets=ITL_BUCKETS, registry=theirs_registry)
    rng = random.Random(0)
    # Values on the bucket bounds (le is inclusive), between them, above the last and zero.
    values = [*ITL_BUCKETS, 0.0, 0.0031, 7.5, *(rng.random() * 0.3 for _ in range(200))]
    for value in values:
        model = rng.choice(["a", "b"])
        n = rng.randint(1, 4)
        ours.labels(model).observe_n(value, n)
        for _ in range(n):
            theirs.labels(model).observe(value)
    ours_samples, theirs_samples = _samples(ours_registry), _samples(theirs_registry)
    assert ours_samples.keys() == theirs_samples.keys()
    for key, value in theirs_samples.items():
        assert ours_samples[key] == pytest.approx(value, rel=1e-9), key
    assert ours_samples[("itl_seconds_bucket", (("le", "0.001"), ("model_name", "a")))] > 0


def test_a_token_gap_is_split_over_the_tokens_that_came_together():
    m = IngressMetrics("model")
    m.observe_token_gap(0.04, 4)  # four tokens 40 ms after the last: four samples of 10 ms
    m.observe_token_gap(0.0, 0)
    samples = _samples(m.registry)
    front = ("frontend", "0")
    key = ("pdserve_inter_token_latency_seconds_bucket", (front, ("le", "0.01"), ("model_name", "model")))
    assert samples[key] == 4
    below = ("pdserve_inter_token_latency_seconds_bucket", (front, ("le", "0.005"), ("model_name", "model")))
    assert samples[below] == 0
    assert samples[
        ("pdserve_inter_token_latency_seconds_sum", (front, ("model_name", "model")))
    ] == pytest.approx(0.04)


def test_front_ends_sharing_a_port_export_series_of_their_own():
    """A scrape reaches one of the front ends on a port: each labels its series with its id, so a
    counter never jumps from one process's value to another's (read as a reset by ``rate()``)."""
    a, b = IngressMetrics("model", frontend="r1"), IngressMetrics("model", frontend="r2")
    for _ in range(3):
        a.count("success")
    b.count("success")
    a.observe_ttft(0.1)
    for m, front, done in ((a, "r1", 3), (b, "r2", 1)):
        samples = _samples(m.registry)
        key = (
            "pdserve_requests_total",
            (("frontend", front), ("model_name", "model"), ("status", "success")),
        )
        assert samples[key] == done
        assert all(dict(labels).get("frontend") == front for _, labels in samples)
