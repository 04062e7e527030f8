"""The registry link of a worker whose engine runs in another process (``worker.engine_process``).

The engine process sends its prefix cache's block events with each step's outputs and its load
every few hundred ms; this side hands them to the ``RegistryPublisher`` (whose thread does every
Redis call), so registry work never shares the engine's GIL. After a (re)connect the publisher wants
the whole cache: a ``snapshot`` command is sent, events read until its reply are dropped (the
snapshot holds them) and events after it are offered as usual: the same order ``RegistryLink`` keeps
on an in-process engine thread.
"""

from __future__ import annotations

import json

from proto import pdserve_pb2 as pb
from registry.publisher import RegistryPublisher
from worker.engine_client import EngineProcess


class EngineRegistryLink:
    def __init__(self, engine: EngineProcess, publisher: RegistryPublisher) -> None:
        self.engine = engine
        self.publisher = publisher
        self.stopped = False
        self._snapshot_pending = False
        engine.watch_kv(self._on_kv)

    def _on_kv(self, events: pb.EngineEvents) -> None:
        """Event loop: one engine message's cache events and load."""
        pub = self.publisher
        if self.stopped:
            return
        if not self._snapshot_pending and pub.snapshot_wanted():
            self._snapshot_pending = True
            self.engine.snapshot(self._on_snapshot)
        if events.kv_events and not self._snapshot_pending:
            pub.offer_events([(b.kind, list(b.hashes)) for b in events.kv_events])
        if events.HasField("load"):
            load = events.load
            pub.offer_load(
                num_running=load.num_running,
                num_waiting=load.num_waiting,
                num_free_blocks=load.num_free_blocks,
                queued_prompt_tokens=load.queued_prompt_tokens,
                step_ms=int(self.engine.recent_step_s * 1000),
                host_hit_cost_pct=load.host_hit_cost_pct,
                disk_hit_cost_pct=load.disk_hit_cost_pct,
                peer_hit_cost_pct=load.peer_hit_cost_pct,
                resident_loras=json.dumps(list(load.resident_loras)),
            )

    def _on_snapshot(self, hashes: list[bytes], host: list[bytes], disk: list[bytes]) -> None:
        self._snapshot_pending = False
        if not self.stopped:
            self.publisher.offer_snapshot(hashes, host, disk)

    def stop(self) -> None:
        """Leave the registry (blocking: Redis calls; any thread)."""
        self.stopped = True
        self.publisher.stop()  # deregisters
