"""The KV transfer interface: a small, backend-agnostic poll state machine.

The reader (decode side) pulls blocks from an owner (prefill side):

    owner:  info = backend.local_info()         -> published (protobuf over gRPC, never pickle)
    reader: backend.add_peer(info)               -> checks KV compatibility, connects lazily
    reader: h = backend.start_read(owner, remote_ids, local_ids, notify=b"req-7", timeout_s=5)
    reader: backend.poll(h)                      -> IN_PROGRESS ... DONE | FAILED
    owner:  backend.get_notifications()          -> [(reader_agent, b"req-7")]: free the blocks
    reader: backend.release(h)

A transfer moves through ``IN_PROGRESS`` to ``DONE`` or ``FAILED`` (an error, its peer removed, or
its deadline passed). ``poll`` drives it: the owner's notification goes out once the data is
complete (from ``start_read`` if the read completed at once, else from the ``poll`` that sees it
done), so a reader that stops polling never notifies.

Block reuse after a failure (``TransferHandle.local_blocks_reusable``): a transfer that failed with
an error reported by the transport is over, and its local blocks may be reused at once. A transfer
that timed out may still be running: NIXL over UCX cannot abort an RMA read in flight (measured:
releasing the request, or removing the peer, does not stop bytes from landing once a stalled peer
resumes). So a timed-out handle reports ``FAILED`` at its deadline, for the caller to fall back
(recompute into other blocks), while its local blocks stay exposed until the backend sees the
underlying request end (the peer resumes and it completes, or the peer dies and it errors) or the
backend is closed; ``poll``, ``start_read``, ``get_notifications`` and ``release`` keep checking
such requests and then set ``local_blocks_reusable``. Free a failed transfer's local blocks only
once it is True. A peer that never resumes nor dies keeps them: they leak (the time-out warning
names them).

The owner must keep the blocks it published unchanged until the reader's deadline has passed (its
lease outlives the read's ``timeout_s``): a READ copies whatever the blocks hold when it runs.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kv_transfer.compat import KVCompat


class TransferState(enum.Enum):
    IN_PROGRESS = "in_progress"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class RemoteKVInfo:
    """What an engine publishes so peers can read its KV: plain bytes, ints and strings only.

    ``mem_type`` (``"DRAM"`` / ``"VRAM"``) and ``device_id`` say where the KV tensor lives; NIXL
    needs both to address the remote region.
    """

    agent_name: str
    agent_metadata: bytes
    base_addr: int
    block_bytes: int
    num_blocks: int
    compat: KVCompat
    mem_type: str = "DRAM"
    device_id: int = 0

    def block_addr(self, block_id: int) -> int:
        return self.base_addr + block_id * self.block_bytes


@dataclass(eq=False, slots=True)
class TransferHandle:
    """One READ of remote blocks into local blocks; the backend updates it in place."""

    transfer_id: int
    remote_agent: str
    remote_block_ids: tuple[int, ...]
    local_block_ids: tuple[int, ...]
    num_bytes: int
    notify: bytes
    deadline: float  # time.monotonic()
    started_at: float = field(default_factory=time.monotonic)
    state: TransferState = TransferState.IN_PROGRESS
    error: str | None = None
    finished_at: float | None = None
    # NOTE: False while the transport may still write into local_block_ids (see module docstring).
    local_blocks_reusable: bool = False

    def finish(self, state: TransferState, error: str | None = None, *, settled: bool) -> None:
        if self.state is TransferState.IN_PROGRESS:
            self.state, self.error, self.finished_at = state, error, time.monotonic()
        if settled:
            self.local_blocks_reusable = True


def new_read(
    transfer_id: int,
    peer: RemoteKVInfo,
    remote_block_ids: list[int],
    local_block_ids: list[int],
    local_num_blocks: int,
    notify: bytes,
    timeout_s: float,
) -> TransferHandle:
    """A validated handle for ``start_read`` (every backend checks a read the same way): ids in
    range on both sides, as many local as remote ids, no local id twice, a positive timeout.
    Raises ``ValueError`` (a caller error)."""
    remote, local = [int(b) for b in remote_block_ids], [int(b) for b in local_block_ids]
    if len(remote) != len(local):
        raise ValueError(f"{len(remote)} remote block ids but {len(local)} local block ids")
    for side, ids, n in (("remote", remote, peer.num_blocks), ("local", local, local_num_blocks)):
        bad = [b for b in ids if not 0 <= b < n]
        if bad:
            raise ValueError(f"{side} block ids {bad} out of range [0, {n})")
    if len(set(local)) != len(local):
        raise ValueError(f"local block ids repeat: {local}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    return TransferHandle(
        transfer_id=transfer_id,
        remote_agent=peer.agent_name,
        remote_block_ids=tuple(remote),
        local_block_ids=tuple(local),
        num_bytes=len(local) * peer.block_bytes,
        notify=bytes(notify),
        deadline=time.monotonic() + timeout_s,
    )


@runtime_checkable
class KVTransferBackend(Protocol):
    """Moves KV blocks between engines. One backend per engine; it owns that engine's KV memory."""

    def local_info(self) -> RemoteKVInfo:
        """This engine's published record, for peers' ``add_peer``."""
        ...

    def add_peer(self, info: RemoteKVInfo) -> None:
        """Make a peer readable. Idempotent per ``agent_name`` (new metadata replaces old).

        Raises ``KVIncompatibleError`` when the peer's KV layout differs from ours.
        """
        ...

    def remove_peer(self, agent_name: str) -> None:
        """Forget a peer; its transfers in progress fail. Unknown names are ignored."""
        ...

    def start_read(
        self,
        remote_agent: str,
        remote_block_ids: list[int],
        local_block_ids: list[int],
        notify: bytes,
        timeout_s: float,
    ) -> TransferHandle:
        """READ ``remote_block_ids[i]`` of the peer into ``local_block_ids[i]``, for every i.

        When the data has landed the peer receives ``notify`` (also for an empty read). Caller
        errors (unknown peer, bad ids) raise ``ValueError``; transport errors give a handle that
        polls ``FAILED``.
        """
        ...

    def poll(self, handle: TransferHandle) -> TransferState:
        """The transfer's state; ``FAILED`` once ``timeout_s`` has passed without completion."""
        ...

    def release(self, handle: TransferHandle) -> None:
        """Free the transport resources of a transfer; a transfer in progress is failed first."""
        ...

    def get_notifications(self) -> list[tuple[str, bytes]]:
        """Owner side: ``(peer agent name, message)`` received since the last call."""
        ...

    def send_notification(self, remote_agent: str, msg: bytes) -> None:
        """Send ``msg`` to a peer, outside any transfer (e.g. "done, free the blocks")."""
        ...

    def close(self) -> None:
        """Release everything; the backend is unusable afterwards."""
        ...


def merge_block_runs(remote_ids: list[int], local_ids: list[int]) -> list[tuple[int, int, int]]:
    """Pairs ``(remote_ids[i], local_ids[i])`` as runs ``(remote_start, local_start, length)``.

    A pair extends the current run when both its remote and its local id are the previous ones
    plus one, so one descriptor covers contiguous blocks on both sides. Order is preserved.
    """
    if len(remote_ids) != len(local_ids):
        raise ValueError(f"{len(remote_ids)} remote block ids but {len(local_ids)} local block ids")
    runs: list[tuple[int, int, int]] = []
    for r, loc in zip(remote_ids, local_ids):
        if runs:
            r0, l0, n = runs[-1]
            if r == r0 + n and loc == l0 + n:
                runs[-1] = (r0, l0, n + 1)
                continue
        runs.append((r, loc, 1))
    return runs
