"""Prefixes this router has sent to a worker that the registry does not show there yet.

A worker publishes a block's hash only after it computed the block, a prefill later; the router
learns of it after another Redis round trip. Until then, a second request with the same prefix
would see no hit anywhere and could be sent elsewhere to compute the same prefix again (the
common case at a tenant's cold start, when its requests arrive together). Like SGLang's router,
which inserts a request into its worker's approximate tree when it routes it, the router records
each routed prompt's blocks against the worker at once; routing reads them beside the index.

An entry lives while its request is being prefilled, then for a grace period that covers the
worker's KV event reaching the index; a failed prefill drops it at once. Entries never outlive
``max_age_s`` (a request whose end was never reported cannot pin a prediction forever).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping

from engine.block_hash import iter_block_hashes


class RoutedPrefixes:
    def __init__(
        self,
        grace_s: float = 2.0,
        max_age_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.grace_s = grace_s
        self.max_age_s = max_age_s
        self._clock = clock
        self._holders: dict[bytes, Counter[str]] = {}
        self._entries: dict[int, tuple[str, list[bytes], float]] = {}  # token -> (worker, hashes, expiry)
        self._expiries: list[tuple[float, int]] = []  # heap of (expiry, token); stale ones skipped
        self._tokens = itertools.count()

    def add(self, worker_id: str, hashes: list[bytes]) -> int:
        """Record that ``worker_id`` is computing (and will cache) ``hashes``; returns the entry's
        token for ``settle``."""
        token = next(self._tokens)
        expiry = self._clock() + self.max_age_s
        self._entries[token] = (worker_id, hashes, expiry)
        heapq.heappush(self._expiries, (expiry, token))
        for h in hashes:
            self._holders.setdefault(h, Counter())[worker_id] += 1
        return token

    def settle(self, token: int, computed: bool) -> None:
        """The request's prefill ended: keep the entry ``grace_s`` more if the worker computed the
        blocks (its KV event is on the way), drop it now if it did not."""
        entry = self._entries.get(token)
        if entry is None:
            return
        if not computed:
            self._drop(token)
            return
        worker, hashes, expiry = entry
        expiry = min(expiry, self._clock() + self.grace_s)
        self._entries[token] = (worker, hashes, expiry)
        heapq.heappush(self._expiries, (expiry, token))

    def holders(self) -> Mapping[bytes, Counter[str]]:
        """Block hash -> workers predicted to hold it (for ``PrefixIndex.match``'s ``also``)."""
        self._expire()
        return self._holders

    def __len__(self) -> int:
        return len(self._entries)

    def _expire(self) -> None:
        now = self._clock()
        heap = self._expiries
        while heap and heap[0][0] <= now:
            _, token = heapq.heappop(heap)
            entry = self._entries.get(token)
            if entry is not None and entry[2] <= now:
                self._drop(token)

    def _drop(self, token: int) -> None:
        worker, hashes, _ = self._entries.pop(token)
        for h in hashes:
            counts = self._holders.get(h)
            if counts is None:
                continue
            counts[worker] -= 1
            if counts[worker] <= 0:
                del counts[worker]
                if not counts:
                    del self._holders[h]


class PromptHashes:
    """A prompt's block hashes, computed only as far as they are read: the routing decision stops at
    the first block no worker holds, and ``all()`` finishes the rest only for a prompt that is
    recorded (the tail its worker is about to compute anyway)."""

    def __init__(self, prompt: list[int], block_size: int, salt: str) -> None:
        self._rest = iter_block_hashes(prompt, block_size, salt)
        self._done: list[bytes] = []

    def __iter__(self) -> Iterator[bytes]:
        yield from self._done
        for h in self._rest:
            self._done.append(h)
            yield h

    def all(self) -> list[bytes]:
        self._done.extend(self._rest)
        return self._done
