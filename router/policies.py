"""Routing policies: pick the (prefill, decode) pair for a request.

Every policy sees the same inputs: the prompt's block hashes, the live workers with their load,
and the prefix index (plus the prefixes this router has just routed, which the index does not show
yet). ``cache_aware`` (default) sends the prompt where its first token is expected soonest: the
prompt tokens a worker would still compute plus the uncached tokens already queued there. A warm
worker wins until its queue costs more than the recompute elsewhere, so a hot tenant spills onto a
second worker instead of piling up on one (llm-d's prefix + queue scorers, with the weights fixed
by both terms being tokens of work); a new prefix goes where the cache has the most room. A decode
worker that receives its KV is chosen by running requests and free KV blocks, its own cached prefix
breaking ties (and free-block differences under a sixteenth of its cache); aggregated (no prefill
workers), the decode worker computes the prompt and is chosen
as a prefill worker is, by the same cost, its running batch breaking ties. Among
otherwise equal workers, a request of a LoRA adapter goes to one that has the adapter in a device
slot (its heartbeat's ``resident_loras``), where it runs without a swap-in.
A prefix block in a worker's host tier (engine/kv_host_tier.py) or disk tier (engine/kv_disk_tier.py)
counts between a device hit and a miss: it saves the compute of its tokens less the load the worker
measured for that tier (``host_hit_cost_pct``, ``disk_hit_cost_pct``). A prefix held by another
prefill worker (on its device or in its host tier) can be read from there (``PeerPrefix``,
worker/peer_tiers.py): for a worker that reads peers, the blocks past its own hits count at
the cost it measured for such reads (``peer_hit_cost_pct``), so a busy owner's tenant goes to an idle
worker that reads the prefix instead of computing it; aggregated, decode workers read from each
other the same way.

Load is the router's exact count of what it has in flight on a worker (on a decode worker, from the
moment a request is routed there), plus what the worker's heartbeat shows beyond that (other router
replicas' work). The heartbeat alone is up to a period
stale: taking it as is, a worker that just finished our requests would look busy for a second (and
lose the next request of a conversation whose prefix it holds); so what a report shows up to the
most requests (and queued prompt tokens) of ours that ran there within a report's age is taken as
ours. Requests routed to a decode worker whose prefill still runs (held) are not on that worker
yet, so no report shows them: they count on top of the report, never against it.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field

from engine.block_hash import iter_block_hashes
from registry.prefix_index import PrefixIndex
from registry.schema import WorkerRecord

POLICIES = ("round_robin", "least_load", "cache_aware")
# How old a worker's load report may be when a router reads it: its heartbeat's period (1 s) and the
# cluster view's poll, with a margin.
REPORT_AGE_S = 1.5
ROOM_STEP = 1 / 16  # a decode worker's cache is clearly emptier than another's by this share of it


@dataclass(slots=True)
class WorkerLoad:
    """What the router itself has in flight on a worker (exact, unlike the periodic heartbeat)."""

    prompt_tokens: int = 0  # uncached prompt tokens of our requests queued or prefilling there
    requests: int = 0  # our requests on the worker (a report can show them)
    # Our requests routed to this decode worker whose Decode is not open yet (no report shows them).
    held: int = 0
    _reported: int = -1  # the heartbeat's queued tokens when we last looked
    _others: int = 0  # of those, the part that was not ours then
    _reported_busy: int = -1  # the same for its running + waiting requests
    _others_busy: int = 0
    # (when, our requests there, our queued tokens there) just before each of ours there ended, the
    # last REPORT_AGE_S: the most of ours a report read now can hold
    _ended: deque = field(default_factory=deque)

    def queued_tokens(self, reported: int) -> int:
        """Uncached prompt tokens queued on the worker: ours exactly, plus what its heartbeat
        (``reported``) showed beyond the most of ours queued there within a report's age (the figure
        may have been taken while they were), when that figure first reached us."""
        if reported != self._reported:
            self._reported = reported
            self._others = max(0, reported - self._recent_peak(2, self.prompt_tokens))
        return self.prompt_tokens + self._others

    def busy(self, reported: int) -> int:
        """Requests running or waiting on the worker: ours exactly (held ones included), plus what
        its heartbeat (``reported``) showed beyond the most of ours that ran there within a report's
        age (the figure may have been taken while they ran), when that figure first reached us.
        Under a steady load that most is ours now, and other routers' requests count in full."""
        if reported != self._reported_busy:
            self._reported_busy = reported
            self._others_busy = max(0, reported - self._recent_peak(1, self.requests))
        return self.requests + self.held + self._others_busy

    def end(self, tokens: int = 0, request: bool = True) -> None:
        """One of our requests there ended (``request``), or its ``tokens`` left the queue (per
        request: O(1), the window's maximum is taken only when a report changes)."""
        now = time.monotonic()
        self._ended.append((now, self.requests, self.prompt_tokens))
        self.requests -= int(request)
        self.prompt_tokens -= tokens
        self._prune(now)

    def _prune(self, now: float) -> None:
        ended, since = self._ended, now - REPORT_AGE_S
        while ended and ended[0][0] < since:
            ended.popleft()

    def _recent_peak(self, col: int, now: int) -> int:
        self._prune(time.monotonic())
        return max(now, max((e[col] for e in self._ended), default=0))


