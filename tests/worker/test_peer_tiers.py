"""Prefix blocks read from a peer's host tier (issue 33, item 3), both ends on real engines.

Two engines with host tiers, their tier memories on one in-process fabric (the NIXL backend's
semantics: tests/e2e reads across processes over NIXL): the owner lends a prompt's blocks (those on
its device are copied to its host tier first), the reader reads them into its own host tier and then
serves the prompt from there. Greedy output equals HF's whether the read lands, fails, stalls or
brings a block whose bytes changed; the owner's lease ends with the read; every slot and block is
back where it started.
"""

from __future__ import annotations

import random
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cli.status import format_status
from engine import LLM, SamplingParams
from engine.block_hash import hash_blocks
from ingress.metrics import IngressMetrics
from kv_transfer import InProcessBackend, InProcessFabric, KVCompat
from proto import pdserve_pb2 as pb
from worker.peer_tiers import LendOffer, PeerTiers
from worker.state import stats_to_proto

BS = 8
PROMPT = 90  # 11 full blocks; at most 11 are served from a cache (the last token is computed)
PARAMS = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


class Pair:
    """Owner and reader engines (16-block pools, host tiers), their tiers on one fabric."""

    def __init__(self, model, lease_s: float = 10.0, timeout_s: float = 5.0, **engine) -> None:
        common = dict(block_size=BS, num_blocks=32, max_num_seqs=2, kv_host_cache_gib=0.001) | engine
        self.fabric = InProcessFabric()
        self.llms = LLM(str(model), **common), LLM(str(model), **common)
        compat = KVCompat.from_layout("tiny", self.llms[0].core.layout)
        self.tiers = [
            PeerTiers(
                llm.core,
                InProcessBackend(self.fabric, name, llm.core.kv.host_blocks.rows, compat),
                lease_s,
                timeout_s,
            )
            for llm, name in zip(self.llms, ("owner-tier", "reader-tier"))
        ]
        self.owner, self.reader = self.tiers

    def lend(self, prompt: list[int], lease_id: str = "lease-1") -> LendOffer:
        slots, sums = self.owner.lend(lease_id, prompt, 100)
        return LendOffer(self.owner.info(), slots, sums, lease_id, self.owner.lending.lease_s)

    def read(
        self,
        prompt: list[int],
        offer: LendOffer,
        request_id: str = "r1",
        deadline_s: float = 10.0,
        lora_salt: str = "",
    ) -> int:
        """Fetch and tick both ends until the read is over; the blocks published."""
        landed: list[int] = []
        self.reader.fetch(request_id, prompt, offer, landed.append, lora_salt=lora_salt)
        deadline = time.monotonic() + deadline_s
        while not landed:
            assert time.monotonic() < deadline, "the read never ended"
            self.reader.tick()
            self.owner.tick()
        self.owner.tick()  # the read's notification
        return landed[0]

    def check_back(self) -> None:
        for llm, tiers in zip(self.llms, self.tiers):
            s = llm.stats()
            assert s.num_free_blocks == s.num_blocks
            assert not tiers.lending.leases and not tiers.pending()
            assert not llm.core.kv.host_tier._pinned  # no slot left pinned by a lease or a read


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(PROMPT)]


@pytest.fixture
def pair(tiny_llama):
    return Pair(tiny_llama)


def test_a_prefix_read_from_a_peer_serves_the_prompt_unchanged(pair, tiny_llama, hf_greedy):
    prompt = _prompt(1)
    want = hf_greedy(tiny_llama, prompt, 5)
    owner, reader = pair.llms
    assert owner.generate([prompt], PARAMS, use_tqdm=False)[0].token_ids == want  # cached on its device
    offer = pair.lend(prompt)
    assert len(offer.slots) == 11  # every full block but the one holding the last token
    assert owner.stats().peer_lent_blocks == 11
    assert pair.owner.lending.leases  # pinned until the read's notification
    assert pair.read(prompt, offer) == 11
    assert not pair.owner.lending.leases  # the notification ended the lease
    assert reader.generate([prompt], PARAMS, use_tqdm=False)[0].token_ids == want
    s = reader.stats()
    assert s.peer_received_blocks == 11 and s.prefix_cache_hits_host == s.prefix_cache_hits == 11 * BS
    pair.check_back()
    _shown_by_status_and_metrics(reader.stats(), received=11, lent=0)
    _shown_by_status_and_metrics(owner.stats(), received=0, lent=11)


