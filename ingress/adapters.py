"""The LoRA adapters a request may name as its ``model``, as the cluster serves them.

The ingress does not configure adapters: it learns them from the router (``ClusterState.adapters``:
those a live decode worker serves, from the workers' registry records). The names are refreshed when
a request names a model the ingress does not know (so a new adapter is usable at once) and when
``/v1/models`` is listed, at most once a second; a router that cannot be reached leaves the last
known names in place. An adapter a worker serves under the base model's name is left out (a
request naming it gets the base model), with a warning.
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)


class AdapterNames:
    """The served adapters' names; swapped whole, so validation threads read a consistent set."""

    def __init__(self, names=(), min_interval_s: float = 1.0, base: str | None = None) -> None:
        self.names: frozenset[str] = frozenset(names)
        self.min_interval_s = min_interval_s
        self.base = base  # the base model's served name: an adapter under it could never be named
        self._refreshed = float("-inf")
        self._warned: set[str] = set()

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def __iter__(self):
        return iter(sorted(self.names))

    def forget_refresh(self) -> None:
        """The next ``refresh`` asks the router whatever the interval (the names just changed)."""
        self._refreshed = float("-inf")

    async def refresh(self, client) -> bool:
        """Ask the router (``client``: a RouterClient) for the served adapters; True when the
        names changed. Skipped within ``min_interval_s`` of the last refresh."""
        now = time.monotonic()
        if now - self._refreshed < self.min_interval_s:
            return False
        self._refreshed = now
        try:
            state = await client.cluster_state(timeout_s=2.0)
        except Exception as exc:  # the router is away: keep the names we know
            logger.info("could not refresh the served adapters: %s", exc)
            return False
        names = frozenset(state.adapters)
        if self.base in names:
            names -= {self.base}
            if self.base not in self._warned:
                self._warned.add(self.base)
                logger.warning(
                    "a worker serves a LoRA adapter named %r, the base model's name: requests naming it "
                    "get the base model; load the adapter under another name",
                    self.base,
                )
        changed, self.names = names != self.names, names
        return changed
