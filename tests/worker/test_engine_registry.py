"""The registry link of a worker whose engine runs in another process: what it hands the publisher,
in which order. After a (re)connect the publisher wants the whole cache: events read before the
snapshot's reply are in the snapshot (dropped), events after it are offered; the load goes to the
record with the engine's recent step. Fakes for the engine process and the publisher (the logic
between them); tests/decode_worker/test_engine_process.py runs the real ones with Redis."""

from __future__ import annotations

from proto import pdserve_pb2 as pb
from registry.schema import REMOVED, STORED
from worker.engine_registry import EngineRegistryLink


class FakeEngine:
    recent_step_s = 0.012

    def __init__(self) -> None:
        self.hook = None
        self.snapshot_replies: list = []

    def watch_kv(self, hook) -> None:
        self.hook = hook

    def snapshot(self, on_reply) -> None:
        self.snapshot_replies.append(on_reply)


class FakePublisher:
    def __init__(self) -> None:
        self.want = True  # a fresh publisher wants the whole cache first
        self.offers: list = []
        self.stopped = False

    def snapshot_wanted(self) -> bool:
        want, self.want = self.want, False
        return want

    def offer_snapshot(self, hashes, host=(), disk=()) -> None:
        self.offers.append(("snapshot", hashes, host, disk))

    def offer_events(self, batches) -> None:
        self.offers.append(("events", batches))

    def offer_load(self, **load) -> None:
        self.offers.append(("load", load))

    def stop(self) -> None:
        self.stopped = True


def _events(kind: str, *hashes: bytes, load: bool = False) -> pb.EngineEvents:
    ev = pb.EngineEvents()
    ev.kv_events.add(kind=kind, hashes=list(hashes))
    if load:
        ev.load.num_running, ev.load.num_free_blocks, ev.load.queued_prompt_tokens = 2, 90, 31
        ev.load.host_hit_cost_pct, ev.load.disk_hit_cost_pct, ev.load.peer_hit_cost_pct = 7, 40, 55
        ev.load.resident_loras.extend(["sql", "poet"])  # adapters in device slots
    return ev


def test_events_before_the_snapshot_reply_are_dropped_and_after_it_offered():
    engine, pub = FakeEngine(), FakePublisher()
    link = EngineRegistryLink(engine, pub)
    engine.hook(_events(STORED, b"a", load=True))  # asks for the snapshot; "a" is in it
    assert len(engine.snapshot_replies) == 1
    engine.hook(_events(STORED, b"b"))  # read before the reply: in the snapshot too
    engine.snapshot_replies[0]([b"a", b"b"], [b"h"], [b"k"])  # with the host and disk tiers' blocks
    engine.hook(_events(REMOVED, b"a"))
    assert pub.offers == [
        (
            "load",
            dict(
                num_running=2,
                num_waiting=0,
                num_free_blocks=90,
                queued_prompt_tokens=31,
                step_ms=12,
                host_hit_cost_pct=7,
                disk_hit_cost_pct=40,
                peer_hit_cost_pct=55,
                resident_loras='["sql", "poet"]',
            ),
        ),
        ("snapshot", [b"a", b"b"], [b"h"], [b"k"]),
        ("events", [(REMOVED, [b"a"])]),
    ]
    pub.want = True  # the publisher reconnected: a new snapshot, once
    engine.hook(_events(STORED, b"c"))
    engine.hook(_events(STORED, b"d"))
    assert len(engine.snapshot_replies) == 2
    link.stop()
    engine.snapshot_replies[1]([b"b", b"c", b"d"], [], [])  # a reply after leaving offers nothing
    engine.hook(_events(STORED, b"e"))
    assert pub.stopped and pub.offers[-1] == ("events", [(REMOVED, [b"a"])])
