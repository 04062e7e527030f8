"""The router's index replica: events by sequence number, gaps, incarnations, longest-prefix match."""

from __future__ import annotations

from registry.prefix_index import PrefixIndex
from registry.schema import CLEARED, REMOVED, RESYNCED, STORED, KVEventRecord

H = [bytes([i]) * 16 for i in range(10)]


def ev(w: str, epoch: int, seq: int, kind: str, *idx: int) -> KVEventRecord:
    return KVEventRecord(w, epoch, seq, kind, [H[i] for i in idx])


def test_events_in_order_build_the_index_and_match_prefixes():
    idx = PrefixIndex()
    assert idx.apply(ev("a", 1, 1, CLEARED))
    assert idx.apply(ev("a", 1, 2, STORED, 0, 1, 2))
    assert idx.apply(ev("b", 7, 1, RESYNCED, 0, 1))
    assert idx.apply(ev("a", 1, 3, REMOVED, 1))
    assert idx.match([H[0], H[1], H[2]], ["a", "b", "c"]) == {"a": 1, "b": 2, "c": 0}
    assert idx.blocks_of("a") == {H[0], H[2]} and idx.size == 4


def test_a_gap_asks_for_a_resync_and_covered_events_are_skipped():
    idx = PrefixIndex()
    assert idx.apply(ev("a", 1, 1, CLEARED))
    assert not idx.apply(ev("a", 1, 3, STORED, 5))  # seq 2 is missing
    assert idx.gaps_detected == 1
    idx.replace("a", 1, 3, [H[4], H[5]])  # the snapshot at seq 3
    assert idx.apply(ev("a", 1, 3, STORED, 5))  # already covered: ignored
    assert idx.apply(ev("a", 1, 4, STORED, 6))
    assert idx.blocks_of("a") == {H[4], H[5], H[6]}


def test_a_new_incarnation_drops_the_old_ones_entries():
    idx = PrefixIndex()
    idx.apply(ev("a", 1, 1, RESYNCED, 0, 1, 2))
    assert idx.apply(ev("a", 2, 1, CLEARED))  # restarted with an empty cache
    assert idx.blocks_of("a") == set() and idx.epoch_of("a") == 2
    assert idx.apply(ev("a", 1, 2, STORED, 3))  # the old incarnation's late event is ignored
    assert idx.blocks_of("a") == set()
    assert not idx.apply(ev("b", 5, 4, STORED, 1))  # first sight of a worker mid-stream: resync


def test_host_tier_events_are_indexed_apart_and_matched_after_the_device_run():
    from registry.schema import HOST_REMOVED, HOST_STORED

    idx = PrefixIndex()
    assert idx.apply(KVEventRecord("a", 1, 1, RESYNCED, [H[0]], [H[1], H[2]]))
    assert idx.apply(ev("a", 1, 2, HOST_STORED, 3))
    assert idx.apply(ev("b", 1, 1, RESYNCED, 0, 1))
    assert idx.apply(ev("c", 1, 1, CLEARED))
    assert idx.apply(ev("c", 1, 2, HOST_STORED, 0, 1, 2, 3, 4))
    chain = [H[i] for i in range(6)]
    # a: 1 on device then 3 in its host tier; b: 2 on device; c: nothing on device, 5 in host.
    assert idx.match_tiers(chain, ["a", "b", "c", "d"]) == {
        "a": (1, 3, 0),
        "b": (2, 0, 0),
        "c": (0, 5, 0),
        "d": (0, 0, 0),
    }
    assert idx.match(chain, ["a", "b"]) == {"a": 1, "b": 2}  # the device-only view is unchanged
    assert idx.num_host_blocks_of("a") == 3 and idx.size == 1 + 3 + 2 + 5
    assert idx.apply(ev("a", 1, 3, HOST_REMOVED, 2))
    assert idx.match_tiers(chain, ["a"]) == {"a": (1, 1, 0)}  # the host run stops at the hole
    idx.drop("c")
    assert idx.match_tiers(chain, ["c"]) == {"c": (0, 0, 0)} and idx.num_host_blocks_of("c") == 0
    assert idx.apply(ev("a", 2, 1, CLEARED))  # a new incarnation: both tiers forgotten
    assert idx.match_tiers(chain, ["a"]) == {"a": (0, 0, 0)} and idx.size == 2


