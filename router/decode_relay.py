"""The router's Decode calls: a mixin of ``router.router.Router``.

A Decode call (one of the calls multiplexed on the worker's ``DecodeStream``: ``proto.call_stream``)
is *opened* (the worker's load and the abort registry count it from then on) and then
*relayed*. Usually both happen once the prefill worker returned the KV handle. With KV streaming
(``kv_streaming_tokens``), the call is opened before the prefill starts, naming the prefill worker as
its ``kv_source``: the decode worker reads the prompt's blocks while they are computed, and
``provide_kv`` hands it the complete handle when the prefill returns, so only the blocks of the last
step are left to move after the first token. A stream the decode worker never got going on (the
prefill failed or was retried elsewhere, the first token ended the request) is closed, which aborts
the request there and frees its blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass

import grpc

from proto import pdserve_pb2 as pb
from proto.call_stream import StreamedCall
from registry.cluster_view import ClusterView
from registry.schema import WorkerRecord
from router.affinity import RoutedPrefixes
from router.cancellation import Cancellation
from router.migration import MIGRATABLE, DecodeLost, ProgressWatch, continuation, replaced
from router.policies import PromptWork, Route, WorkerLoad
from router.worker_stubs import WorkerStubs

logger = logging.getLogger(__name__)

# The default KV streaming threshold (uncached prompt tokens). bench/kv_streaming.py: with 512-token
# prefill chunks, the hand-off after the first token fell 1.32x for 2k-token prompts and 1.59x for 8k,
# TTFT unchanged. A prompt computed in one step gains little (only the router hop of its handle), so
# the default starts at the engine's default step budget (2048 tokens), where prompts are chunked.
KV_STREAMING_TOKENS = 2048


@dataclass(eq=False, slots=True)
class OpenDecode:
    """A Decode call in flight on ``worker``; ``close`` cancels it (a no-op once it finished) and
    stops counting it."""

    worker: WorkerRecord
    call: StreamedCall
    _undo: Callable[[], None]
    closed: bool = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._undo()
            self.call.cancel()


class DecodeRelay:
    decisions: Counter[tuple[str, str]]
    inflight: dict[str, WorkerLoad]
    cancellation: Cancellation
    watch: ProgressWatch
    stats: object
    kv_streaming_tokens: int
    routed: RoutedPrefixes
    _background: set[asyncio.Future]

    stubs: WorkerStubs
    view: ClusterView

    def decode_candidates(self, lost=frozenset(), lora: str = "") -> list[WorkerRecord]: ...
    def suspect(self, worker_id: str) -> None: ...

    def _in_background(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def suspect_unreachable(self, w: WorkerRecord) -> None:
        """A worker found unreachable (it died; its record lives on until it expires) is kept out of
        routing for a while, as a stalled one is, unless its id has registered a newer incarnation
        since (the lost one is gone, not the replacement: ``DecodeLost.replaced_by``)."""
        if not replaced(w.epoch, self.view.workers.get(w.worker_id)):
            self.suspect(w.worker_id)

    def _streams_kv(self, num_uncached_tokens: int) -> bool:
        """Whether the KV of a prompt with this many uncached tokens streams to the decode worker
        while it is computed (worth a WatchKV stream and a ProvideKV call only for long prefills)."""
        return 0 < self.kv_streaming_tokens <= num_uncached_tokens

    def _open_early(self, route, rid, prompt, params, priority, deadline, key: str) -> OpenDecode | None:
        """The Decode of a request whose KV streams to its decode worker while it is prefilled, opened
        now (None when it does not stream). Until the prefill returns, an abort cancels the request's
        task (the prefill call with it) rather than asking the decode worker."""
        if route.prefill is None or (params.n or 1) != 1:
            return None
        if not self._streams_kv(len(prompt) - route.predicted_hit_tokens):
            return None
        self.cancellation.prefilling.add(key)
        w = route.decode
        return self._open_decode(w, rid, prompt, params, priority, None, deadline, key, route.prefill.address)

    def _close_early(self, early: OpenDecode | None, key: str, prefilled: bool = False) -> None:
        """``prefilled``: the prefill returned (an abort now goes to the decode worker); else the
        attempt is over (the call is cancelled, a no-op once relayed to its end)."""
        if early is not None:
            self.cancellation.prefilling.discard(key)
            if not prefilled:
                early.close()

    def _open_decode(
        self,
        w: WorkerRecord,
        rid,
        prompt,
        params,
        priority,
        handle,
        deadline,
        key: str,
        kv_source: str = "",
        peer: pb.PeerPrefix | None = None,
    ) -> OpenDecode:
        self.decisions[("decode", w.worker_id)] += 1
        load = self.inflight.setdefault(w.worker_id, WorkerLoad())
        load.requests += 1
        req = pb.DecodeRequest(
            request_id=rid, prompt_token_ids=prompt, params=params, priority=priority, kv_source=kv_source
        )
        if handle is not None:
            req.handle.CopyFrom(handle)
        if peer is not None:
            req.peer.CopyFrom(peer)
        call = self.stubs.decode_stream(w).open(req, timeout=_remaining(deadline))
        decoding = self.cancellation.decoding
        entry = decoding[key] = (w, rid)

        def undo() -> None:
            load.end()
            if decoding.get(key) is entry:
                del decoding[key]

        return OpenDecode(w, call, undo)

    def _peer_prefix(self, route: Route) -> pb.PeerPrefix | None:
        """The peer holding the prompt's prefix that the computing worker reads it from (counted as
        a peer read; worker/peer_reads.py), or None."""
        p = route.peer
        if p is None:
            return None
        self.stats.peer_reads += 1
        return pb.PeerPrefix(worker_id=p.worker_id, address=p.address, num_blocks=route.peer_blocks)

    async def _provide_kv(self, opened: OpenDecode, handle: pb.KVHandle, deadline) -> bool:
        """Hand a streaming Decode its complete KV handle; False when it did not take it."""
        try:
            resp = await self.stubs.decode(opened.worker.address).ProvideKV(
                pb.ProvideKVRequest(request_id=handle.request_id, handle=handle), timeout=_remaining(deadline)
            )
            return resp.accepted
        except grpc.aio.AioRpcError as exc:
            logger.info("ProvideKV to %s failed (%s)", opened.worker.worker_id, exc.code())
            return False

    async def _relay_decode(
        self,
        w: WorkerRecord,
        rid,
        prompt,
        params,
        priority,
        handle,
        deadline,
        lost,
        key: str,
        opened: OpenDecode | None = None,
        shifted: bool = False,
        peer: pb.PeerPrefix | None = None,
        work: PromptWork | None = None,
    ):
        """Relay Decode from ``w`` (``opened``: its call, already open); a decode worker that is
        unreachable before it sent anything (it died, its record not expired yet) is swapped for the
        least-loaded other one. A worker lost once it started raises ``DecodeLost`` (the request is
        resumed: ``router.migration``). ``shifted``: the prompt ends with the first token already.

        NOTE: a swap never reuses the KV handle. The first worker may have pulled the KV before it
        died, and a pull tells the prefill worker to free (and reuse) those blocks, so a second pull
        could read another request's KV. The new worker computes the prompt plus the first token
        itself (seeded samples depend on positions only, so the output is the same), and the held
        KV is released. ``key``: the caller's request id (what an abort names), ``rid`` the workers'.
        ``peer`` (aggregated): the decode worker ``w`` reads the prompt's prefix from (not after a swap);
        ``work``: the prompt's work counted on ``w``, done at its first token or the relay's end."""
        tried: set[str] = set(lost)  # ``shifted``: usage counts the prompt's last token as generated
        samples = params.n or 1
        try:
            while True:
                started, ended = False, 0
                call = opened or self._open_decode(
                    w, rid, prompt, params, priority, handle, deadline, key, peer=peer
                )
                opened, peer = None, None
                try:
                    async with aclosing(self._decode(call)) as stream:
                        async for msg in stream:
                            started = True
                            kind = msg.WhichOneof("kind")
                            if kind == "tokens":
                                if work is not None:
                                    work.done(True)  # its prompt is computed: no longer queued there
                                if handle is not None and msg.tokens.HasField("cached_tokens"):
                                    msg.tokens.cached_tokens = handle.num_cached_tokens  # as below
                            elif kind == "finished":
                                ended += 1
                                if handle is None and not shifted and ended == 1:  # it computed the prompt
                                    self.stats.delivered_hit_tokens += msg.finished.usage.cached_tokens
                                if handle is not None:  # the prompt's hits are where it was computed:
                                    # the prefill worker's (the decode worker's own spared reads only)
                                    msg.finished.usage.cached_tokens = handle.num_cached_tokens
                                if shifted and msg.finished.usage.prompt_tokens:
                                    msg.finished.usage.prompt_tokens -= 1
                                    msg.finished.usage.completion_tokens += 1
                            elif kind == "error":
                                if msg.error.code == "unavailable":  # it cannot go on: resume elsewhere
                                    raise DecodeLost(
                                        w.worker_id, msg.error.message, cause="unavailable", epoch=w.epoch
                                    )
                                ended = samples  # a refusal or failure of this request: passed on as is
                            yield msg
                    if ended < samples:
                        raise DecodeLost(
                            w.worker_id,
                            "its stream ended before the request did",
                            suspect=False,
                            epoch=w.epoch,
                        )
                    return
                except grpc.aio.AioRpcError as exc:
                    code = exc.code()
                    if _expired(deadline) or code not in MIGRATABLE:
                        raise
                    if started or code != grpc.StatusCode.UNAVAILABLE:
                        raise DecodeLost(
                            w.worker_id, f"{code.name}: {exc.details()}", cause=_cause(code), epoch=w.epoch
                        ) from exc
                    tried.add(w.worker_id)
                    self.suspect_unreachable(w)  # or it stays the idlest choice of every request
                    others = self.decode_candidates(tried, params.lora)
                    if not others:
                        raise DecodeLost(
                            w.worker_id, f"{code.name}: {exc.details()}", cause=_cause(code), epoch=w.epoch
                        ) from exc
                    logger.warning("decode worker %s unavailable; %s goes to another", w.worker_id, rid)
                    self.stats.decode_retries += 1
                    w = min(others, key=lambda d: _ours(self.inflight.get(d.worker_id)))
                    if handle is not None:
                        self._in_background(self._release_at(handle.address, handle.request_id, handle.epoch))
                        prompt, params = continuation(prompt, params, handle)
                        handle, shifted = None, True
        finally:
            if work is not None:
                work.done(False)

    def _computing(self, route: Route, hashes, prompt) -> tuple[pb.PeerPrefix | None, PromptWork | None]:
        """For a Decode whose worker computes the prompt (aggregated, or after the prefill failed):
        the peer a route made aggregated names to read the prefix from, and the prompt's work
        counted on that worker until its first token (none on a sole worker: it weighs in no
        choice)."""
        peer = self._peer_prefix(route) if route.prefill is None else None  # (else a prefill peer)
        if route.sole:
            return peer, None
        d, hit = route.decode, route.predicted_hit_tokens if route.prefill is None else 0
        self.stats.predicted_hit_tokens += hit
        return peer, PromptWork(self.inflight, self.routed, d, len(prompt) - hit, hashes.all(), False)

    async def _decode(self, opened: OpenDecode):
        try:
            async for msg in self.watch.watch(
                opened.call, opened.worker.worker_id, opened.worker.epoch
            ):  # on a stall: DecodeLost
                yield msg
        finally:
            opened.close()  # no-op when finished; aborts the request on the worker otherwise

    def _release_late(self, resp: pb.PrefillResponse) -> None:
        """A Prefill answer that crossed its call's cancel (the caller left, or it expired or stalled
        while the answer was on its way): nobody will read the KV it holds, so it is released now
        rather than left to its lease (``router.worker_stubs``)."""
        h = resp.handle
        if h.request_id and h.address:
            logger.info("%s: its prefill answered after the call was left; releasing its KV", h.request_id)
            self._in_background(self._release_at(h.address, h.request_id, h.epoch))

    async def _release_at(self, address: str, rid: str, epoch: int) -> None:
        try:
            await self.stubs.prefill(address).Release(
                pb.ReleaseRequest(request_id=rid, epoch=epoch), timeout=5
            )
        except grpc.aio.AioRpcError as exc:
            logger.info("release of %s on %s failed (%s): its lease will free it", rid, address, exc.code())


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.001, deadline - time.monotonic())


def _expired(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


def _cause(code: grpc.StatusCode) -> str:
    """A lost call's cause as its caller may read it: the status, not its details (which name the
    worker's address: ``call stream to 10.1.2.3:50051: cannot connect``)."""
    return code.name.lower().replace("_", " ")


def _ours(load: WorkerLoad | None) -> int:
    """Our requests on a decode worker: those it runs and those held for it while prefilled."""
    return load.requests + load.held if load else 0
