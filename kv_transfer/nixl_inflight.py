"""NIXL read requests in flight, tracked until no byte of them can land any more.

A request moves: posted -> checked (``PROC``) ... -> ended (``DONE`` or an error) -> released.
Its ``TransferHandle`` may reach ``FAILED`` before the request ends (deadline passed, peer
removed, handle released): NIXL over UCX cannot abort an RMA read in flight, so the request is
kept and checked until it ends, and only then are the handle's local blocks marked reusable.

NIXL facts this relies on (nixl 1.5, UCX plugin; measured, and exercised by tests/kv_transfer):
- ``check_xfer_state`` returns ``"PROC"`` / ``"DONE"`` / ``"ERR"`` or raises a bindings error.
- The notification goes out once the data is complete: from ``transfer`` if the post completed at
  once, else from the check that first sees ``DONE``. A reader that stops checking never notifies.
- A peer that died fails its requests fast with ``nixlRemoteDisconnectError``.
- Releasing a request in flight (NIXL "cancels" it) does not stop an RMA read: over TCP its bytes
  still land when a stalled peer resumes. Removing the peer does not fence either, and afterwards
  checks raise ``nixlNotFoundError``, hiding the request's end; hence peers are invalidated only
  once their requests have ended. Destroying the agent does fence: UCX drops what is unflushed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from kv_transfer.base import TransferHandle, TransferState

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Request:
    handle: TransferHandle
    xfer: Any  # nixl_xfer_handle


class InflightReads:
    """The requests of one NIXL agent that may still write into local KV blocks."""

    def __init__(self, agent: Any, disconnect_error: type[Exception], not_found_error: type[Exception]):
        self._agent = agent
        self._disconnect_error = disconnect_error
        self._not_found_error = not_found_error
        self._requests: dict[int, _Request] = {}
        self.dead_peers: set[str] = set()  # peers NIXL reported disconnected

    def __len__(self) -> int:
        return len(self._requests)

    def post(self, handle: TransferHandle, xfer: Any) -> None:
        """Post a created request; from here on it is tracked until it ends."""
        request = self._requests[handle.transfer_id] = _Request(handle, xfer)
        try:
            status = self._agent.transfer(xfer)
        except Exception as e:
            self._fail(request, e)
        else:
            self._on_status(request, status)

    def check(self, handle: TransferHandle) -> None:
        request = self._requests.get(handle.transfer_id)
        if request is not None:
            self._check(request)

    def check_all(self, only_failed: bool = False) -> None:
        """Check every tracked request, or only those whose handle already failed (orphans)."""
        for request in list(self._requests.values()):
            if not only_failed or request.handle.state is TransferState.FAILED:
                self._check(request)

    def is_tracked(self, handle: TransferHandle) -> bool:
        return handle.transfer_id in self._requests

    def busy_peers(self) -> set[str]:
        return {r.handle.remote_agent for r in self._requests.values()}

    def fail_peer(self, peer: str, reason: str) -> None:
        for request in self._requests.values():
            if request.handle.remote_agent == peer:
                request.handle.finish(TransferState.FAILED, reason, settled=False)

    def close(self, reason: str) -> list[TransferHandle]:
        """Fail and release every request (NIXL's cancel) and drop the agent; the caller fences."""
        handles = []
        for request in self._requests.values():
            request.handle.finish(TransferState.FAILED, reason, settled=False)
            _release_quietly(request.xfer)
            handles.append(request.handle)
        self._requests.clear()
        self._agent = None
        return handles

    def _check(self, request: _Request) -> None:
        try:
            status = self._agent.check_xfer_state(request.xfer)
        except Exception as e:
            self._fail(request, e)
        else:
            self._on_status(request, status)

    def _on_status(self, request: _Request, status: str) -> None:
        handle = request.handle
        if status == "DONE":
            if handle.state is TransferState.FAILED:
                logger.info("transfer %d ended after failing; local blocks reusable", handle.transfer_id)
            handle.finish(TransferState.DONE, settled=True)
            self._end(request)
        elif status == "PROC":
            if handle.state is TransferState.IN_PROGRESS and time.monotonic() >= handle.deadline:
                logger.warning(
                    "transfer %d from %s timed out; local blocks %s stay exposed until it ends",
                    handle.transfer_id,
                    handle.remote_agent,
                    list(handle.local_block_ids),
                )
                handle.finish(TransferState.FAILED, "timed out", settled=False)
        else:
            self._fail(request, RuntimeError(f"NIXL transfer state {status}"))

    def _fail(self, request: _Request, error: Exception) -> None:
        handle = request.handle
        if isinstance(error, self._disconnect_error):
            self.dead_peers.add(handle.remote_agent)
        # NOTE: NOT_FOUND means the peer's metadata is gone, which says nothing about the request
        # unless the peer is dead; such a request can never be checked again, so its blocks leak.
        lost = isinstance(error, self._not_found_error) and handle.remote_agent not in self.dead_peers
        reason = f"transfer from {handle.remote_agent} failed: {describe(error)}"
        handle.finish(TransferState.FAILED, reason, settled=not lost)
        if lost:
            logger.error(
                "transfer %d: lost track of a request in flight; local blocks %s leak",
                handle.transfer_id,
                list(handle.local_block_ids),
            )
        self._end(request)

    def _end(self, request: _Request) -> None:
        del self._requests[request.handle.transfer_id]
        _release_quietly(request.xfer)


def describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _release_quietly(xfer: Any) -> None:
    try:
        xfer.release()
    except Exception as e:  # NIXL keeps what it cannot release and retries when the agent dies
        logger.warning("NIXL could not release a transfer handle: %s", describe(e))
