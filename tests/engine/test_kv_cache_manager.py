"""KVCacheManager: prefix hits, admission checks, forks with copy-on-write, swapping, freeing."""

from __future__ import annotations

from engine.block_pool import BlockStored
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams

BS = 16


def make_request(rid: str, prompt: list[int], *, sample_index: int = 0, n: int = 1) -> Request:
    params = SamplingParams(n=n, max_tokens=8)
    return Request(
        rid,
        prompt,
        params,
        seed=0,
        eos_token_ids=frozenset(),
        group_id=rid.split("#")[0],
        sample_index=sample_index,
    )


def run_prompt(kv: KVCacheManager, req: Request) -> None:
    """Admit ``req`` with its prefix hit and compute its whole prompt, as the scheduler would."""
    hit = kv.find_prefix_hit(req)
    req.num_computed_tokens = hit.num_tokens
    kv.allocate(req, req.num_tokens - hit.num_tokens, hit)
    req.num_computed_tokens = req.num_tokens


def test_prompt_of_exactly_two_full_blocks_hits_only_the_first() -> None:
    kv = KVCacheManager(8, BS)
    prompt = list(range(2 * BS))
    first = make_request("a", prompt)
    run_prompt(kv, first)
    kv.free(first)
    hit = kv.find_prefix_hit(make_request("b", prompt))
    # The last prompt token must run again: its logits give the first output token.
    assert hit.num_tokens == BS
    assert hit.block_ids == [kv.pool.lookup(first.block_hashes[0])]


def test_prompt_one_token_past_a_block_boundary_hits_every_full_block() -> None:
    kv = KVCacheManager(8, BS)
    prompt = list(range(2 * BS + 1))
    first = make_request("a", prompt)
    run_prompt(kv, first)
    hit = kv.find_prefix_hit(make_request("b", prompt))
    assert hit.num_tokens == 2 * BS
    assert hit.block_ids == kv.block_ids(first)[:2]


def test_prefix_hit_stops_at_the_first_block_that_differs() -> None:
    kv = KVCacheManager(8, BS)
    prompt = list(range(3 * BS + 1))
    run_prompt(kv, make_request("a", prompt))
    other = list(prompt)
    other[BS + 3] = 999  # second block differs, so the (identical) third block must not match either
    assert kv.find_prefix_hit(make_request("b", other)).num_tokens == BS


def test_full_blocks_are_cached_when_allocated_and_reported_as_events() -> None:
    kv = KVCacheManager(8, BS)
    req = make_request("a", list(range(2 * BS + 5)))
    run_prompt(kv, req)
    assert kv.pool.drain_events() == [BlockStored([req.block_hashes[0]]), BlockStored([req.block_hashes[1]])]
    assert kv.pool.num_cached == 2


def test_caching_disabled_never_hits() -> None:
    kv = KVCacheManager(8, BS, enable_caching=False)
    prompt = list(range(3 * BS))
    run_prompt(kv, make_request("a", prompt))
    hit = kv.find_prefix_hit(make_request("b", prompt))
    assert hit.num_tokens == 0 and hit.block_ids == []


def test_prefix_queries_and_hits_count_prompt_tokens() -> None:
    kv = KVCacheManager(8, BS)
    prompt = list(range(2 * BS + 1))
    for rid in ("a", "b"):
        req = make_request(rid, prompt)
        hit = kv.find_prefix_hit(req)
        kv.record_prefix_query(req, hit)
        run_prompt(kv, req)
    assert kv.prefix_queries == 2 * len(prompt)
    assert kv.prefix_hits == 2 * BS


def test_can_allocate_respects_the_margin() -> None:
    kv = KVCacheManager(4, BS)
    req = make_request("a", list(range(3 * BS)))
    assert kv.can_allocate(req, 3 * BS, None, margin=1)
    assert not kv.can_allocate(req, 3 * BS, None, margin=2)
    assert not kv.can_allocate(req, 4 * BS + 1, None, margin=0)


def test_can_allocate_counts_free_but_cached_hit_blocks_as_taken() -> None:
    kv = KVCacheManager(4, BS)
    prompt = list(range(3 * BS + 1))  # 3 full blocks + 1 token: needs all 4 blocks
    first = make_request("a", prompt)
    run_prompt(kv, first)
    kv.free(first)
    assert kv.num_free_blocks == 4  # all free, 3 of them still cached
    req = make_request("b", prompt)
    hit = kv.find_prefix_hit(req)
    assert hit.num_tokens == 3 * BS
    req.num_computed_tokens = hit.num_tokens
    # One new block is needed; the three hit blocks leave the free queue, so exactly one is left.
    assert kv.can_allocate(req, 1, hit, margin=0)
    assert not kv.can_allocate(req, 1, hit, margin=1)
    assert not kv.can_allocate(req, BS + 1, hit, margin=0)
    kv.allocate(req, 1, hit)
    assert kv.block_ids(req)[:3] == hit.block_ids
    assert kv.num_free_blocks == 0


