"""KV transfer over NIXL (UCX): one agent per engine, the whole KV tensor registered once.

A read: pair remote and local block ids, merge them into runs (``merge_block_runs``), build one
``(addr, len, device)`` descriptor per run on each side, ``initialize_xfer("READ", ...)`` with the
notification, post it; ``InflightReads`` then tracks the request until it ends (see there for the
NIXL semantics of time-outs and aborts); ``NixlPeers`` keeps the remote agents.

Progress: by default NIXL runs a UCX progress thread per agent, which spins one CPU core (measured:
a full core while idle). With ``progress_thread=False`` UCX progresses only inside this backend's
calls: a read's connection set-up (and, over TCP, all of it) moves only while the reader polls
*and* the owner calls ``get_notifications``, so an owner that stops polling stalls its readers.
An engine thread polls between steps, and a CPU prefill step lasts tens to hundreds of ms: its
readers waited for it (a 1P+1D deployment on 2 cores, ``kv_transfer`` hop p50 129 ms against 1 ms
for the read itself). ``keep_progressing`` polls on a thread of its own, every millisecond, while
there is something to move (held prompts to be read, reads in flight), and sleeps otherwise; a
millisecond in which the engine polled itself (between its steps) needs no poll of the thread's.

Each public call takes a lock, so threads may share one backend.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np
import torch

from kv_transfer.base import RemoteKVInfo, TransferHandle, TransferState, merge_block_runs, new_read
from kv_transfer.compat import KVCompat, check_kv_tensor, dtype_name
from kv_transfer.nixl_inflight import InflightReads, describe
from kv_transfer.nixl_peers import NixlPeers

logger = logging.getLogger(__name__)

_IDLE_WAKE_S = 0.05  # a progress thread with nothing to move checks again after this long


class NixlUnavailableError(RuntimeError):
    """NIXL (or its UCX plugin) cannot run in this environment."""


def _import_nixl() -> tuple[ModuleType, ModuleType]:
    try:
        from nixl import _api, _bindings
    except Exception as e:  # ImportError, or a native library that fails to load
        raise NixlUnavailableError(
            f"NIXL is required for KV transfer but cannot be imported ({describe(e)}); "
            "install it with `pip install nixl`"
        ) from e
    return _api, _bindings


class NixlBackend:
    """``KVTransferBackend`` over NIXL/UCX for one engine's block-major KV tensor."""

    def __init__(
        self,
        agent_name: str,
        kv: torch.Tensor,
        compat: KVCompat,
        *,
        progress_thread: bool = True,
        num_threads: int = 0,
    ) -> None:
        check_kv_tensor(tuple(kv.shape), dtype_name(kv.dtype), compat)
        if not kv.is_contiguous():
            raise ValueError("the KV tensor must be contiguous (block-major, one region per block)")
        api, bindings = _import_nixl()
        config = api.nixl_agent_config(
            enable_prog_thread=progress_thread, backends=["UCX"], num_threads=num_threads
        )
        agent = api.nixl_agent(agent_name, config)
        if "UCX" not in agent.backends:
            raise NixlUnavailableError(f"NIXL agent {agent_name!r} could not create its UCX backend")
        self._agent: Any = agent
        self.agent_name = agent_name
        self.compat = compat
        self._kv = kv  # NOTE: keeps the registered memory alive as long as the agent
        self.num_blocks = kv.shape[0]
        self.block_bytes = kv[0].numel() * kv.element_size()
        self._mem_type = "VRAM" if kv.is_cuda else "DRAM"
        self._device_id = (kv.device.index or 0) if kv.is_cuda else 0
        region = (kv.data_ptr(), self.num_blocks * self.block_bytes, self._device_id, "")
        self._reg = agent.register_memory([region], self._mem_type)
        self._metadata: bytes = agent.get_agent_metadata()
        self._local_info: RemoteKVInfo | None = None
        self._inflight = InflightReads(agent, bindings.nixlRemoteDisconnectError, bindings.nixlNotFoundError)
        self._peers = NixlPeers(agent, agent_name, compat, self.block_bytes)
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self._closed = False
        self._taken: list[tuple[str, bytes]] = []  # notifications the progress thread took
        self._wake = threading.Event()
        self._needed: list[Callable[[], bool]] = []  # keep_progressing's conditions besides our reads
        self._progressor: threading.Thread | None = None
        self._progressed_at = 0.0  # when UCX last moved (monotonic): by the thread or a caller's poll
        logger.info("NIXL agent %s: %d KV blocks in %s", agent_name, self.num_blocks, self._mem_type)

    def local_info(self) -> RemoteKVInfo:
        """What a peer needs to read these blocks (fixed for the agent's life: built once; every
        prefilled request's handle names the agent)."""
        if self._local_info is None:
            self._local_info = RemoteKVInfo(
                agent_name=self.agent_name,
                agent_metadata=self._metadata,
                base_addr=self._kv.data_ptr(),
                block_bytes=self.block_bytes,
                num_blocks=self.num_blocks,
                compat=self.compat,
                mem_type=self._mem_type,
                device_id=self._device_id,
            )
        return self._local_info

    def add_peer(self, info: RemoteKVInfo) -> None:
        with self._lock:
            self._check_open()
            self._peers.add(info, self._inflight)

    def remove_peer(self, agent_name: str) -> None:
        with self._lock:
            if not self._closed:
                self._peers.remove(agent_name, self._inflight)
                self._reap()

    def start_read(
        self,
        remote_agent: str,
        remote_block_ids: list[int],
        local_block_ids: list[int],
        notify: bytes,
        timeout_s: float,
    ) -> TransferHandle:
        with self._lock:
            self._check_open()
            self._reap()
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
                try:
                    self._agent.send_notif(remote_agent, handle.notify)
                except Exception as e:
                    handle.finish(TransferState.FAILED, f"cannot notify: {describe(e)}", settled=True)
                else:
                    handle.finish(TransferState.DONE, settled=True)
                return handle
            bb, base = self.block_bytes, self._kv.data_ptr()
            runs = merge_block_runs(list(handle.remote_block_ids), local)
            src = np.array([(peer.block_addr(r), n * bb, peer.device_id) for r, _, n in runs], np.uint64)
            dst = np.array([(base + lo * bb, n * bb, self._device_id) for _, lo, n in runs], np.uint64)
            try:
                xfer = self._agent.initialize_xfer(
                    "READ",
                    self._agent.get_xfer_descs(dst, self._mem_type),
                    self._agent.get_xfer_descs(src, peer.mem_type),
                    remote_agent,
                    handle.notify,
                )
            except Exception as e:  # nothing was posted: the local blocks are untouched
                handle.finish(TransferState.FAILED, f"cannot create the read: {describe(e)}", settled=True)
                return handle
            self._inflight.post(handle, xfer)
            self._wake.set()  # a progress thread moves it from here on
            return handle

    def poll(self, handle: TransferHandle) -> TransferState:
        with self._lock:
            if not self._closed:
                self._inflight.check(handle)
                self._inflight.check_all(only_failed=True)
            return handle.state

    def release(self, handle: TransferHandle) -> None:
        with self._lock:
            if self._closed or not self._inflight.is_tracked(handle):
                return
            self._inflight.check(handle)
            handle.finish(TransferState.FAILED, "released before completion", settled=False)
            if not handle.local_blocks_reusable:
                logger.warning(
                    "transfer %d released in flight; its local blocks stay exposed", handle.transfer_id
                )

    def get_notifications(self) -> list[tuple[str, bytes]]:
        with self._lock:
            self._check_open()
            self._progress()
            taken, self._taken = self._taken, []
            return taken

    def keep_progressing(self, needed: Callable[[], bool] | None = None, interval_s: float = 0.001) -> None:
        """Progress this agent's transfers on a daemon thread (one per agent) every ``interval_s``
        while reads of ours are in flight or any ``needed()`` given so far holds (called on that
        thread: keep it to a length or a flag), until ``close``; ``wake`` ends a wait for work early.
        The notifications it takes are ``get_notifications``'s."""
        with self._lock:
            if needed is not None:
                self._needed.append(needed)
            if self._progressor is None:
                self._progressor = threading.Thread(
                    target=self._keep_progressing, args=(interval_s,), name=f"nixl-progress-{self.agent_name}"
                )
                self._progressor.daemon = True
                self._progressor.start()

    def wake(self) -> None:
        """Something to move now (a prompt held for readers, a read posted)."""
        self._wake.set()

    def _keep_progressing(self, interval_s: float) -> None:
        try:
            while not self._closed:
                if not (len(self._inflight) or any(needed() for needed in self._needed)):
                    self._wake.wait(_IDLE_WAKE_S)
                    self._wake.clear()
                    continue
                # A poll of the engine's own (between its steps) counts: under load it polls every
                # step, and the thread's polls, each a lock, a UCX progress and a notification read,
                # were a fifth of a prefill engine process's CPU on short prompts.
                wait = self._progressed_at + interval_s - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                    continue
                with self._lock:
                    if self._closed:
                        return
                    self._progress()
        except Exception:  # the engine's own calls still progress (between steps), as before
            logger.exception("NIXL agent %s: its progress thread stopped", self.agent_name)

    def _progress(self) -> None:
        """Check the reads in flight and take the notifications (both move UCX). Under the lock."""
        self._reap()
        notifs = self._agent.get_new_notifs()
        self._taken += [(agent, bytes(msg)) for agent, msgs in notifs.items() for msg in msgs]
        self._progressed_at = time.monotonic()

    def send_notification(self, remote_agent: str, msg: bytes) -> None:
        with self._lock:
            self._check_open()
            if self._peers.get(remote_agent) is None:
                raise ValueError(f"unknown peer {remote_agent!r}: add_peer() its RemoteKVInfo first")
            self._agent.send_notif(remote_agent, bytes(msg))

    def close(self) -> None:
        """Tear down the agent; afterwards no transfer can write into the KV tensor."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._wake.set()  # a progress thread waiting for work ends
            self._inflight.check_all()
            abandoned = self._inflight.close("backend closed")
            self._peers.close()
            try:
                self._agent.deregister_memory(self._reg)
            finally:
                # NOTE: dropping the agent destroys its UCX worker, and the memory is deregistered:
                # nothing of an abandoned request can land any more.
                self._agent = None
                for handle in abandoned:
                    handle.local_blocks_reusable = True

    def __enter__(self) -> NixlBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"NIXL backend {self.agent_name!r} is closed")

    def _reap(self) -> None:
        """Check every request in flight, then invalidate removed peers that have none left."""
        self._inflight.check_all()
        self._peers.retire_idle(self._inflight.busy_peers())
