"""Merging (remote, local) block pairs into runs: one descriptor per contiguous stretch."""

from __future__ import annotations

import pytest

from kv_transfer import merge_block_runs


def test_contiguous_pairs_make_one_run():
    assert merge_block_runs([3, 4, 5, 6], [0, 1, 2, 3]) == [(3, 0, 4)]


def test_run_then_single():
    assert merge_block_runs([3, 4, 5, 9], [0, 1, 2, 7]) == [(3, 0, 3), (9, 7, 1)]


def test_non_contiguous_ids_stay_separate():
    assert merge_block_runs([0, 2, 4], [1, 3, 5]) == [(0, 1, 1), (2, 3, 1), (4, 5, 1)]


def test_both_sides_must_be_contiguous():
    # remote contiguous, local not (and the reverse): no merge
    assert merge_block_runs([1, 2, 3], [5, 9, 10]) == [(1, 5, 1), (2, 9, 2)]
    assert merge_block_runs([5, 9, 10], [1, 2, 3]) == [(5, 1, 1), (9, 2, 2)]


def test_reversed_order_does_not_merge():
    assert merge_block_runs([5, 4, 3], [2, 1, 0]) == [(5, 2, 1), (4, 1, 1), (3, 0, 1)]


def test_single_and_empty():
    assert merge_block_runs([7], [0]) == [(7, 0, 1)]
    assert merge_block_runs([], []) == []


def test_runs_cover_every_pair_in_order():
    remote = [10, 11, 12, 40, 41, 7, 8, 100]
    local = [0, 1, 2, 3, 4, 9, 10, 5]
    runs = merge_block_runs(remote, local)
    assert runs == [(10, 0, 3), (40, 3, 2), (7, 9, 2), (100, 5, 1)]
    expanded = [(r + k, lo + k) for r, lo, n in runs for k in range(n)]
    assert expanded == list(zip(remote, local))


def test_length_mismatch_is_an_error():
    with pytest.raises(ValueError, match="3 remote block ids but 2 local"):
        merge_block_runs([1, 2, 3], [1, 2])