class NoWorkersError(RuntimeError):
    """No worker can take the request (none registered, or all lost by it)."""


# The refusal of a request that arrives while the application drains: a 503 the front end codes
# ``draining`` (as its own refusal once it closes), not ``unavailable``.
DRAINING_MESSAGE = "the service is shutting down and takes no new requests"


class AdapterNotServed(NoWorkersError):
    """Decode workers are registered, but none serves the request's LoRA adapter (a 404 at the edge)."""


class DecodeHold:
    """A request counted on the decode worker it was routed to while its Decode is not open yet (its
    prefill runs). Without it a burst routed at once sees every decode worker idle and piles onto
    the one that wins the tie. ``release`` (idempotent) once the Decode opens (it counts itself)
    or the attempt ends; ``move`` when a re-route picks another decode worker."""

    __slots__ = ("_inflight", "_load")

    def __init__(self, inflight: dict[str, WorkerLoad], worker_id: str) -> None:
        self._inflight = inflight
        self._load: WorkerLoad | None = None
        self.move(worker_id)

    def move(self, worker_id: str) -> None:
        self.release()
        self._load = self._inflight.setdefault(worker_id, WorkerLoad())
        self._load.held += 1

    def release(self) -> None:
        if self._load is not None:
            self._load.held -= 1
            self._load = None


class PromptWork:
    """A prompt routed to the worker that computes it (a prefill worker, or an aggregated decode
    worker), counted there until its first token: the uncached tokens it queues there (what the
    next route sees as that worker's queue) and its blocks as routed there (``router.affinity``: a
    second request of the prefix follows it before the worker's KV events reach the index).
    ``done`` (idempotent) when the first token came (``computed``) or the attempt ended without."""

    __slots__ = ("_load", "_requests", "_routed", "_token", "_work")

    def __init__(
        self, inflight, routed, w: WorkerRecord, work: int, hashes: list[bytes], request: bool
    ) -> None:
        self._load = inflight.setdefault(w.worker_id, WorkerLoad())
        self._work, self._requests, self._routed = work, int(request), routed
        self._load.prompt_tokens += work
        self._load.requests += self._requests
        self._token: int | None = routed.add(w.worker_id, hashes if w.prefix_caching else [])

    def done(self, computed: bool) -> None:
        if self._token is None:
            return
        self._load.end(self._work, bool(self._requests))
        self._routed.settle(self._token, computed)
        self._token = None


