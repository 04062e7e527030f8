"""``python -m prefill_worker.engine_host``: a prefill worker's engine process, with its held KV.

What the in-process prefill worker does on its engine thread runs here, next to the engine's KV
memory: the NIXL agent registered over it (decode workers read the held blocks from this process,
and their completion notifications arrive here), the leases on held prompts (freed on a reader's
notification, a ``release`` command, an abort, or expiry), and the watches of prompts whose KV is
streamed while it is computed (each step's newly computed blocks pinned and announced). Messages
carry the leases taken (``EngineEvents.leases``, before the outputs that hold them) and the watched
prompts' blocks (``exposed``); the worker's process answers the gRPC calls from them.

    --transfer nixl|inprocess        the backend over the engine's KV (inprocess: tests of the role)
    --agent-name NAME                the NIXL agent's name (the worker's id and epoch)
    --lease-seconds S                held KV is freed after this long
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass

from kv_transfer import InProcessFabric, KVCompat, KVTransferBackend
from kv_transfer.stats import TransferStats
from proto import pdserve_pb2 as pb
from worker.engine_process import EngineHost, EngineRole, run
from worker.state import transfer_info_to_proto, transfer_stats_to_proto

logger = logging.getLogger(__name__)
RELEASES = ("notification", "release", "expiry", "abandoned")


@dataclass(slots=True)
class _Watch:
    deadline: float | None  # time.monotonic() by which the request must show up (None: it did)
    sent: int = 0  # blocks announced so far


class PrefillEngineRole(EngineRole):
    def __init__(self, host: EngineHost, transfer: KVTransferBackend, lease_s: float) -> None:
        self.core = host.core
        self.publish = host.publish
        self.transfer = transfer
        self.lease_s = lease_s
        self.leases: dict[str, float] = {}  # request id -> time.monotonic() of expiry
        self.watches: dict[str, _Watch] = {}
        self.releases = dict.fromkeys(RELEASES, 0)
        self.stats_ = TransferStats()  # leases that expired unread
        self._leased: list[pb.EngineLease] = []
        self._exposed: list[pb.EngineExposed] = []

    def ready(self, msg: pb.EngineReady) -> None:
        msg.transfer.CopyFrom(transfer_info_to_proto(self.transfer.local_info()))

    def run(self, cmd: pb.EngineCommand, reply: pb.EngineReply) -> bool:
        kind = cmd.WhichOneof("kind")
        if kind == "release":
            reply.released = self._release(cmd.release, "release")
        elif kind == "watch":
            self._start_watch(cmd.watch.request_id, cmd.watch.wait_s)
        elif kind == "unwatch":
            self.watches.pop(cmd.unwatch, None)
        else:
            return False
        return True

    def abort(self, request_id: str) -> bool:
        """The caller left: a held prompt is freed, a running one aborted (``_release`` unpinned its
        exposed blocks first, so the abort frees them all). Its abort outputs are not sent: nobody
        reads them, and a retry under the same id must not get them."""
        self._end_watch(request_id)
        if self._release(request_id, "abandoned"):
            return True
        return bool(self.core.abort_request(request_id))

    def tick(self) -> None:
        for _peer, msg in self.transfer.get_notifications():
            self._release(msg.decode("utf-8", "replace"), "notification")
        if self.leases:
            now = time.monotonic()
            for rid in [r for r, expiry in self.leases.items() if expiry <= now]:
                logger.warning("lease of %s expired: freeing its blocks", rid)
                self._release(rid, "expiry")
                self.stats_.expired_leases += 1

    def stats(self, reply: pb.EngineReply) -> None:
        reply.transfer_stats.CopyFrom(transfer_stats_to_proto(self.stats_))
        reply.num_leases = len(self.leases)
        reply.releases.update(self.releases)

    def finish(self, events: pb.EngineEvents, outputs) -> dict[str, str]:
        for out in outputs:
            if out.held_block_ids is not None:
                self._end_watch(out.request_id, out.held_block_ids)
                self.leases[out.request_id] = time.monotonic() + self.lease_s
                lease = pb.EngineLease(request_id=out.request_id, expiry_unix=time.time() + self.lease_s)
                self._leased.append(lease)
            elif out.finish_reason is not None:  # ended before its blocks were held: nothing to read
                self._end_watch(out.request_id)
                self.core.unpin(out.request_id)
        self._expose()
        events.leases.extend(self._leased)
        events.exposed.extend(self._exposed)
        self._leased.clear()
        self._exposed.clear()
        return {}

    # Held blocks and watches ------------------------------------------------------------------

    def _release(self, request_id: str, why: str) -> bool:
        self.core.unpin(request_id)
        if self.leases.pop(request_id, None) is None:
            return False  # already freed: a late notification or a repeated release is harmless
        self.core.release_held(request_id)
        self.releases[why] += 1
        return True

    def _start_watch(self, request_id: str, wait_s: float) -> None:
        held = self.core.kv.held.get(request_id) if request_id in self.leases else None
        if held is not None:  # done already: all of it at once
            self._announce(request_id, list(held), complete=True, end=True)
            return
        # A newer reader replaces the older one; the worker ended the older one's stream itself.
        self.watches[request_id] = _Watch(time.monotonic() + wait_s)

    def _end_watch(self, request_id: str, rest: list[int] | None = None) -> None:
        watch = self.watches.pop(request_id, None)
        if watch is not None:
            blocks = rest[watch.sent :] if rest is not None else []
            self._announce(request_id, blocks, complete=rest is not None, end=True)

    def _expose(self) -> None:
        """Announce (and pin) the watched prompts' newly computed blocks."""
        now = time.monotonic()
        for rid, watch in list(self.watches.items()):
            if watch.deadline is not None:
                if rid in self.core.scheduler.requests:
                    watch.deadline = None
                elif now > watch.deadline:
                    self._end_watch(rid)
                    continue
            ids = self.core.expose_computed(rid, watch.sent)
            if ids:
                watch.sent += len(ids)
                self._announce(rid, ids)

    def _announce(self, request_id: str, block_ids: list[int], complete=False, end=False) -> None:
        self._exposed.append(
            pb.EngineExposed(request_id=request_id, block_ids=block_ids, complete=complete, end=end)
        )


def prefill_role(host: EngineHost, compat: KVCompat, argv: list[str]) -> EngineRole:
    p = argparse.ArgumentParser(prog="python -m prefill_worker.engine_host")
    p.add_argument("--transfer", choices=("nixl", "inprocess"), default="nixl")
    p.add_argument("--agent-name", default="prefill")
    p.add_argument("--lease-seconds", type=float, default=30.0)
    args = p.parse_args(argv)
    if args.transfer == "inprocess":  # this process's own fabric: tests of the role alone
        transfer = InProcessFabric().transfer_factory(host.core, args.agent_name, compat)
    else:
        from kv_transfer.nixl_backend import NixlBackend

        # No NIXL progress thread: the loop polls every iteration (a progress thread spins a core).
        transfer = NixlBackend(args.agent_name, host.core.runner.kv_blocks, compat, progress_thread=False)
    return PrefillEngineRole(host, transfer, args.lease_seconds)


if __name__ == "__main__":
    run(role=prefill_role)
