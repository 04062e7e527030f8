"""The serving benchmark's prefix dataset: tenants share their prefix exactly, and a skew makes a
few tenants hot."""

from __future__ import annotations

from collections import Counter

from loadgen.serving_datasets import prefix_dataset


def test_prefix_requests_share_their_tenants_prefix_and_nothing_else():
    reqs = prefix_dataset(40, 4, 32, 8, 5, 1000, seed=1)
    by_tenant: dict[int, list[list[int]]] = {}
    for r in reqs:
        assert len(r.prompt) == 40 and r.max_tokens == 5
        by_tenant.setdefault(r.tenant, []).append(r.prompt)
    prefixes = {t: ps[0][:32] for t, ps in by_tenant.items()}
    assert all(p[:32] == prefixes[t] for t, ps in by_tenant.items() for p in ps)
    assert len({tuple(p) for p in prefixes.values()}) == len(prefixes)


def test_skew_makes_the_first_tenants_hot_and_zero_skew_is_uniform():
    hot = Counter(r.tenant for r in prefix_dataset(2000, 8, 4, 1, 1, 1000, seed=0, skew=1.2))
    flat = Counter(r.tenant for r in prefix_dataset(2000, 8, 4, 1, 1, 1000, seed=0))
    assert hot[0] > 3 * hot[7] and hot[0] > hot[1] > hot[3]
    assert max(flat.values()) < 1.5 * min(flat.values())
