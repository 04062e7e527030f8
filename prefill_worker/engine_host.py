"""``python -m prefill_worker.engine_host``: a prefill worker's engine process, with its held KV.

What the in-process prefill worker does on its engine thread runs here, next to the engine's KV
memory: the NIXL agent registered over it (decode workers read the held blocks from this process,
and their completion notifications arrive here), the leases on held prompts (freed on a reader's
notification, a ``release`` command, an abort, or expiry), and the watches of prompts whose KV is
streamed while it is computed (each step's newly computed blocks pinned and announced). Messages
carry the leases taken (``EngineEvents.leases``, before the outputs that hold them) and the watched
prompts' blocks (``exposed``); the worker's process answers the gRPC calls from them.

With a host tier, its memory gets an agent of its own (``<agent>-tier``) and the prefix blocks shared
with peer prefill workers are lent and read here (``worker.peer_tiers``): a ``lend`` command
pins blocks for a peer, a ``fetch`` reads a peer's into the host tier and the message after it lands
names the request (``fetched``), which the worker then adds.

    --transfer nixl|inprocess        the backend over the engine's KV (inprocess: tests of the role)
    --agent-name NAME                the NIXL agent's name (the worker's id and epoch)
    --lease-seconds S                held KV is freed after this long
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from kv_transfer import InProcessFabric, KVCompat, KVTransferBackend
from prefill_worker.held import HeldPrompts
from proto import pdserve_pb2 as pb
from worker.engine_process import EngineHost, EngineRole, run
from worker.peer_tiers import EngineTierPeers, PeerTiers, engine_tiers
from worker.state import transfer_info_to_proto, transfer_stats_to_proto


class PrefillEngineRole(EngineRole):
    def __init__(
        self, host: EngineHost, transfer: KVTransferBackend, lease_s: float, tiers: PeerTiers | None = None
    ) -> None:
        self.core = host.core
        self.transfer = transfer
        self.held = HeldPrompts(host.core, lease_s, self._announce)
        self.on_lease: Callable[[], None] = lambda: None  # prompts newly held for readers
        self.peers = EngineTierPeers(tiers)
        self._leased: list[pb.EngineLease] = []
        self._exposed: list[pb.EngineExposed] = []

    def ready(self, msg: pb.EngineReady) -> None:
        msg.transfer.CopyFrom(transfer_info_to_proto(self.transfer.local_info()))

    def run(self, cmd: pb.EngineCommand, reply: pb.EngineReply) -> bool:
        kind = cmd.WhichOneof("kind")
        if kind == "release":
            reply.released = self.held.release(cmd.release, "release")
        elif kind == "watch":
            self.held.start_watch(cmd.watch.request_id, cmd.watch.wait_s)
        elif kind == "unwatch":
            self.held.watches.pop(cmd.unwatch, None)
        else:
            return self.peers.run(cmd, reply)
        return True

    def abort(self, request_id: str) -> bool:
        """The caller left: a held prompt is freed, a running one aborted (``release`` unpinned its
        exposed blocks first, so the abort frees them all). Its abort outputs are not sent: nobody
        reads them, and a retry under the same id must not get them."""
        self.held.end_watch(request_id)
        if self.peers.abort(request_id):
            return True
        if self.held.release(request_id, "abandoned"):
            return True
        return bool(self.core.abort_request(request_id))

    def tick(self) -> None:
        self.held.tick(self.transfer.get_notifications())
        self.peers.tick()

    def stats(self, reply: pb.EngineReply) -> None:
        reply.transfer_stats.CopyFrom(transfer_stats_to_proto(self.held.stats))
        reply.num_leases = len(self.held.leases)
        reply.releases.update(self.held.releases)

    def finish(self, events: pb.EngineEvents, outputs) -> dict[str, str]:
        for out in outputs:
            expiry = self.held.on_output(out)
            if expiry is not None:
                self._leased.append(pb.EngineLease(request_id=out.request_id, expiry_unix=expiry))
        self.held.expose()
        if self._leased:
            self.on_lease()
        events.leases.extend(self._leased)
        events.exposed.extend(self._exposed)
        self.peers.finish(events)
        self._leased.clear()
        self._exposed.clear()
        return {}

    def _announce(self, request_id: str, block_ids: list[int], complete: bool, end: bool) -> None:
        self._exposed.append(
            pb.EngineExposed(request_id=request_id, block_ids=block_ids, complete=complete, end=end)
        )


def prefill_role(host: EngineHost, compat: KVCompat, argv: list[str]) -> EngineRole:
    p = argparse.ArgumentParser(prog="python -m prefill_worker.engine_host")
    p.add_argument("--transfer", choices=("nixl", "inprocess"), default="nixl")
    p.add_argument("--agent-name", default="prefill")
    p.add_argument("--lease-seconds", type=float, default=30.0)
    p.add_argument("--peer-read-timeout", type=float, default=2.0)
    args = p.parse_args(argv)
    if args.transfer == "inprocess":  # this process's own fabric: tests of the role alone
        transfer = InProcessFabric().transfer_factory(host.core, args.agent_name, compat)
    else:
        from kv_transfer.nixl_backend import NixlBackend

        # No NIXL progress thread (it spins a core): the loop polls every iteration, and our own
        # thread while prompts are held for readers (a step would stall their reads).
        transfer = NixlBackend(args.agent_name, host.core.runner.kv_blocks, compat, progress_thread=False)
    tiers = engine_tiers(
        host.core, transfer, args.agent_name, compat, args.lease_seconds, args.peer_read_timeout
    )
    role = PrefillEngineRole(host, transfer, args.lease_seconds, tiers)
    if args.transfer == "nixl":
        transfer.keep_progressing(lambda: bool(len(role.held.leases)))
        role.on_lease = transfer.wake
    return role


if __name__ == "__main__":
    run(role=prefill_role)
