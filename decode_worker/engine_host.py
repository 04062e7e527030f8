"""``python -m decode_worker.engine_host``: a decode worker's engine process, with its KV pulls.

The pulls (``decode_worker.kv_pull``) run where the engine's KV memory is: the NIXL agent is
registered over that memory in this process, and the READs are posted and polled on the engine's
thread every iteration, as they are on an in-process worker's engine thread. The worker's process
keeps what needs the network (the prefill workers' metadata from their GetState, a streamed prompt's
watch) and sends the rest as commands: ``add_peer``, ``remove_peer``, ``pull``, ``pull_early``,
``pull_extend``, ``pull_finish``. An abort ends the request's pull first, as the worker's ``_abort``
does. Messages carry the pulls that landed (the request's clock) and the kind of a failed pull's error.

With a host tier, its memory gets an agent of its own (``<agent>-tier``): aggregated requests read a
prompt's prefix from a peer decode worker's host tier and lend this one's (``worker.peer_tiers``: the
``lend`` and ``fetch`` commands, ``EngineEvents.fetched``), as a prefill worker's engine process does.

    --transfer nixl|inprocess|none   the backend over the engine's KV (none: no hand-offs)
    --agent-name NAME                the NIXL agent's name (the worker's id and epoch)
    --transfer-timeout S             seconds before a pull fails
    --peer-read-timeout S            seconds before a read of a peer's prefix blocks fails
    --lend-lease-seconds S           blocks lent to a peer are pinned at most this long
"""

from __future__ import annotations

import argparse
import time

from decode_worker.kv_pull import FailurePolicy, KVPuller, PendingPull, pulled_kv_from_handle
from kv_transfer import InProcessFabric, KVCompat, KVTransferBackend
from proto import pdserve_pb2 as pb
from proto.convert import params_from_proto
from worker.engine_process import EngineHost, EngineRole, run
from worker.peer_tiers import EngineTierPeers, PeerTiers, engine_tiers
from worker.state import transfer_info_from_proto, transfer_info_to_proto, transfer_stats_to_proto


class DecodeEngineRole(EngineRole):
    def __init__(
        self, host: EngineHost, transfer: KVTransferBackend, timeout_s: float, tiers: PeerTiers | None = None
    ) -> None:
        self.transfer = transfer
        self.landed: list[tuple[str, float, float]] = []  # (request id, READ seconds, landed at)
        self.pulls = KVPuller(host.core, transfer, host.publish, timeout_s, self._on_landed)
        self.peers = EngineTierPeers(tiers)

    def _on_landed(self, request_id: str, seconds: float) -> None:
        # NOTE: stamped here, not where the worker reads the event: the event travels with the
        # outputs of the step after the landing, and the request's clock would count that step as
        # queueing (decode_queue) and none of it as its first step.
        self.landed.append((request_id, seconds, time.monotonic()))

    def ready(self, msg: pb.EngineReady) -> None:
        msg.transfer.CopyFrom(transfer_info_to_proto(self.transfer.local_info()))

    def run(self, cmd: pb.EngineCommand, reply: pb.EngineReply) -> bool:
        kind = cmd.WhichOneof("kind")
        if kind == "add_peer":
            self.transfer.add_peer(transfer_info_from_proto(cmd.add_peer))
        elif kind == "remove_peer":
            self.transfer.remove_peer(cmd.remove_peer)
        elif kind == "pull":
            reply.started = self.pulls.start(_pending(cmd.pull), reachable=cmd.pull.reachable)
        elif kind == "pull_early":
            reply.started = self.pulls.begin_early(_pending(cmd.pull_early))
        elif kind == "pull_extend":
            e = cmd.pull_extend
            self.pulls.extend(e.request_id, list(e.block_ids), e.complete)
        elif kind == "pull_finish":
            started = self.pulls.finish_early(
                cmd.pull_finish.request.request_id, pulled_kv_from_handle(cmd.pull_finish.handle)
            )
            if started is not None:
                reply.started = started
        else:
            return self.peers.run(cmd, reply)
        return True

    def abort(self, request_id: str) -> bool | None:
        # A read of a peer's blocks is dropped, the request not added yet: the abort finds nothing
        # (an Abort call says so, and its caller cancels the stream instead).
        self.peers.abort(request_id)
        return self.pulls.abort(request_id)

    def tick(self) -> None:
        self.pulls.tick()
        self.peers.tick()

    def hurry(self) -> bool:
        return self.pulls.landing()

    def stats(self, reply: pb.EngineReply) -> None:
        reply.transfer_stats.CopyFrom(transfer_stats_to_proto(self.pulls.stats))
        reply.pending_pulls = len(self.pulls)

    def finish(self, events: pb.EngineEvents, outputs) -> dict[str, str]:
        for rid, seconds, at in self.landed:
            events.landed.add(request_id=rid, seconds=seconds, at=at)
        self.landed.clear()
        self.peers.finish(events)
        kinds = {}
        for out in outputs:
            if out.error and out.finish_reason == "error":
                err = self.pulls.take_error(out.request_id)
                if err is not None:
                    kinds[out.request_id] = type(err).__name__
        return kinds


def _pending(msg: pb.EnginePull) -> PendingPull:
    req = msg.request
    return PendingPull(
        req.request_id,
        list(req.prompt_token_ids),
        params_from_proto(req.params),
        req.priority,
        pulled_kv_from_handle(msg.handle),
        FailurePolicy(msg.policy),
    )


def decode_role(host: EngineHost, compat: KVCompat, argv: list[str]) -> EngineRole:
    p = argparse.ArgumentParser(prog="python -m decode_worker.engine_host")
    p.add_argument("--transfer", choices=("nixl", "inprocess", "none"), default="none")
    p.add_argument("--agent-name", default="decode")
    p.add_argument("--transfer-timeout", type=float, default=10.0)
    p.add_argument("--peer-read-timeout", type=float, default=2.0)
    p.add_argument("--lend-lease-seconds", type=float, default=10.0)
    args = p.parse_args(argv)
    if args.transfer == "none":
        return EngineRole()
    if args.transfer == "inprocess":  # this process's own fabric: tests of the role alone
        transfer = InProcessFabric().transfer_factory(host.core, args.agent_name, compat)
    else:
        from kv_transfer.nixl_backend import NixlBackend

        # No NIXL progress thread (it spins a core): the loop polls every iteration, and our own
        # thread while reads are in flight (a step would hold up their bytes).
        transfer = NixlBackend(args.agent_name, host.core.runner.kv_blocks, compat, progress_thread=False)
        transfer.keep_progressing()
    tiers = engine_tiers(
        host.core, transfer, args.agent_name, compat, args.lend_lease_seconds, args.peer_read_timeout
    )
    return DecodeEngineRole(host, transfer, args.transfer_timeout, tiers)


if __name__ == "__main__":
    run(role=decode_role)
