"""KV transfer between engines in one process, for unit tests: the NIXL backend's semantics without NIXL.

Backends register on an ``InProcessFabric`` by agent name. The reader tracks a read from
``start_read`` until it *ends*; it moves only when the reader calls in (no threads, no sleeps):

    started ──poll──> data copied, owner notified ──> DONE (blocks reusable)
       │ injected transport error, or the owner closed ──> FAILED (blocks reusable at once)
       │ stalled (``fabric.stall_reads()``) ... deadline ──> FAILED, blocks NOT reusable
       └ peer removed / handle released in flight ──> FAILED, blocks NOT reusable
    an unsettled read ends later: the fabric resumes (the data lands and the owner is notified, as
    over UCX), the owner closes (the peer died), or the reader closes (fenced).

So a test sees what a NIXL reader sees (``kv_transfer.base``). Each public call holds the fabric's
lock: the engine threads of several workers may share one fabric.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kv_transfer.base import RemoteKVInfo, TransferHandle, TransferState, new_read
from kv_transfer.compat import KVCompat, KVIncompatibleError, check_compatible, check_kv_tensor, dtype_name

if TYPE_CHECKING:
    import torch

    from engine.engine_core import EngineCore

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Read:
    handle: TransferHandle
    owner_metadata: bytes  # the owner's incarnation when the read started
    fault: bool  # an injected transport error


class InProcessFabric:
    """The "network" of one test: registered backends, notification delivery, fault switches."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.backends: dict[str, InProcessBackend] = {}
        self._serial = itertools.count()
        self._fail_next = 0
        self.stalled = False

    def transfer_factory(self, core: EngineCore, agent_name: str, compat: KVCompat) -> InProcessBackend:
        """A ``worker.runtime.TransferFactory``: a backend on this fabric over the engine's KV tensor."""
        return InProcessBackend(self, agent_name, core.runner.kv_blocks, compat)

    def fail_next_reads(self, count: int = 1) -> None:
        """The next ``count`` reads started fail with a transport error (their blocks reusable at once)."""
        with self.lock:
            self._fail_next += count

    def stall_reads(self) -> None:
        """No read makes progress (its data does not land) until ``resume_reads``."""
        with self.lock:
            self.stalled = True

    def resume_reads(self) -> None:
        """Stalled reads complete on their reader's next call (even those that already timed out)."""
        with self.lock:
            self.stalled = False

    def _register(self, backend: InProcessBackend) -> bytes:
        with self.lock:
            if backend.agent_name in self.backends:
                raise ValueError(f"agent {backend.agent_name!r} is already on this fabric")
            self.backends[backend.agent_name] = backend
            return f"inprocess:{backend.agent_name}:{next(self._serial)}".encode()

    def _take_fault(self) -> bool:
        if self._fail_next:
            self._fail_next -= 1
            return True
        return False