@dataclass(frozen=True, slots=True)
class Route:
    prefill: WorkerRecord | None  # None: aggregated on the decode worker
    decode: WorkerRecord
    predicted_hit_tokens: int = 0
    peer: WorkerRecord | None = None  # the worker (of the computing one's role) to read the prefix from
    peer_blocks: int = 0  # how many (from block 0; the reader skips those it holds)
    sole: bool = False  # the only candidate: nothing was weighed, and nothing later will be


@dataclass(slots=True)
class RoutingInput:
    hashes: Iterator[bytes]  # lazy: consumed once, up to the first block nobody holds
    prompt_len: int
    block_size: int
    prefills: list[WorkerRecord]
    decodes: list[WorkerRecord]
    inflight: dict[str, WorkerLoad] = field(default_factory=dict)
    routed: Mapping[bytes, Collection[str]] | None = None  # routed prefixes the index lacks yet
    lora: str = ""  # the request's LoRA adapter ("": the base model)


class Policy:
    name = "base"
    peer_reads = True  # cache_aware: a worker computing a prompt may read its prefix from a peer

    def choose(self, inp: RoutingInput, index: PrefixIndex) -> Route:
        raise NotImplementedError

    def _load(self, inp: RoutingInput, w: WorkerRecord) -> WorkerLoad:
        return inp.inflight.get(w.worker_id) or WorkerLoad()

    def _queued_tokens(self, inp: RoutingInput, w: WorkerRecord) -> int:
        load = inp.inflight.get(w.worker_id)
        return load.queued_tokens(w.queued_prompt_tokens) if load else w.queued_prompt_tokens

    def _busy(self, inp: RoutingInput, w: WorkerRecord) -> int:
        load = inp.inflight.get(w.worker_id)
        reported = w.num_running + w.num_waiting
        return load.busy(reported) if load else reported

    @staticmethod
    def _swaps(inp: RoutingInput, w: WorkerRecord) -> bool:
        """Whether running the request on ``w`` first copies its adapter into a device slot."""
        return bool(inp.lora) and not w.resident(inp.lora)


def _room(w: WorkerRecord) -> float:
    """A worker's free KV blocks as a share of its cache (its free blocks where it reports no
    size): differences under ``ROOM_STEP`` (a request's blocks in a heartbeat taken while it ran, a
    prefix kept) do not outrank the prompt's prefix."""
    return w.num_free_blocks / w.num_blocks if w.num_blocks > 0 else float(w.num_free_blocks)


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
            min(inp.prefills, key=lambda w: (self._queued_tokens(inp, w), self._swaps(inp, w), w.worker_id))
            if inp.prefills
            else None
        )
        return Route(prefill, self._decode(inp), _hit_tokens(inp, index, prefill))

    def _decode(self, inp: RoutingInput, hits: dict[str, int] | None = None) -> WorkerRecord:
        hits = hits or {}
        roomiest = max(_room(w) for w in inp.decodes)
        return min(
            inp.decodes,
            key=lambda w: (
                self._busy(inp, w),
                self._swaps(inp, w),  # among equally busy workers, one with the adapter resident
                roomiest - _room(w) >= ROOM_STEP,  # a clearly emptier cache first; else the prefix
                -hits.get(w.worker_id, 0),
                -w.num_free_blocks,
                w.worker_id,
            ),
        )


