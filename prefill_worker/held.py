"""A prefill worker's held and watched prompts, kept on the thread that runs its engine: the
in-process worker's engine thread (``prefill_worker.worker``) or its engine process's
(``prefill_worker.engine_host``).

A prompt whose first token is out is *held*: its blocks stay allocated under a lease until a reader's
completion notification, a release, a caller that left, or the lease's expiry frees them. A *watched*
prompt's blocks are announced (and pinned) as steps compute them, each reader from the first block,
then the rest of its held blocks once it is done. Announcements go to ``announce(request_id,
block_ids, complete, end)``; ``end`` closes the reader's watch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.scheduler_output import SequenceOutput
from kv_transfer.stats import TransferStats

logger = logging.getLogger(__name__)
RELEASES = ("notification", "release", "expiry", "abandoned")
Announce = Callable[[str, list[int], bool, bool], None]


@dataclass(slots=True)
class _Watch:
    deadline: float | None  # time.monotonic() by which the request must show up (None: it did)
    sent: int = 0  # blocks announced so far


class HeldPrompts:
    def __init__(self, core, lease_s: float, announce: Announce) -> None:
        self.core = core
        self.lease_s = lease_s
        self.announce = announce
        self.leases: dict[str, tuple[float, float]] = {}  # request id -> expiry (monotonic, unix)
        self.watches: dict[str, _Watch] = {}
        self.releases = dict.fromkeys(RELEASES, 0)
        self.stats = TransferStats()  # the prefill side's share: leases that expired unread

    def on_output(self, out: SequenceOutput) -> float | None:
        """After every output: a prompt held from now on (its lease's unix expiry returned), or one
        that ended before its blocks were held (nothing more to read; its exposed blocks unpinned)."""
        if out.held_block_ids is None:
            if out.finish_reason is not None:
                self.end_watch(out.request_id)
                self.core.unpin(out.request_id)
            return None
        self.end_watch(out.request_id, out.held_block_ids)
        lease = self.leases[out.request_id] = (time.monotonic() + self.lease_s, time.time() + self.lease_s)
        return lease[1]

    def release(self, request_id: str, why: str) -> bool:
        self.core.unpin(request_id)
        if self.leases.pop(request_id, None) is None:
            return False  # already freed: a late notification or a repeated release is harmless
        self.core.release_held(request_id)
        self.releases[why] += 1
        logger.debug("released %s (%s)", request_id, why)
        return True

    def tick(self, notifications) -> None:
        """Readers' completion notifications ((peer, request id bytes) pairs), then expired leases."""
        for _peer, msg in notifications:
            self.release(msg.decode("utf-8", "replace"), "notification")
        if self.leases:
            now = time.monotonic()
            for rid in [r for r, (expiry, _) in self.leases.items() if expiry <= now]:
                logger.warning("lease of %s expired: freeing its blocks", rid)
                self.release(rid, "expiry")
                self.stats.expired_leases += 1

    def start_watch(self, request_id: str, wait_s: float) -> None:
        """A new reader (it replaces an older one: its owner ended that one's stream)."""
        held = self.core.kv.held.get(request_id) if request_id in self.leases else None
        if held is not None:  # done already: all of it at once
            self.watches.pop(request_id, None)
            self.announce(request_id, list(held), True, True)
            return
        self.watches[request_id] = _Watch(time.monotonic() + wait_s)

    def end_watch(self, request_id: str, rest: list[int] | None = None) -> None:
        watch = self.watches.pop(request_id, None)
        if watch is not None:
            blocks = rest[watch.sent :] if rest is not None else []
            self.announce(request_id, blocks, rest is not None, True)

    def expose(self) -> None:
        """After each step: announce (and pin) the watched prompts' newly computed blocks."""
        now = time.monotonic()
        for rid, watch in list(self.watches.items()):
            if watch.deadline is not None:
                if rid in self.core.scheduler.requests:
                    watch.deadline = None
                elif now > watch.deadline:
                    self.end_watch(rid)
                    continue
            ids = self.core.expose_computed(rid, watch.sent)
            if ids:
                watch.sent += len(ids)
                self.announce(rid, ids, False, False)