class InProcessBackend:
    """``KVTransferBackend`` over one engine's block-major KV tensor ``[num_blocks, ...]``."""

    def __init__(self, fabric: InProcessFabric, agent_name: str, kv: torch.Tensor, compat: KVCompat) -> None:
        check_kv_tensor(tuple(kv.shape), dtype_name(kv.dtype), compat)
        self.fabric = fabric
        self.agent_name = agent_name
        self.compat = compat
        self.kv = kv
        self.num_blocks = kv.shape[0]
        self.block_bytes = kv[0].numel() * kv.element_size()
        self._peers: dict[str, RemoteKVInfo] = {}
        self._reads: dict[int, _Read] = {}  # reads not yet ended, by transfer id
        self._inbox: list[tuple[str, bytes]] = []
        self._ids = itertools.count()
        self._closed = False
        self._metadata = fabric._register(self)

    @property
    def in_flight(self) -> int:
        """Reads that may still write into local blocks (not yet ended)."""
        with self.fabric.lock:
            return len(self._reads)

    def local_info(self) -> RemoteKVInfo:
        return RemoteKVInfo(
            agent_name=self.agent_name,
            agent_metadata=self._metadata,
            base_addr=0,
            block_bytes=self.block_bytes,
            num_blocks=self.num_blocks,
            compat=self.compat,
        )

    def add_peer(self, info: RemoteKVInfo) -> None:
        with self.fabric.lock:
            self._check_open()
            name = info.agent_name
            check_compatible(self.compat, info.compat, peer=name)
            if info.block_bytes != self.block_bytes:
                raise KVIncompatibleError(
                    f"cannot pull KV from worker {name}: block_bytes {self.block_bytes} != {info.block_bytes}"
                )
            if name == self.agent_name:
                raise ValueError(f"bad peer {name!r}: must be another agent")
            old = self._peers.get(name)
            if old is not None and old != info:  # a new incarnation under the same name
                self._fail_reads_from(name, "peer re-registered")
            self._peers[name] = info

    def remove_peer(self, agent_name: str) -> None:
        """Reads from the peer fail but, as over UCX, may still land: their blocks stay exposed."""
        with self.fabric.lock:
            if not self._closed and self._peers.pop(agent_name, None) is not None:
                self._fail_reads_from(agent_name, "peer removed")
                self._progress_all()

    def start_read(
        self,
        remote_agent: str,
        remote_block_ids: list[int],
        local_block_ids: list[int],
        notify: bytes,
        timeout_s: float,
    ) -> TransferHandle:
        with self.fabric.lock:
            self._check_open()
            self._progress_all()
            peer = self._peers.get(remote_agent)
            if peer is None:
                raise ValueError(f"unknown peer {remote_agent!r}: add_peer() its RemoteKVInfo first")
            handle = new_read(
                next(self._ids),
                peer,
                remote_block_ids,
                local_block_ids,
                self.num_blocks,
                notify,
                timeout_s,
            )
            local = list(handle.local_block_ids)
            if not local:  # nothing to move (all prefix hits): the owner still needs its notification
                if self._deliver(peer, handle.notify):
                    handle.finish(TransferState.DONE, settled=True)
                else:
                    handle.finish(TransferState.FAILED, f"cannot notify {remote_agent}", settled=True)
                return handle
            self._reads[handle.transfer_id] = _Read(handle, peer.agent_metadata, self.fabric._take_fault())
            return handle

    def poll(self, handle: TransferHandle) -> TransferState:
        with self.fabric.lock:
            if not self._closed:
                if handle.transfer_id in self._reads:
                    self._progress(handle.transfer_id)
                self._progress_all(only_failed=True)
            return handle.state

    def release(self, handle: TransferHandle) -> None:
        with self.fabric.lock:
            if self._closed or handle.transfer_id not in self._reads:
                return
            self._progress(handle.transfer_id)
            handle.finish(TransferState.FAILED, "released before completion", settled=False)

    def get_notifications(self) -> list[tuple[str, bytes]]:
        with self.fabric.lock:
            self._check_open()
            self._progress_all()
            out, self._inbox = self._inbox, []
            return out

    def send_notification(self, remote_agent: str, msg: bytes) -> None:
        with self.fabric.lock:
            self._check_open()
            peer = self._peers.get(remote_agent)
            if peer is None:
                raise ValueError(f"unknown peer {remote_agent!r}: add_peer() its RemoteKVInfo first")
            self._deliver(peer, bytes(msg))  # to a peer that is gone: lost, like a message to a dead host

    def close(self) -> None:
        """Leave the fabric. Own reads end here (fenced); peers' reads from this one fail (peer died)."""
        with self.fabric.lock:
            if self._closed:
                return
            self._closed = True
            for read in self._reads.values():
                read.handle.finish(TransferState.FAILED, "backend closed", settled=True)
            self._reads.clear()
            self.fabric.backends.pop(self.agent_name, None)

    def __enter__(self) -> InProcessBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Internals (fabric lock held) -----------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"in-process backend {self.agent_name!r} is closed")

    def _owner(self, name: str, metadata: bytes) -> InProcessBackend | None:
        """The live backend of that incarnation (None once it closed: the peer died)."""
        owner = self.fabric.backends.get(name)
        return owner if owner is not None and owner._metadata == metadata else None

    def _deliver(self, peer: RemoteKVInfo, msg: bytes) -> bool:
        owner = self._owner(peer.agent_name, peer.agent_metadata)
        if owner is not None:
            owner._inbox.append((self.agent_name, msg))
        return owner is not None

    def _progress_all(self, only_failed: bool = False) -> None:
        for tid, read in list(self._reads.items()):
            if not only_failed or read.handle.state is TransferState.FAILED:
                self._progress(tid)

    def _progress(self, tid: int) -> None:
        """Move one read as far as it can go now; it is forgotten once it has ended."""
        read = self._reads[tid]
        h = read.handle
        owner = self._owner(h.remote_agent, read.owner_metadata)
        if read.fault or owner is None:
            why = "injected transport error" if read.fault else "peer is gone"
            h.finish(TransferState.FAILED, f"transfer from {h.remote_agent} failed: {why}", settled=True)
        elif not self.fabric.stalled:
            self.kv[list(h.local_block_ids)] = owner.kv[list(h.remote_block_ids)].to(self.kv.device)
            owner._inbox.append((self.agent_name, h.notify))
            h.finish(TransferState.DONE, settled=True)
        else:
            if h.state is TransferState.IN_PROGRESS and time.monotonic() >= h.deadline:
                logger.warning(
                    "transfer %d timed out; blocks %s stay exposed", h.transfer_id, h.local_block_ids
                )
                h.finish(TransferState.FAILED, "timed out", settled=False)
            return
        del self._reads[tid]

    def _fail_reads_from(self, name: str, reason: str) -> None:
        for read in self._reads.values():
            if read.handle.remote_agent == name:
                read.handle.finish(TransferState.FAILED, reason, settled=False)