def test_fork_shares_every_block_and_copy_on_write_unshares_the_partial_one() -> None:
    kv = KVCacheManager(8, BS)
    parent = make_request("r", list(range(BS + 4)), n=2)
    run_prompt(kv, parent)
    full, partial = kv.block_ids(parent)
    child = make_request("r#1", list(range(BS + 4)), sample_index=1)
    child.num_computed_tokens = parent.num_computed_tokens
    kv.fork(parent, child)
    assert kv.block_ids(child) == [full, partial]
    assert kv.pool.ref_cnt[full] == kv.pool.ref_cnt[partial] == 2
    free_before = kv.num_free_blocks

    # The parent writes its next token into the shared partial block: it gets a private copy.
    parent.append_token(7, None)
    assert kv.can_allocate(parent, 1, None, margin=free_before - 1)
    assert not kv.can_allocate(parent, 1, None, margin=free_before)  # the copy needs a block
    copies = kv.allocate(parent, 1)
    assert len(copies) == 1
    src, dst = copies[0]
    assert src == partial and dst not in (full, partial)
    assert kv.block_ids(parent) == [full, dst]
    assert kv.pool.ref_cnt[partial] == 1 and kv.pool.ref_cnt[dst] == 1
    assert kv.pool.ref_cnt[full] == 2  # full blocks stay shared

    # The child now owns the partial block alone: no copy.
    child.append_token(8, None)
    assert kv.allocate(child, 1) == []
    assert kv.block_ids(child) == [full, partial]

    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == kv.num_blocks
    assert all(rc == 0 for rc in kv.pool.ref_cnt)


def test_fork_at_a_block_boundary_needs_no_copy() -> None:
    kv = KVCacheManager(8, BS)
    parent = make_request("r", list(range(2 * BS)), n=2)
    run_prompt(kv, parent)
    child = make_request("r#1", list(range(2 * BS)), sample_index=1)
    child.num_computed_tokens = parent.num_computed_tokens
    kv.fork(parent, child)
    for seq in (parent, child):
        seq.append_token(7, None)
        assert kv.allocate(seq, 1) == []
    assert kv.block_ids(parent)[:2] == kv.block_ids(child)[:2]
    assert kv.block_ids(parent)[2] != kv.block_ids(child)[2]
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == kv.num_blocks


def test_swap_out_and_in_round_trip_moves_blocks_and_restores_free_counts() -> None:
    kv = KVCacheManager(8, BS, num_cpu_blocks=4)
    req = make_request("a", list(range(2 * BS + 3)))
    run_prompt(kv, req)
    gpu = list(kv.block_ids(req))
    assert kv.can_swap_out(req)

    out = kv.swap_out(req)
    assert [g for g, _ in out] == gpu
    cpu = [c for _, c in out]
    assert len(set(cpu)) == 3 and all(0 <= c < 4 for c in cpu)
    assert kv.num_free_blocks == kv.num_blocks
    assert len(kv.cpu_free) == 1
    assert kv.block_ids(req) == []

    assert kv.can_swap_in(req, margin=kv.num_blocks - 3)
    assert not kv.can_swap_in(req, margin=kv.num_blocks - 2)
    back = kv.swap_in(req)
    assert [c for c, _ in back] == cpu  # each CPU block lands in the matching table slot
    assert [g for _, g in back] == kv.block_ids(req)
    assert kv.num_free_blocks == kv.num_blocks - 3
    # The CPU blocks a swap-in read stay reserved until the next step: a swap-out in the same
    # step (applied first by the runner) must not overwrite them.
    assert len(kv.cpu_free) == 1
    kv.begin_step()
    assert len(kv.cpu_free) == 4

    kv.free(req)
    assert kv.num_free_blocks == kv.num_blocks


def test_swap_out_is_refused_without_cpu_room() -> None:
    kv = KVCacheManager(8, BS, num_cpu_blocks=2)
    req = make_request("a", list(range(2 * BS + 3)))
    run_prompt(kv, req)
    assert not kv.can_swap_out(req)


def test_free_returns_gpu_and_cpu_blocks() -> None:
    kv = KVCacheManager(8, BS, num_cpu_blocks=4)
    on_gpu = make_request("a", list(range(3 * BS)))
    swapped = make_request("b", list(range(100, 100 + BS + 1)))
    run_prompt(kv, on_gpu)
    run_prompt(kv, swapped)
    kv.swap_out(swapped)
    kv.free(on_gpu)
    kv.free(swapped)
    assert kv.num_free_blocks == kv.num_blocks
    assert sorted(kv.cpu_free) == [0, 1, 2, 3]
    assert kv.tables == {} and kv.cpu_tables == {}