def _shown_by_status_and_metrics(stats, received: int, lent: int) -> None:
    worker = pb.WorkerState(role="prefill", worker_id="p0", stats=stats_to_proto(stats))
    lines = format_status(pb.ClusterState(policy="cache_aware"), [worker]).splitlines()
    head = lines[lines.index("prefix cache by tier:") + 1].split("  ")
    assert [h.strip() for h in head if h.strip()][-2:] == ["FROM PEERS", "LENT"]
    assert lines[lines.index("prefix cache by tier:") + 2].split()[-2:] == [str(received), str(lent)]
    rendered = IngressMetrics("m").render(None, [worker], ("i0", 0, 0)).decode()
    samples = {
        s.labels["direction"]: s.value
        for f in text_string_to_metric_families(rendered)
        for s in f.samples
        if s.name == "pdserve_kv_peer_blocks_total"
    }
    assert samples == {"received": received, "lent": lent, "rejected": 0}


def test_blocks_held_already_are_not_read_again(pair):
    prompt = _prompt(2)
    owner, reader = pair.llms
    owner.generate([prompt], PARAMS, use_tqdm=False)
    reader.generate([prompt[: 4 * BS + 1]], PARAMS, use_tqdm=False)  # its first 4 blocks
    assert pair.read(prompt, pair.lend(prompt)) == 7
    reader.generate([prompt], PARAMS, use_tqdm=False)
    s = reader.stats()
    assert s.prefix_cache_hits == 11 * BS and s.peer_received_blocks == 7  # 4 its own, 7 read
    pair.check_back()


def test_a_failed_read_leaves_the_prompt_to_compute(pair, tiny_llama, hf_greedy):
    prompt = _prompt(3)
    pair.llms[0].generate([prompt], PARAMS, use_tqdm=False)
    pair.fabric.fail_next_reads(1)
    assert pair.read(prompt, pair.lend(prompt)) == 0
    reader = pair.llms[1]
    assert reader.generate([prompt], PARAMS, use_tqdm=False)[0].token_ids == hf_greedy(tiny_llama, prompt, 5)
    assert reader.stats().prefix_cache_hits == 0 and len(reader.core.kv.host_tier) == 0
    assert pair.reader.failed_reads == 1
    pair.owner.lending.expire(time.monotonic() + 60)  # a failed read sends no notification
    pair.check_back()


def test_a_block_whose_bytes_changed_is_never_served(pair, tiny_llama, hf_greedy):
    """The owner's slot is overwritten after the lend (as a reuse would): the reader's CRC check
    drops that block; the prompt's hit ends before it and the rest is computed."""
    prompt = _prompt(4)
    pair.llms[0].generate([prompt], PARAMS, use_tqdm=False)
    offer = pair.lend(prompt)
    pair.owner.lending.rows[offer.slots[3]].add_(1.0)
    assert pair.read(prompt, offer) == 10
    reader = pair.llms[1]
    assert reader.generate([prompt], PARAMS, use_tqdm=False)[0].token_ids == hf_greedy(tiny_llama, prompt, 5)
    s = reader.stats()
    assert s.peer_rejected_blocks == 1 and s.prefix_cache_hits == 3 * BS
    pair.check_back()


def test_a_stalled_read_fails_at_its_deadline_and_frees_its_slots_once_it_ends(tiny_llama):
    """Until a timed-out read ends, its reserved slots stay pinned (NIXL cannot abort a READ: bytes
    may still land); once it ends they are freed, its blocks not published (the lease may be over)."""
    pair = Pair(tiny_llama, timeout_s=0.3)
    prompt = _prompt(5)
    pair.llms[0].generate([prompt], PARAMS, use_tqdm=False)
    pair.fabric.stall_reads()
    assert pair.read(prompt, pair.lend(prompt)) == 0  # at the deadline
    tier = pair.llms[1].core.kv.host_tier
    assert tier._pinned and len(tier) == 0  # reserved: the read may still land there
    pair.fabric.resume_reads()
    pair.reader.tick()
    assert not tier._pinned and len(tier) == 0  # it ended: the slots are free, nothing published
    pair.owner.tick()
    pair.check_back()


def test_a_request_that_leaves_mid_read_drops_it(pair):
    prompt = _prompt(6)
    pair.llms[0].generate([prompt], PARAMS, use_tqdm=False)
    pair.fabric.stall_reads()
    called: list[int] = []
    pair.reader.fetch("gone", prompt, pair.lend(prompt), called.append)
    assert pair.reader.abort("gone") and not pair.reader.abort("gone")
    pair.fabric.resume_reads()
    pair.reader.tick()
    pair.owner.tick()
    assert called == []  # nobody waits for it any more
    pair.check_back()


