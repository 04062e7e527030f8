"""Request orchestration: route, Prefill, stream the first token, Decode with the KV handle, relay.

A request's life: validated -> block-hashed with the engines' hash (no torch here) -> a (P, D) pair
chosen by the policy from the in-process index -> ``Prefill`` on P (its first token is streamed to
the caller at once: TTFT does not wait for the KV transfer) -> ``Decode`` on D with the handle,
whose stream is relayed. If P fails, another prefill worker is tried, then the request runs
aggregated on D; it is never silently lost, and the caller's deadline bounds every call.
Cancellation propagates: a cancelled caller cancels the worker calls (the decode worker aborts and
frees its blocks) and, if the KV was never pulled, the router releases it on P. A decode worker lost
mid-stream (dead, stalled, failed, drained) is resumed on another one (``router.migration``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc

from engine.sampling_params import SamplingParams
from proto import pdserve_pb2 as pb
from proto.convert import params_to_proto
from registry.cluster_view import ClusterView
from registry.schema import WorkerRecord
from router.affinity import PromptHashes, RoutedPrefixes
from router.cancellation import Cancellation
from router.decode_relay import DecodeRelay, _expired, _remaining
from router.hop_timing import HopWindow, RouterClock
from router.migration import (
    DecodeLost,
    MigrationOptions,
    MigrationRefused,
    ProgressWatch,
    Resumption,
    continuation,
)
from router.policies import (
    DRAINING_MESSAGE,
    AdapterNotServed,
    DecodeHold,
    NoWorkersError,
    Policy,
    PromptWork,
    Route,
    RoutingInput,
    WorkerLoad,
    make_policy,
    prefill_locally,
    salt_of,
    serves,
    takes_hits,
    with_handoff,
)
from router.prefill_watch import PrefillStalled, watched
from router.stats import RouterStats
from router.worker_stubs import WorkerStubs

logger = logging.getLogger(__name__)

_RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


class Router(DecodeRelay):
    def __init__(
        self,
        view: ClusterView,
        policy: str = "cache_aware",
        prefill_attempts: int = 2,
        local_prefill_tokens: int = 0,
        migration: MigrationOptions | None = None,
        kv_streaming_tokens: int = 0,
        peer_reads: bool = True,
    ) -> None:
        if local_prefill_tokens < 0:
            raise ValueError(f"local_prefill_tokens must be >= 0, got {local_prefill_tokens}")
        if kv_streaming_tokens < 0:
            raise ValueError(f"kv_streaming_tokens must be >= 0, got {kv_streaming_tokens}")
        self.view = view
        self.policy: Policy = make_policy(policy)
        self.policy.peer_reads = peer_reads  # prefill workers may read prefixes from each other
        self.prefill_attempts = prefill_attempts
        # Conditional disaggregation: a prompt whose part the decode worker has not cached is at most
        # this many tokens is prefilled there (no prefill hop, no KV transfer); 0 always disaggregates.
        self.local_prefill_tokens = local_prefill_tokens
        # KV streaming: a prompt with at least this many uncached tokens has its KV read by the decode
        # worker while it is computed (``router.decode_relay``); 0 moves it after the prefill.
        self.kv_streaming_tokens = kv_streaming_tokens
        self.migration = migration or MigrationOptions()
        self.watch = ProgressWatch(self.migration)
        self.suspects: dict[str, float] = {}  # decode worker -> time.monotonic() until which it is avoided
        self.inflight: dict[str, WorkerLoad] = {}
        self.routed = RoutedPrefixes()  # prefixes sent to workers, until the index shows them
        self.decisions: Counter[tuple[str, str]] = Counter()  # (role, worker) -> routed requests
        self.stats = RouterStats()
        self.hops = HopWindow()  # hop timings of the last finished requests (pdserve status)
        self.active = 0  # Generate streams in progress (shutdown waits for them)
        self.stubs = WorkerStubs(self._release_late)  # a late Prefill answer's KV: released
        self._background: set[asyncio.Future] = set()
        self.cancellation = Cancellation(self.stubs.decode)  # what ``abort`` acts on

    async def close(self) -> None:
        await self.stubs.close()

    # Routing ----------------------------------------------------------------------------------

    def route(self, prompt: list[int], exclude: frozenset[str] = frozenset()) -> Route:
        return self._route(prompt, exclude)[0]

    def _route(
        self,
        prompt: list[int],
        exclude: frozenset[str] = frozenset(),
        lost: frozenset[str] = frozenset(),
        lora="",
        hits: bool = True,
    ) -> tuple[Route, PromptHashes]:
        """The policy's route and the prompt's block hashes (what the chosen worker will cache);
        ``exclude``: prefill workers that failed this request, ``lost``: decode workers that did;
        ``lora``: its adapter (only workers serving it are candidates; hashes namespaced by it);
        ``hits`` False: the engine takes no prefix hits for it (``prompt_logprobs``), none predicted."""
        out = exclude | self.suspects.keys()
        prefills = [w for w in self.view.live_workers("prefill") if w.worker_id not in out]
        prefills = [w for w in prefills if serves(w, lora)]
        decodes = self.decode_candidates(lost, lora)
        if not decodes:
            serving = f" that serves the adapter {lora!r}" if lora else ""
            unknown = bool(lora) and not lost and bool(self.decode_candidates())  # others serve the base
            raise (AdapterNotServed if unknown else NoWorkersError)(
                f"no decode worker{serving} is registered" + (" besides the lost ones" if lost else "")
            )
        ref = (prefills or decodes)[0]
        hashes = PromptHashes(prompt, ref.block_size, salt_of(ref, lora))
        if not prefills and len(decodes) == 1:  # nothing to choose: no lookup, no hashing, no record
            return Route(None, ref, sole=True), hashes
        holders = self.routed.holders()
        looked_up = iter(hashes) if hits else iter(())
        inp = RoutingInput(
            looked_up, len(prompt), ref.block_size, prefills, decodes, self.inflight, holders, lora
        )
        return with_handoff(self.policy.choose(inp, self.view.index), lora), hashes

    def decode_candidates(
        self, lost: frozenset[str] | set[str] = frozenset(), lora: str = ""
    ) -> list[WorkerRecord]:
        """Live decode workers not lost by the request that serve its adapter, suspects left out
        while others remain."""
        live = [w for w in self.view.live_workers("decode") if w.worker_id not in lost and serves(w, lora)]
        if self.suspects:
            now = time.monotonic()
            for wid in [w for w, until in self.suspects.items() if until <= now]:
                del self.suspects[wid]
            trusted = [w for w in live if w.worker_id not in self.suspects]
            return trusted or live
        return live

    def suspect(self, worker_id: str) -> None:
        self.suspects[worker_id] = time.monotonic() + self.migration.suspect_s

    # Orchestration ----------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        deadline: float | None = None,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Yields the caller's stream: the first token as soon as prefill has it, then the rest; an
        ``abort`` ends it with finish reason ``abort`` (``router.cancellation``)."""
        self.active += 1
        try:
            messages = self._generate(request_id, prompt, params, priority, deadline)
            async with aclosing(self.cancellation.stream(request_id, messages, params.n)) as stream:
                async for msg in stream:
                    yield msg
        finally:
            self.active -= 1

    async def _generate(
        self, request_id, prompt, params, priority, deadline
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Attempt after attempt until the request ends: a decode worker lost mid-stream is replaced
        and the request resumed from what was already relayed (``router.migration``)."""
        if self.view.draining:
            raise NoWorkersError(DRAINING_MESSAGE)
        self.stats.requests += 1
        self.stats.prompt_tokens += len(prompt)
        clock = RouterClock(self.hops)
        res = Resumption(prompt, params_to_proto(params), params.n)
        lost: set[str] = set()
        while True:
            try:
                async with aclosing(
                    self._attempt(request_id, res, priority, deadline, clock, frozenset(lost))
                ) as s:
                    async for msg in s:
                        yield res.relay(msg)
                return
            except DecodeLost as exc:
                if exc.reason.startswith("stalled"):
                    self.stats.stalls += 1
                if not exc.replaced_by(self.view.workers.get(exc.worker_id)):
                    if exc.suspect:
                        self.suspect(exc.worker_id)
                    lost.add(exc.worker_id)
                end = res.ended_by_itself()
                if end is not None:  # only its last message was lost
                    yield res.relay(end)
                    return
                try:
                    candidates = self.decode_candidates(lost, res.params.lora)
                    res.resume(exc, self.migration, len(candidates), deadline)
                except MigrationRefused as refused:
                    self.stats.migrations_refused += 1
                    logger.warning("%s: %s; not resumed: %s", request_id, exc, refused)  # the whole reason
                    raise
                self.stats.migrations += 1
                logger.warning(
                    "%s: %s; resuming after %d tokens elsewhere (move %d)",
                    request_id,
                    exc,
                    res.offset,
                    res.migrations,
                )

    async def _attempt(
        self, request_id, res: Resumption, priority, deadline, clock: RouterClock, lost: frozenset[str]
    ) -> AsyncIterator[pb.GenerateResponse]:
        """One route -> prefill -> decode pass over the request as ``res`` has it now. Workers know a
        resumed request under an id of its own: the last attempt's may still be held somewhere (KV a
        prefill worker keeps until its release lands, a stalled worker that wakes up)."""
        prompt, proto_params = res.request()
        key, request_id = request_id, res.attempt_id(request_id)
        hits, n = takes_hits(proto_params), proto_params.n or 1
        route, hashes = self._route(prompt, lost=lost, lora=proto_params.lora, hits=hits)
        lora, idx = proto_params.lora, self.view.index if hits else None
        local = None
        if route.prefill is not None and n == 1:
            local = prefill_locally(prompt, route.decode, lora, self.local_prefill_tokens, idx)
        if local is not None:  # the decode worker computes the rest: ``local`` tokens are cached there
            self.stats.local_prefills += 1
            route = Route(None, route.decode, local)
        clock.routed()
        # A Decode opened before the prefill, the KV streaming to it while computed (or None).
        hold = DecodeHold(self.inflight, route.decode.worker_id)
        early = self._open_early(route, request_id, prompt, proto_params, priority, deadline, key)
        if early is not None:  # open: it counts itself
            hold.release()
        args = (request_id, key, res, route, hashes, prompt, proto_params, priority, deadline, clock, lost)
        try:
            async with aclosing(self._prefill_then_decode(*args, early, hold)) as stream:
                async for msg in stream:
                    yield msg
        finally:
            hold.release()
            self._close_early(early, key)

    async def _prefill_then_decode(
        self,
        request_id,
        key,
        res,
        route,
        hashes,
        prompt,
        proto_params,
        priority,
        deadline,
        clock,
        lost,
        early,
        hold: DecodeHold,
    ) -> AsyncIterator[pb.GenerateResponse]:
        n = proto_params.n or 1
        exclude: set[str] = set()
        resp = None
        if route.prefill is not None and n == 1:
            for attempt in range(self.prefill_attempts):
                try:
                    resp = await self._prefill(
                        route, request_id, prompt, hashes, proto_params, priority, deadline
                    )
                    self.stats.predicted_hit_tokens += route.predicted_hit_tokens
                    self.stats.delivered_hit_tokens += resp.handle.num_cached_tokens
                    clock.prefilled(resp)
                    break
                except (grpc.aio.AioRpcError, PrefillStalled) as exc:
                    stalled = isinstance(exc, PrefillStalled)
                    if (not stalled and exc.code() not in _RETRYABLE) or _expired(deadline):
                        raise
                    if stalled:  # its KV, if it answers still, is released (``_release_late``)
                        self.stats.stalls += 1
                        self.suspect(exc.worker_id)
                    elif exc.code() == grpc.StatusCode.UNAVAILABLE:  # dead, its record not expired yet
                        self.suspect_unreachable(route.prefill)
                    logger.warning(
                        "prefill on %s failed (%s); retrying elsewhere", route.prefill.worker_id, exc
                    )
                    self.stats.prefill_retries += attempt == 0
                    if early is not None:
                        early.close()  # its KV source is gone: a retry decodes from a whole handle
                    exclude.add(route.prefill.worker_id)
                    hits = takes_hits(proto_params)
                    route, hashes = self._route(prompt, frozenset(exclude), lost, proto_params.lora, hits)
                    hold.move(route.decode.worker_id)  # (an early Decode was closed above)
                    if route.prefill is None:
                        break
        self._close_early(early, key, prefilled=True)
        # A closed early call's request may still be settling on its worker: the next has its own id.
        decode_id = f"{request_id}~s" if early is not None and early.closed else request_id
        if resp is None:
            self.stats.aggregated_fallbacks += route.prefill is not None or (n == 1 and bool(exclude))
            clock.decoding()
            hold.release()
            peer, work = self._computing(route, hashes, prompt)
            args = (route.decode, decode_id, prompt, proto_params, priority, None, deadline, lost, key)
            async for msg in self._relay_decode(*args, work=work, peer=peer):
                clock.on_message(msg)
                yield msg
            return
        clock.first_token()
        if res.seed is None:  # the seed the prefill worker drew: a resumed request keeps it
            res.seed = resp.handle.seed
        provided = None  # the complete handle goes to the streaming Decode while the first token is out
        if early is not None and not early.closed and not resp.HasField("finished"):
            provided = asyncio.ensure_future(self._provide_kv(early, resp.handle, deadline))
        pulled = False
        args = (
            resp,
            route,
            decode_id,
            prompt,
            proto_params,
            priority,
            deadline,
            lost,
            key,
            clock,
            early,
            provided,
            hold,
        )
        try:
            async with aclosing(self._first_then_decode(*args)) as stream:
                async for msg, took_over in stream:
                    pulled = took_over
                    yield msg
        finally:
            if not pulled:  # the decode side never got going: do not leave the KV to its lease
                self._in_background(self._release_at(route.prefill.address, request_id, resp.handle.epoch))

    async def _first_then_decode(
        self,
        resp,
        route,
        decode_id,
        prompt,
        params,
        priority,
        deadline,
        lost,
        key,
        clock,
        early,
        provided,
        hold,
    ) -> AsyncIterator[tuple[pb.GenerateResponse, bool]]:
        """The first token, then the decode stream; each message with whether the decode side took
        over the held KV (else the caller releases it)."""
        handle, shifted = resp.handle, False
        first = pb.TokenChunk(token_ids=[handle.first_token], logprobs=[handle.first_logprobs])
        first.prompt_logprobs.extend(resp.prompt_logprobs)
        first.cached_tokens = handle.num_cached_tokens
        yield pb.GenerateResponse(tokens=first), False
        info = pb.RouteInfo(
            prefill_worker=route.prefill.worker_id,
            decode_worker=route.decode.worker_id,
            predicted_hit_tokens=route.predicted_hit_tokens,
            delivered_hit_tokens=handle.num_cached_tokens,
            peer_worker=route.peer.worker_id if route.peer is not None else "",
        )
        yield pb.GenerateResponse(route=info), False
        if resp.HasField("finished"):
            clock.stamp(resp.finished.timing)
            yield pb.GenerateResponse(finished=resp.finished), False
            return
        opened = None
        if provided is not None:
            if await provided:
                opened = early
                self.stats.kv_streamed += 1
            else:
                # NOTE: it did not take the handle, yet it may have got it (an RPC error on the way
                # back) and told the prefill worker to free the prompt on closing: the handle is not
                # read again. The decode worker computes the prompt and first token instead.
                early.close()
                self._in_background(self._release_at(handle.address, handle.request_id, handle.epoch))
                prompt, params = continuation(prompt, params, handle)
                handle, shifted, decode_id = None, True, f"{decode_id}~s"
        clock.decoding()
        hold.release()
        async for msg in self._relay_decode(
            route.decode, decode_id, prompt, params, priority, handle, deadline, lost, key, opened, shifted
        ):
            clock.on_message(msg)
            yield msg, True

    async def _prefill(
        self, route: Route, rid, prompt, hashes, params, priority, deadline
    ) -> pb.PrefillResponse:
        w = route.prefill
        self.decisions[("prefill", w.worker_id)] += 1
        # The work this puts in front of later requests: the tokens the worker must still compute.
        work = PromptWork(
            self.inflight,
            self.routed,
            w,
            len(prompt) - route.predicted_hit_tokens,
            hashes.all(),
            True,
        )
        computed = False
        req = pb.PrefillRequest(request_id=rid, prompt_token_ids=prompt, params=params, priority=priority)
        peer = self._peer_prefix(route)
        if peer is not None:
            req.peer.CopyFrom(peer)
        try:
            call = self.stubs.prefill_stream(w).open(req, timeout=_remaining(deadline))
            resp = await watched(call, w, self.view.silent_for, self.migration, step_s_of=self.view.step_s_of)
            computed = True
            return resp
        finally:
            work.done(computed)

    async def abort(self, request_id: str) -> bool:
        """Abort a request wherever it is (its stream ends with ``abort``: ``router.cancellation``)."""
        return await self.cancellation.abort(request_id, self.view.live_workers("decode"))