class CacheAware(LeastLoad):
    name = "cache_aware"

    def choose(self, inp: RoutingInput, index: PrefixIndex) -> Route:
        workers = [w.worker_id for w in (*inp.prefills, *inp.decodes) if w.prefix_caching]
        seen: list[bytes] = []
        with index.lock:
            looked_up = (seen.append(h) or h for h in inp.hashes)
            tiers = _capped(inp, index.match_tiers(looked_up, workers, inp.routed))
            # A peer lends what it holds (its published blocks), not the prompts just routed to it.
            lent = _capped(inp, index.match_tiers(seen, workers)) if inp.routed and self.peer_reads else tiers
            cached = {w.worker_id: index.num_blocks_of(w.worker_id) for w in inp.prefills}
        hits = {w: sum(runs) for w, runs in tiers.items()}
        if not inp.prefills:  # aggregated: the decode worker computes the prompt, its batch breaks ties
            ties = lambda w: (self._busy(inp, w), self._swaps(inp, w), -w.num_free_blocks, w.worker_id)  # noqa: E731
            return Route(None, *self._cheapest(inp, inp.decodes, tiers, lent, hits, ties))
        # A decode worker's pulled KV lands on its device hits only (its host tier serves prompts
        # it computes itself), so those break its ties.
        decode = self._decode(inp, {w: runs[0] for w, runs in tiers.items()})
        # Ties (e.g. a new prefix on idle workers) go where the cache has the most room, which
        # spreads tenants over the workers instead of piling them onto the first one.
        ties = lambda w: (self._swaps(inp, w), -hits.get(w.worker_id, 0), cached[w.worker_id], w.worker_id)  # noqa: E731
        prefill, *rest = self._cheapest(inp, inp.prefills, tiers, lent, hits, ties)
        return Route(prefill, decode, *rest)

    def _cheapest(self, inp: RoutingInput, candidates, tiers, lent, hits: dict[str, int], ties):
        """The worker among ``candidates`` that would give the prompt's first token soonest: the
        prompt tokens it would still compute (its own hits, or a peer's blocks read at its measured
        cost: of those a peer has published, ``lent``) plus the uncached tokens queued there,
        ``ties(worker)`` ordering the rest. Returns (worker, predicted hit tokens, the peer to read
        from or None, the peer's blocks)."""
        bs = inp.block_size
        peers = _PeerPrefixes(candidates if self.peer_reads else [], tiers, lent)
        saved = {w.worker_id: peers.saved(w) for w in candidates}
        best = min(
            candidates,
            key=lambda w: (
                inp.prompt_len - saved[w.worker_id][0] * bs + self._queued_tokens(inp, w),
                *ties(w),
            ),
        )
        _, peer, peer_blocks = saved[best.worker_id]
        if peer is not None:
            return best, peer_blocks * bs, peer, peer_blocks
        return best, hits.get(best.worker_id, 0) * bs, None, 0


Runs = tuple[int, int, int]  # a prefix hit's blocks on the device, then in the host tier, then on disk