def test_nothing_held_nothing_lent_and_leases_expire(pair):
    prompt = _prompt(7)
    assert pair.lend(prompt).slots == []  # the owner never saw it
    pair.llms[0].generate([prompt], PARAMS, use_tqdm=False)
    offer = pair.lend(prompt, "lease-2")
    with pytest.raises(ValueError, match="already taken"):
        pair.owner.lend("lease-2", prompt, 100)
    assert pair.owner.lending.expire(time.monotonic() + 60) == 1
    pair.check_back()
    # The reader's hashes are the owner's: the same chain over the same tokens.
    assert len(offer.slots) == len(hash_blocks(prompt[: 11 * BS], BS))


def test_an_engine_process_role_lends_fetches_and_announces_a_dropped_read_as_over(pair):
    """``EngineTierPeers`` (an engine process role's part): ``lend`` and ``fetch`` commands; a read
    that lands is announced in the next message's ``fetched``; an abort mid-read drops it and
    announces it too (else the worker's admission would wait for it forever); without tiers a fetch
    is over at once and nothing is lent."""
    from proto import pdserve_pb2 as pb
    from worker.peer_tiers import EngineTierPeers, lent_to_proto

    owner, reader = EngineTierPeers(pair.owner), EngineTierPeers(pair.reader)
    prompt = _prompt(8)
    pair.llms[0].generate([prompt], PARAMS, use_tqdm=False)

    def lend(lease_id: str) -> pb.LendResponse:
        reply = pb.EngineReply()
        cmd = pb.EngineCommand(
            lend=pb.LendRequest(lease_id=lease_id, prompt_token_ids=prompt, max_blocks=100)
        )
        assert owner.run(cmd, reply)
        assert len(reply.lent.slots) == 11
        return reply.lent

    def fetch(role: EngineTierPeers, rid: str, lent: pb.LendResponse, lease_id: str) -> None:
        msg = pb.EngineFetch(request_id=rid, prompt_token_ids=prompt, lent=lent, lease_id=lease_id)
        assert role.run(pb.EngineCommand(fetch=msg), pb.EngineReply())

    def announced(role: EngineTierPeers) -> list[str]:
        events = pb.EngineEvents()
        role.finish(events)
        return list(events.fetched)

    pair.fabric.stall_reads()
    fetch(reader, "gone", lend("l1"), "l1")
    assert announced(reader) == []  # still reading
    assert reader.abort("gone") and not reader.abort("gone")
    assert announced(reader) == ["gone"]
    pair.fabric.resume_reads()
    reader.tick()
    owner.tick()
    fetch(reader, "r", lend("l2"), "l2")
    deadline = time.monotonic() + 10
    while not (done := announced(reader)):
        assert time.monotonic() < deadline, "the read never ended"
        reader.tick()
        owner.tick()
    assert done == ["r"]
    assert all(h in pair.llms[1].core.kv.host_tier for h in hash_blocks(prompt[:88], BS))  # published
    owner.tick()  # the read's notification ends the lease
    bare = EngineTierPeers(None)
    fetch(bare, "x", lent_to_proto(pair.owner, [], []), "l3")
    assert announced(bare) == ["x"] and not bare.abort("x")
    reply = pb.EngineReply()
    assert bare.run(pb.EngineCommand(lend=pb.LendRequest(lease_id="l4", prompt_token_ids=prompt)), reply)
    assert not reply.HasField("lent") or not reply.lent.slots
    pair.check_back()


def test_a_reads_measured_cost_counts_its_lend_call(pair):
    """What the router weighs a peer read by is all it cost: the Lend call's time too, spread over
    the blocks read (11 here), not the transfer alone (microseconds on this fabric)."""
    prompt = _prompt(9)
    pair.llms[0].generate([prompt], PARAMS, use_tqdm=False)
    landed: list[int] = []
    pair.reader.fetch("r", prompt, pair.lend(prompt), landed.append, asked_s=1.1)
    deadline = time.monotonic() + 10
    while not landed:
        assert time.monotonic() < deadline, "the read never ended"
        pair.reader.tick()
        pair.owner.tick()
    pair.owner.tick()
    assert landed == [11]
    assert pair.reader.fetch_s_per_block >= 0.1
    assert pair.llms[1].core.kv.host_blocks.peer_read_s_per_block == pair.reader.fetch_s_per_block
    assert pair.llms[1].core.peer_hit_cost_pct() == 100  # 0.1 s a block: dearer than computing it
    pair.check_back()