def test_an_event_kind_of_a_newer_worker_is_skipped_not_taken_for_a_resync():
    idx = PrefixIndex()
    assert idx.apply(ev("a", 1, 1, RESYNCED, 0, 1))
    assert idx.apply(ev("a", 1, 2, "q", 5))  # a tier this router does not know
    assert idx.apply(ev("a", 1, 3, STORED, 2))  # its sequence number still counted: no gap
    assert idx.blocks_of("a") == {H[0], H[1], H[2]} and idx.gaps_detected == 0


def test_disk_tier_events_are_indexed_apart_and_matched_after_the_host_run():
    """The runs the engine walks: device, then host tier, then disk tier, each from where the last
    stopped; a block only a tier above the current run holds ends the hit."""
    from registry.schema import DISK_REMOVED, DISK_STORED, HOST_STORED

    idx = PrefixIndex()
    assert idx.apply(KVEventRecord("a", 1, 1, RESYNCED, [H[0]], [H[1]], [H[2], H[3]]))
    assert idx.apply(ev("b", 1, 1, CLEARED))
    assert idx.apply(ev("b", 1, 2, DISK_STORED, 0, 1, 2))
    assert idx.apply(ev("c", 1, 1, CLEARED))
    assert idx.apply(ev("c", 1, 2, DISK_STORED, 0))
    assert idx.apply(ev("c", 1, 3, HOST_STORED, 1))  # after a disk run: the engine stops there
    chain = [H[i] for i in range(6)]
    assert idx.match_tiers(chain, ["a", "b", "c"]) == {"a": (1, 1, 2), "b": (0, 0, 3), "c": (0, 0, 1)}
    assert idx.num_disk_blocks_of("a") == 2 and idx.num_host_blocks_of("a") == 1
    assert idx.size == 4 + 3 + 2
    assert idx.apply(ev("a", 1, 2, DISK_REMOVED, 3))
    assert idx.match_tiers(chain, ["a"]) == {"a": (1, 1, 1)}
    idx.replace("b", 1, 9, [], [], [H[0], H[1]])  # a resync from the snapshot carries the disk set
    assert idx.match_tiers(chain, ["b"]) == {"b": (0, 0, 2)} and idx.num_disk_blocks_of("b") == 2
    idx.drop("b")
    assert idx.num_disk_blocks_of("b") == 0 and idx.match_tiers(chain, ["b"]) == {"b": (0, 0, 0)}
    assert idx.apply(ev("a", 2, 1, CLEARED))  # a new incarnation: every tier forgotten
    assert idx.num_disk_blocks_of("a") == 0 and idx.match_tiers(chain, ["a"]) == {"a": (0, 0, 0)}


def test_the_net_effect_of_events_leaves_an_index_where_the_events_one_by_one_leave_it():
    """``net_events`` (what a publisher writes for a transaction's batches): random runs of stored
    and removed events over three tiers, with clears, applied one by one and as their net effect,
    end in the same index; between clears the net effect has at most one entry of each kind."""
    import random

    from registry.registration import net_events
    from registry.schema import DISK_REMOVED, DISK_STORED, HOST_REMOVED, HOST_STORED

    kinds = [STORED, REMOVED, HOST_STORED, HOST_REMOVED, DISK_STORED, DISK_REMOVED]
    rng = random.Random(5)
    for _ in range(300):
        batches = []
        for _ in range(rng.randint(1, 12)):
            if rng.random() < 0.08:
                batches.append((CLEARED, []))
            else:
                batches.append((rng.choice(kinds), [H[rng.randrange(6)] for _ in range(rng.randint(1, 3))]))
        net = net_events(batches)
        ends = []
        for events in (batches, net):
            idx = PrefixIndex()
            idx.apply(KVEventRecord("a", 1, 1, RESYNCED, [H[0], H[1]], [H[2]], [H[3]]))
            for seq, (kind, hashes) in enumerate(events, start=2):
                assert idx.apply(KVEventRecord("a", 1, seq, kind, hashes))
            tiers = (idx._host.blocks.get("a", set()), idx._disk.blocks.get("a", set()))
            ends.append((idx.blocks_of("a"), *tiers))
        assert ends[0] == ends[1], batches
        for segment in " ".join(k for k, _ in net).split(CLEARED):
            assert len(segment.split()) == len(set(segment.split())), net
        assert [k for k, _ in net].count(CLEARED) == [k for k, _ in batches].count(CLEARED)