def _capped(inp: RoutingInput, tiers: dict[str, Runs]) -> dict[str, Runs]:
    """Hits as the engine takes them: at most the prompt's full blocks before its last token (that
    token is always computed: its logits give the first output token)."""
    cap = max(0, (inp.prompt_len - 1) // inp.block_size)

    def cut(runs: Runs) -> Runs:
        left, out = cap, []
        for n in runs:
            out.append(min(n, left))
            left -= out[-1]
        return tuple(out)

    return {w: cut(runs) for w, runs in tiers.items()}


def _saved_blocks(w: WorkerRecord, tiers: Mapping[str, Runs]) -> float:
    """Prompt blocks a worker need not compute: its device hits, and its host- and disk-tier hits
    weighed by what loading one costs there (measured by the worker, in % of computing it)."""
    device, host, disk = tiers.get(w.worker_id, (0, 0, 0))
    return device + host * _worth(w.host_hit_cost_pct) + disk * _worth(w.disk_hit_cost_pct)


class _PeerPrefixes:
    """For each prefill worker, the best peer to read the prompt's prefix from: the one whose
    device-then-host run is longest (a lender serves those: engine/kv_lending.py) among the blocks
    it published (``lent``: not a prompt only routed to it, which it may not have computed yet)."""

    def __init__(
        self, prefills: list[WorkerRecord], tiers: Mapping[str, Runs], lent: Mapping[str, Runs]
    ) -> None:
        self.tiers = tiers
        runs = sorted(((sum(lent.get(w.worker_id, (0, 0, 0))[:2]), w) for w in prefills), key=lambda x: -x[0])
        self.best = runs[:2]  # the longest two: a worker's best peer is the first that is not itself

    def saved(self, w: WorkerRecord) -> tuple[float, WorkerRecord | None, int]:
        """(blocks saved, the peer to read from or None, the peer's run) for ``w``: its own hits, or
        those plus the peer's blocks past them at ``w``'s peer-read cost, whichever saves more."""
        own = _saved_blocks(w, self.tiers)
        device, host, _disk = self.tiers.get(w.worker_id, (0, 0, 0))
        worth = _worth(w.peer_hit_cost_pct)
        for run, peer in self.best:
            if peer.worker_id == w.worker_id:
                continue
            with_peer = device + host * _worth(w.host_hit_cost_pct) + (run - device - host) * worth
            if worth > 0 and run > device + host and with_peer > own:
                return with_peer, peer, run
            break
        return own, None, 0


def _worth(cost_pct: int) -> float:
    return (100 - min(100, cost_pct)) / 100


def serves(w: WorkerRecord, lora: str) -> bool:
    """Whether worker ``w`` serves adapter ``lora`` ("": the base model, which every worker serves)."""
    return not lora or w.lora_salt(lora) is not None


def salt_of(w: WorkerRecord, lora: str) -> str:
    """The salt of ``w``'s prefix hashes for a request of adapter ``lora`` (as its engine hashes)."""
    return w.cache_salt + (w.lora_salt(lora) or "") if lora else w.cache_salt


def takes_hits(params) -> bool:
    """Whether the engine serves a request (``pb.SamplingParams``) from the prefix cache: not one
    that asks for ``prompt_logprobs`` (every prompt position is computed)."""
    return not params.HasField("prompt_logprobs")


def prefill_locally(
    prompt: list[int], d: WorkerRecord, lora: str, limit: int, index: PrefixIndex | None
) -> int | None:
    """The prompt tokens decode worker ``d`` has cached when it should prefill this prompt itself
    (the part it has not cached is at most ``limit`` tokens, so a prefill hop and a KV transfer
    would cost more than computing it there); None when it should not (``limit`` 0: never).
    ``index`` None: the request takes no prefix hits (``takes_hits``)."""
    if limit <= 0:
        return None
    if len(prompt) <= limit:
        return 0  # (not looked up: the whole prompt is short)
    if index is None or not d.prefix_caching:
        return None
    with index.lock:
        hit = index.match(iter_block_hashes(prompt, d.block_size, salt_of(d, lora)), [d.worker_id])
    cached = hit.get(d.worker_id, 0) * d.block_size
    return cached if len(prompt) - cached <= limit else None


def with_handoff(route: Route, lora: str) -> Route:
    """``route``, or aggregated on its decode worker where the prompt's KV cannot move there: a decode
    worker that takes no hand-offs (it computes its prompts itself), or one whose weights of the
    request's adapter differ from the prefill worker's (another version under the same name)."""
    if route.prefill is None or (
        route.decode.kv_handoff
        and (not lora or route.prefill.lora_salt(lora) == route.decode.lora_salt(lora))
    ):
        return route
    return Route(None, route.decode)  # (the prefill worker's predicted hits are not the decode worker's)


def make_policy(name: str) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"routing policy must be one of {POLICIES}, got {name!r}")
    return {"round_robin": RoundRobin, "least_load": LeastLoad, "cache_aware": CacheAware}[name]()


def _hit_tokens(inp: RoutingInput, index: PrefixIndex, w: WorkerRecord | None) -> int:
    if w is None or not w.prefix_caching:
        return 0
    with index.lock:
        tiers = _capped(inp, index.match_tiers(inp.hashes, [w.worker_id], inp.routed))
    return sum(tiers.get(w.worker_id, (0, 0, 0))) * inp.block_size