def test_before_its_first_read_a_reader_assumes_half_the_compute_then_follows_recent_reads(pair):
    """The prior: a read costs at least half of computing its blocks until one is measured (an
    optimistic guess would route reads that lose to computing). Then a moving average of the
    measured reads: a slow read, then fast ones, and the cost comes down again."""
    from engine.core_tiers import PEER_READ_PRIOR

    core = pair.llms[1].core
    pair.llms[1].generate([_prompt(10)], PARAMS, use_tqdm=False)  # measures its prefill speed
    assert core.peer_hit_cost_pct() >= 100 * PEER_READ_PRIOR
    pair.reader._record(10, 10.0)  # 1 s a block
    slow = pair.reader.fetch_s_per_block
    assert slow == 1.0 and core.peer_hit_cost_pct() == 100
    for _ in range(40):
        pair.reader._record(10, 0.0)
    assert pair.reader.fetch_s_per_block < slow * 0.001
    assert core.peer_hit_cost_pct() < 100 * PEER_READ_PRIOR  # measured cheap: the prior is gone


class _StreamedHostBlocks:
    """A host tier's copies as a GPU's stream runs them (CPU stand-in): an offload reads its device
    block when issued and lands at the next ``settle`` or ``load``."""

    def __init__(self, blocks) -> None:
        self.blocks, self.queued = blocks, []
        self.offload_now, self.load_now, self.settle_now = blocks.offload, blocks.load, blocks.settle
        blocks.offload, blocks.load, blocks.settle = self.offload, self.load, self.land

    def offload(self, pairs) -> None:
        self.queued += [(slot, self.blocks.device_rows[block].clone()) for block, slot in pairs]

    def land(self) -> None:
        for slot, row in self.queued:
            self.blocks.rows[slot].copy_(row)
        self.queued = []

    def load(self, pairs) -> None:
        self.land()
        self.load_now(pairs)


def test_a_read_waits_for_copies_still_queued_into_its_slots(tiny_llama, hf_greedy):
    """On a GPU the reader's host slots can still have offloads queued on the stream (the step that
    evicted into them returned before they ran). A peer read reserving those slots must let them land
    first: landing after the peer's bytes, they replaced the prompt's KV and its tokens changed."""
    common = dict(num_blocks=16, max_num_seqs=1)
    bb = LLM(str(tiny_llama), block_size=BS, **common).core.layout.block_bytes
    pair = Pair(tiny_llama, **common, kv_host_cache_gib=4 * bb / 2**30)  # 4 host slots
    owner, reader = pair.llms
    rng = random.Random(3)
    prompt = [rng.randrange(3, 1000) for _ in range(4 * BS + 1)]
    want = hf_greedy(tiny_llama, prompt, 5)
    assert owner.generate([prompt], PARAMS, use_tqdm=False)[0].token_ids == want
    stream = _StreamedHostBlocks(reader.core.kv.host_blocks)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    reader.generate([[rng.randrange(3, 1000) for _ in range(8 * BS + 1)]], one, use_tqdm=False)
    stream.land()
    reader.generate([[rng.randrange(3, 1000) for _ in range(15 * BS)]], one, use_tqdm=False)
    assert {slot for slot, _ in stream.queued} == set(range(4))  # evictions still on their way in
    assert pair.read(prompt, pair.lend(prompt)) == 4
    stream.land()  # the stream catches up
    out = reader.generate([prompt], PARAMS, use_tqdm=False)[0]
    assert out.num_cached_tokens == 4 * BS and out.token_ids == want
    pair.check_back()


def test_an_adapters_prefix_is_lent_and_read_in_its_own_namespace(tiny_llama, lora_adapter_factory):
    """A LoRA request's blocks are hashed with the adapter's namespace (as the engine and the router
    hash them): both ends use it, so the owner lends the adapter's blocks (it lent none before, while
    the router predicted the hit) and the reader serves the prompt from them, as the owner computed it."""
    adapter = str(lora_adapter_factory(tiny_llama, seed=5))
    pair = Pair(tiny_llama, enable_lora=True, lora_modules={"a": adapter})
    owner, reader = pair.llms
    prompt = _prompt(7)
    lora = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, lora="a")
    want = owner.generate([prompt], lora, use_tqdm=False)[0].token_ids
    assert want != owner.generate([prompt], PARAMS, use_tqdm=False)[0].token_ids  # the adapter matters
    salt = owner.core.lora_salts()["a"]
    assert pair.owner.lend("base", prompt, 100)[0] != []  # the base model's blocks, from the second run
    pair.owner.lending.end("base")
    slots, sums = pair.owner.lend("lease-1", prompt, 100, salt)
    assert len(slots) == 11
    offer = LendOffer(pair.owner.info(), slots, sums, "lease-1", pair.owner.lending.lease_s)
    assert pair.read(prompt, offer, lora_salt=salt) == 11
    out = reader.generate([prompt], lora, use_tqdm=False)[0]
    assert out.num_cached_tokens == 11 * BS and out.token_ids == want
    assert reader.generate([prompt], PARAMS, use_tqdm=False)[0].num_cached_tokens == 0  # not the base's
    pair.check_back()
