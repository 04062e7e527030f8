"""The host tier of the prefix cache: evicted blocks copied out, found again, copied back unchanged.

Bookkeeping and copies on real (CPU) tensors standing for the device pool, then the engine: a working
set larger than its KV pool, greedy output equal to HF and to the engine without the tier, prefix
hits served from host memory, and every block back in its pool.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from test_kv_cache_manager import BS, make_request

from engine import LLM, SamplingParams
from engine.block_pool import BlockRemoved, BlockStored
from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.kv_host_tier import HostBlocks, HostTier


def _manager(num_blocks: int, host_slots: int) -> tuple[KVCacheManager, torch.Tensor]:
    """A manager over a real block tensor (row b = block b, 4 floats) with a host tier."""
    kv = KVCacheManager(num_blocks, BS)
    device = torch.zeros(num_blocks, 4)
    kv.attach_host_tier(HostTier(host_slots), HostBlocks(device, host_slots))
    return kv, device


def _compute(kv: KVCacheManager, device: torch.Tensor, req) -> list[int]:
    """Admit ``req`` and "compute" its prompt: each new block's row gets a value derived from its hash
    (what a forward would write); blocks that came from a cache keep theirs. Returns its blocks."""
    hit = kv.find_prefix_hit(req)
    req.num_computed_tokens = hit.num_tokens
    kv.allocate(req, req.num_tokens - hit.num_tokens, hit)
    table = kv.block_ids(req)
    for i in range(hit.num_tokens // BS, len(table)):
        device[table[i]] = _content(req, i)
    req.num_computed_tokens = req.num_tokens
    return table


def _content(req, i: int) -> torch.Tensor:
    req.update_block_hashes(BS, "")
    seed = hash(req.block_hashes[i]) % 10_000 if i < len(req.block_hashes) else -1
    return torch.full((4,), float(seed))


def test_evicted_blocks_come_back_from_the_host_tier_with_their_content():
    kv, device = _manager(num_blocks=4, host_slots=8)
    a = make_request("a", list(range(3 * BS + 1)))  # 4 blocks: 3 full + the last token's
    _compute(kv, device, a)
    expected = [device[b].clone() for b in kv.block_ids(a)[:3]]
    kv.free(a)
    b = make_request("b", list(range(1000, 1000 + 3 * BS + 1)))
    _compute(kv, device, b)  # takes every block: a's three cached ones are evicted -> host
    assert len(kv.host_tier) == 3 and all(h in kv.host_tier for h in a.block_hashes[:3])
    stored = [h for e in kv.host_tier.drain_events() if isinstance(e, BlockStored) for h in e.block_hashes]
    assert sorted(stored) == sorted(a.block_hashes[:3])
    kv.free(b)

    again = make_request("a2", list(range(3 * BS + 1)))
    hit = kv.find_prefix_hit(again)
    assert hit.block_ids == [] and hit.num_tokens == 3 * BS and len(hit.host_slots) == 3
    table = _compute(kv, device, again)
    for i in range(3):  # the loaded blocks hold a's content, and the device cache knows them again
        assert torch.equal(device[table[i]], expected[i]), i
        assert kv.pool.lookup(again.block_hashes[i]) == table[i]
    assert kv.host_tier.counters.loaded_blocks == 3
    kv.free(again)
    assert kv.num_free_blocks == 4


def test_a_hit_continues_from_device_blocks_into_the_host_tier():
    kv, device = _manager(num_blocks=6, host_slots=8)
    prompt = list(range(4 * BS + 1))
    a = make_request("a", prompt)
    _compute(kv, device, a)
    kv.free(a)  # tail first: the prompt's last blocks are evicted first
    # b's 4 blocks: the pool's never-used block, then a's tail (its partial block, then 2 full ones)
    _compute(kv, device, make_request("b", list(range(500, 500 + 3 * BS + 1))))
    hit = kv.find_prefix_hit(make_request("a2", prompt))
    assert len(hit.block_ids) == 2 and len(hit.host_slots) == 2 and hit.num_tokens == 4 * BS


def test_slots_being_loaded_are_not_overwritten_by_the_same_allocations_evictions():
    """A host tier of 3 slots holding a's 3 blocks; loading them needs 3 device blocks, which evict
    2 cached blocks of b (the third is b's partial block): those offloads find every slot pinned and
    are dropped, not written over the slots being read."""
    kv, device = _manager(num_blocks=4, host_slots=3)
    a = make_request("a", list(range(3 * BS + 1)))
    _compute(kv, device, a)
    expected = [device[b].clone() for b in kv.block_ids(a)[:3]]
    kv.free(a)
    b = make_request("b", list(range(700, 700 + 3 * BS + 1)))
    _compute(kv, device, b)
    kv.free(b)
    again = make_request("a2", list(range(3 * BS + 1)))
    table = _compute(kv, device, again)
    assert all(torch.equal(device[table[i]], expected[i]) for i in range(3))
    assert kv.host_tier.counters.dropped_offloads == 2
    assert kv.host_tier.counters.loaded_blocks == 3


def test_the_tier_is_lru_and_reports_what_it_drops():
    tier = HostTier(2)
    s1, s2 = tier.store(b"h1"), tier.store(b"h2")
    assert {s1, s2} == {0, 1}
    assert tier.store(b"h1") is None  # held already: only its recency moves
    s3 = tier.store(b"h3")  # evicts h2, the least recently used
    assert s3 == s2 and b"h2" not in tier and b"h1" in tier
    assert BlockRemoved([b"h2"], "host") in tier.drain_events()
    tier.pin([tier.lookup(b"h1"), tier.lookup(b"h3")])
    assert tier.store(b"h4") is None and tier.counters.dropped_offloads == 1


def test_no_evictions_no_copies():
    """A working set that fits the pool never touches the tier (it must cost nothing then)."""
    kv, device = _manager(num_blocks=16, host_slots=8)
    for rep in range(3):
        for i in range(3):
            r = make_request(f"r{rep}-{i}", list(range(i * 100, i * 100 + 2 * BS + 1)))
            _compute(kv, device, r)
            kv.free(r)
    assert len(kv.host_tier) == 0 and kv.host_tier.counters.offloaded_blocks == 0


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(length)] for _ in range(n)]


def test_engine_serves_an_overflowing_working_set_from_the_host_tier(tiny_llama, hf_greedy):
    """Six 72-token prompts (9 blocks each) against a pool of 16 blocks: every second round recomputes
    everything without the tier; with it, the prefixes come back from host memory. Output equals HF's
    and the tierless engine's either way."""
    prompts = _prompts(6, 72, seed=7)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    common = dict(block_size=8, num_blocks=16, max_num_seqs=1)
    plain = LLM(str(tiny_llama), **common)
    tiered = LLM(str(tiny_llama), kv_host_cache_gib=0.001, **common)
    for round_ in range(2):
        for llm in (plain, tiered):
            outs = llm.generate(prompts, params, use_tqdm=False)
            for p, o in zip(prompts, outs):
                assert o.token_ids == hf_greedy(tiny_llama, p, 6), round_
    plain_stats, stats = plain.stats(), tiered.stats()
    assert plain_stats.prefix_cache_hits == 0  # the pool cannot keep them
    assert stats.prefix_cache_hits_host == stats.prefix_cache_hits == 6 * 64  # 8 of 9 blocks each
    assert stats.host_offloaded_blocks > 0 and 0 < stats.host_cache_used <= stats.host_cache_blocks
    assert stats.num_free_blocks == stats.num_blocks
    # What the router weighs a host hit by: measured here (a memcpy is far cheaper than a forward);
    # without a tier a host hit is worth nothing.
    assert 0 <= tiered.core.host_hit_cost_pct() < 100 and plain.core.host_hit_cost_pct() == 100


def test_the_registry_hears_of_both_tiers(tiny_llama):
    """The engine's block events as the worker publishes them: device kinds and host-tier kinds, and
    a snapshot of each tier that matches what the tiers hold."""
    from registry.schema import HOST_STORED, REMOVED, STORED
    from worker.registry_link import event_batches

    llm = LLM(str(tiny_llama), block_size=8, num_blocks=16, max_num_seqs=1, kv_host_cache_gib=0.001)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate(_prompts(2, 40, seed=4), params, use_tqdm=False)
    assert llm.core.drain_kv_events() == []  # nobody subscribed: nothing was kept
    llm.generate(_prompts(6, 40, seed=5), params, use_tqdm=False)
    kinds = {kind for kind, _ in event_batches(llm.core.drain_kv_events())}
    assert {STORED, REMOVED, HOST_STORED} <= kinds
    device, host, disk = llm.core.cached_hashes()
    assert set(host) == set(llm.core.kv.host_tier.hashes()) and len(host) == len(llm.core.kv.host_tier)
    assert device and not set(device) & set(host) - set(device) and disk == []


@pytest.mark.parametrize("option", ["kv_host_cache_gib", "kv_disk_cache_gib", "swap_space"])
@pytest.mark.parametrize("value", [-1, float("nan"), float("inf"), "2"])
def test_host_tier_option_is_validated(option, value):
    """A size that is no finite number >= 0 is refused by name (NaN and inf reached a traceback in
    the allocation)."""
    host = {"kv_host_cache_gib": 1} if option == "kv_disk_cache_gib" else {}
    with pytest.raises(ValueError, match=f"{option} must be a finite number >= 0 GiB"):
        EngineConfig(model="m", **(host | {option: value}))


@pytest.mark.parametrize("option", ["kv_host_cache_gib", "swap_space"])
def test_host_memory_the_host_has_not_got_is_refused_by_name(tiny_llama, monkeypatch, option):
    """A host tier or swap space larger than the host's available memory fails the start with the
    option's name and both sizes (torch's allocator said neither; on CPU it allocated lazily and
    failed once the blocks filled)."""
    import engine.kv_host_tier as host_tier

    monkeypatch.setattr(host_tier, "available_host_bytes", lambda: 1 << 20)
    with pytest.raises(
        ValueError, match=rf"{option}=0.01 needs 0.01 GiB .* 0.00 GiB is available .*lower {option}"
    ):
        LLM(str(tiny_llama), block_size=8, num_blocks=16, **{option: 0.01})
    monkeypatch.undo()
    free = host_tier.available_host_bytes()
    assert free is not None and 0 < free < 1 << 50  # this host's figure is read


def test_hits_per_tier_reach_status_and_metrics(tiny_llama):
    """A real engine's host-tier figures through the worker's protobuf state into ``pdserve status``
    and /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    from cli.status import format_status
    from ingress.metrics import IngressMetrics
    from proto import pdserve_pb2 as pb
    from worker.state import stats_from_proto, stats_to_proto

    llm = LLM(str(tiny_llama), block_size=8, num_blocks=16, max_num_seqs=1, kv_host_cache_gib=0.001)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    prompts = _prompts(6, 40, seed=3)
    llm.generate(prompts, params, use_tqdm=False)
    llm.generate(prompts, params, use_tqdm=False)
    stats = llm.stats()
    assert stats_from_proto(stats_to_proto(stats)) == dataclasses.replace(stats, num_swap_outs=0)
    worker = pb.WorkerState(role="decode", worker_id="d0", stats=stats_to_proto(stats))

    text = format_status(pb.ClusterState(policy="cache_aware"), [worker])
    lines = text.splitlines()
    row = lines[lines.index("prefix cache by tier:") + 2].split()
    assert row[0] == "d0" and row[1] == str(stats.prefix_cache_queries)
    assert row[4] == str(stats.prefix_cache_hits_host)
    assert row[6] == f"{stats.host_cache_used}/{stats.host_cache_blocks}"

    rendered = IngressMetrics("m").render(None, [worker], ("i0", 0, 0)).decode()
    samples = {
        (s.name, s.labels.get("tier")): s.value
        for f in text_string_to_metric_families(rendered)
        for s in f.samples
        if s.labels.get("worker") == "d0"
    }
    assert samples[("pdserve_prefix_cache_tier_hits_total", "host")] == stats.prefix_cache_hits_host > 0
    assert samples[("pdserve_prefix_cache_tier_hits_total", "device")] == (
        stats.prefix_cache_hits - stats.prefix_cache_hits_host
    )
    assert samples[("pdserve_kv_host_blocks_used", None)] == stats.host_cache_used


def test_timing_the_tier_at_start_leaves_the_device_blocks_as_they_were(monkeypatch):
    """``calibrate`` times loads into free device blocks at start. The host rows start uninitialized
    (whatever the allocator hands back: NaN here), and a device block holding it would reach
    attention through a sequence's unwritten, masked slots (0 × NaN): the blocks keep their content."""
    rows = torch.zeros(12, 2, 4, 3)
    init = HostBlocks.__init__

    def garbage(self, device_rows, num_slots):
        init(self, device_rows, num_slots)
        self.rows.fill_(float("nan"))

    monkeypatch.setattr(HostBlocks, "__init__", garbage)
    blocks = HostBlocks(rows, 10)
    blocks.calibrate()
    assert blocks.load_s_per_block is not None
    assert torch.equal(rows, torch.zeros(12, 2, 4, 3))
