"""Routing policies: pick the (prefill, decode) pair for a request.

Every policy sees the same inputs: the prompt's block hashes, the live workers with their load
(registry heartbeat, raised by the router's own count of what it has in flight there), and the
prefix index. ``cache_aware`` (default) sends the prompt where the estimated time to its first token
is least — the prompt tokens a worker would still compute plus those already queued there — so a
warm worker wins until its queue costs more than the recompute elsewhere, and a new prefix goes
where the cache has the most room; a decode worker is chosen
by free KV blocks and running requests, its own cached prefix breaking ties.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from registry.prefix_index import PrefixIndex
from registry.schema import WorkerRecord

POLICIES = ("round_robin", "least_load", "cache_aware")


@dataclass(slots=True)
class WorkerLoad:
    """What the router itself has in flight on a worker (exact, unlike the periodic heartbeat)."""

    prompt_tokens: int = 0
    requests: int = 0


@dataclass(frozen=True, slots=True)
class Route:
    prefill: WorkerRecord | None  # None: aggregated on the decode worker
    decode: WorkerRecord
    predicted_hit_tokens: int = 0


@dataclass(slots=True)
class RoutingInput:
    hashes: Iterator[bytes]  # lazy: consumed once, up to the first block nobody holds
    prompt_len: int
    block_size: int
    prefills: list[WorkerRecord]
    decodes: list[WorkerRecord]
    inflight: dict[str, WorkerLoad] = field(default_factory=dict)


class Policy:
    name = "base"

    def choose(self, inp: RoutingInput, index: PrefixIndex) -> Route:
        raise NotImplementedError

    def _load(self, inp: RoutingInput, w: WorkerRecord) -> WorkerLoad:
        return inp.inflight.get(w.worker_id) or WorkerLoad()

    def _queued_tokens(self, inp: RoutingInput, w: WorkerRecord) -> int:
        return max(w.queued_prompt_tokens, self._load(inp, w).prompt_tokens)

    def _busy(self, inp: RoutingInput, w: WorkerRecord) -> int:
        return max(w.num_running + w.num_waiting, self._load(inp, w).requests)


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._p = itertools.count()
        self._d = itertools.count()

    def choose(self, inp: RoutingInput, index: PrefixIndex) -> Route:
        prefill = inp.prefills[next(self._p) % len(inp.prefills)] if inp.prefills else None
        decode = inp.decodes[next(self._d) % len(inp.decodes)]
        return Route(prefill, decode, _hit_tokens(inp, index, prefill))


class LeastLoad(Policy):
    name = "least_load"

    def choose(self, inp: RoutingInput, index: PrefixIndex) -> Route:
        prefill = (
            min(inp.prefills, key=lambda w: (self._queued_tokens(inp, w), w.worker_id))
            if inp.prefills
            else None
        )
        return Route(prefill, self._decode(inp), _hit_tokens(inp, index, prefill))

    def _decode(self, inp: RoutingInput, hits: dict[str, int] | None = None) -> WorkerRecord:
        hits = hits or {}
        return min(
            inp.decodes,
            key=lambda w: (self._busy(inp, w), -w.num_free_blocks, -hits.get(w.worker_id, 0), w.worker_id),
        )


class CacheAware(LeastLoad):
    name = "cache_aware"

    def choose(self, inp: RoutingInput, index: PrefixIndex) -> Route:
        workers = [w.worker_id for w in inp.prefills] + [w.worker_id for w in inp.decodes]
        with index.lock:
            hits = index.match(inp.hashes, workers)
            cached = {w.worker_id: index.num_blocks_of(w.worker_id) for w in inp.prefills}
        bs = inp.block_size
        prefill = None
        if inp.prefills:
            # Ties (e.g. a new prefix on idle workers) go where the cache has the most room, which
            # spreads tenants over the workers instead of piling them onto the first one.
            prefill = min(
                inp.prefills,
                key=lambda w: (
                    inp.prompt_len - hits.get(w.worker_id, 0) * bs + self._queued_tokens(inp, w),
                    -hits.get(w.worker_id, 0),
                    cached[w.worker_id],
                    w.worker_id,
                ),
            )
        decode = self._decode(inp, hits)
        return Route(prefill, decode, hits.get(prefill.worker_id, 0) * bs if prefill else 0)


def make_policy(name: str) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"routing policy must be one of {POLICIES}, got {name!r}")
    return {"round_robin": RoundRobin, "least_load": LeastLoad, "cache_aware": CacheAware}[name]()


def _hit_tokens(inp: RoutingInput, index: PrefixIndex, w: WorkerRecord | None) -> int:
    if w is None:
        return 0
    with index.lock:
        return index.match(inp.hashes, [w.worker_id]).get(w.worker_id, 0) * inp.block_size
