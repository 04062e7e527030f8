"""The peers of one NIXL agent: remote agents loaded from their published ``RemoteKVInfo``.

A peer moves: added (compatibility checked, NIXL metadata loaded) -> removed by the caller ->
retiring (still loaded while requests to it may be in flight, since invalidating a remote hides
its requests' end) -> invalidated in NIXL. Adding the same info again is a no-op, and revives a
retiring peer; new metadata under a known name (a restarted worker) replaces the old at once.
"""

from __future__ import annotations

import logging
from typing import Any

from kv_transfer.base import RemoteKVInfo
from kv_transfer.compat import KVCompat, KVIncompatibleError, check_compatible
from kv_transfer.nixl_inflight import InflightReads, describe

logger = logging.getLogger(__name__)

MEM_TYPES = ("DRAM", "VRAM")


class NixlPeers:
    def __init__(self, agent: Any, local_name: str, compat: KVCompat, block_bytes: int) -> None:
        self._agent = agent
        self._local_name = local_name
        self._compat = compat
        self._block_bytes = block_bytes
        self._active: dict[str, RemoteKVInfo] = {}
        self._retiring: dict[str, RemoteKVInfo] = {}

    def get(self, name: str) -> RemoteKVInfo | None:
        return self._active.get(name)

    def add(self, info: RemoteKVInfo, inflight: InflightReads) -> None:
        name = info.agent_name
        check_compatible(self._compat, info.compat, peer=name)
        if info.block_bytes != self._block_bytes:
            raise KVIncompatibleError(
                f"cannot pull KV from worker {name}: block_bytes {self._block_bytes} != {info.block_bytes}"
            )
        if name == self._local_name or info.mem_type not in MEM_TYPES:
            raise ValueError(f"bad peer {name!r} ({info.mem_type}): must be another agent, DRAM or VRAM")
        if self._active.get(name) == info:
            return
        if self._retiring.get(name) == info:
            self._active[name] = self._retiring.pop(name)
            return
        if name in self._active or name in self._retiring:
            logger.warning("peer %s re-registered with new metadata; dropping the old one", name)
            inflight.fail_peer(name, "peer re-registered")
            self._active.pop(name, None)
            self._retiring.pop(name, None)
            self._invalidate(name)
        loaded = self._agent.add_remote_agent(info.agent_metadata)
        loaded = loaded.decode() if isinstance(loaded, bytes) else loaded  # bytes in nixl 1.5
        if loaded != name:
            if loaded not in self._active and loaded not in self._retiring:
                self._invalidate(loaded)
            raise ValueError(f"peer metadata is for agent {loaded!r}, not {name!r}")
        inflight.dead_peers.discard(name)
        self._active[name] = info

    def remove(self, name: str, inflight: InflightReads) -> None:
        info = self._active.pop(name, None)
        if info is not None:
            inflight.fail_peer(name, "peer removed")
            self._retiring[name] = info

    def retire_idle(self, busy: set[str]) -> None:
        """Invalidate removed peers that no request in flight (``busy``) still reads from."""
        for name in [n for n in self._retiring if n not in busy]:
            del self._retiring[name]
            self._invalidate(name)

    def close(self) -> None:
        for name in [*self._active, *self._retiring]:
            self._invalidate(name)
        self._active.clear()
        self._retiring.clear()
        self._agent = None

    def _invalidate(self, name: str) -> None:
        try:
            self._agent.remove_remote_agent(name)
        except Exception as e:  # already dropped by NIXL after a disconnect
            logger.debug("remove_remote_agent(%s): %s", name, describe(e))
