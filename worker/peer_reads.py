"""Prefix blocks shared between workers of one role through their host tiers: the worker's side.

A request the router sends with a ``PeerPrefix`` (a prefill worker's Prefill, a decode worker's
aggregated Decode) first asks that peer to ``Lend`` the prompt's leading blocks (gRPC, to a worker of
the same role), then has its engine read them into its host tier (``worker.peer_tiers``) and only
then adds the request, whose prefix hit now runs into the host tier. The engine's side runs on the
engine thread, or in the engine process (the ``lend`` and ``fetch`` commands; ``EngineEvents.fetched``
says a read is over). Whatever goes wrong leaves the blocks to compute: a peer that cannot be asked
lends nothing, a failed read publishes nothing, and the request is added all the same.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from proto import pdserve_pb2 as pb
from worker.peer_tiers import PeerLends, PeerTiers, engine_tiers, lent_to_proto, offer_from_proto

MAX_LEASE_ID = 64


class PeerReads:
    """Mixin of a ``WorkerRuntime`` role. ``peer_stub``: the gRPC stub of the role's peers."""

    peer_stub = None

    def _start_peer_reads(self, lease_s: float, timeout_s: float) -> None:
        self.peer_lends = PeerLends(timeout_s, self.peer_stub)
        self.tiers: PeerTiers | None = None  # engine thread only
        self._fetching: dict[str, asyncio.Future] = {}  # engine process: requests reading a peer's blocks
        # requests asking a peer or reading its blocks (what a drain waits for)
        self.reading: set[str] = set()
        if self.engine is not None:
            self.engine.add_role_hook(self._on_fetched)
            self.engine.on_failure(self._end_fetches)
            return
        agent = f"{self.worker_id}-{self.epoch}"
        self.tiers = engine_tiers(self.core, self.transfer, agent, self.compat, lease_s, timeout_s)
        if self.tiers is not None:
            self.loop.add_tick(self.tiers.tick)

    @property
    def reads_peers(self) -> bool:
        """Whether a ``PeerPrefix`` is worth a Lend call (an engine process without a host tier ends
        its read at once)."""
        return self.engine is not None or self.tiers is not None

    async def read_peer_prefix(
        self, request_id: str, prompt: list[int], peer: pb.PeerPrefix, lora: str | None = None
    ) -> None:
        """Ask ``peer`` to lend the prompt's first blocks and read them into this host tier; returns
        once the read is over, landed or not (a peer that cannot be asked lends nothing). ``lora``:
        the request's adapter, whose blocks are hashed in its namespace (one not served here reads
        nothing: the request is refused when added)."""
        lora_salt = self.loras.get(lora) if lora else ""
        if not self.reads_peers or peer.num_blocks == 0 or lora_salt is None:
            return
        self.reading.add(request_id)
        try:
            await self._read_peer_prefix(request_id, prompt, peer, lora_salt)
        finally:
            self.reading.discard(request_id)

    async def _read_peer_prefix(
        self, request_id: str, prompt: list[int], peer: pb.PeerPrefix, lora_salt: str
    ) -> None:
        t0 = time.monotonic()
        asked = await self.peer_lends.ask(peer, prompt, lora_salt)
        if asked is None:
            return
        lent, lease_id = asked
        asked_s = time.monotonic() - t0
        landed = asyncio.get_running_loop().create_future()
        if self.engine is not None:
            self._fetching[request_id] = landed
            try:
                fetch = pb.EngineFetch(
                    request_id=request_id,
                    prompt_token_ids=prompt,
                    lent=lent,
                    lease_id=lease_id,
                    asked_s=asked_s,
                    lora_salt=lora_salt,
                )
                await self.engine.send(pb.EngineCommand(fetch=fetch))
                await landed
            finally:
                self._fetching.pop(request_id, None)
            return

        def done(_published: int) -> None:
            landed.get_loop().call_soon_threadsafe(lambda: landed.done() or landed.set_result(None))

        offer = offer_from_proto(lent, lease_id)
        await self.loop.run(lambda: self.tiers.fetch(request_id, prompt, offer, done, asked_s, lora_salt))
        await landed

    async def lend(
        self, lease_id: str, prompt: list[int], max_blocks: int, lora_salt: str = ""
    ) -> pb.LendResponse:
        """Pin the prompt's leading blocks held here (at most ``max_blocks``) for a peer's read;
        ``ValueError`` when the lease's name is taken. ``lora_salt``: the prompt's adapter's cache
        namespace, as the reader's engine hashes it."""
        if not self.reads_peers:
            return pb.LendResponse()
        if self.engine is not None:
            req = pb.LendRequest(
                lease_id=lease_id, prompt_token_ids=prompt, max_blocks=max_blocks, lora_salt=lora_salt
            )
            return (await self.engine.send(pb.EngineCommand(lend=req))).lent
        if self.tiers is None:
            return pb.LendResponse()
        slots, checksums = await self.loop.run(
            lambda: self.tiers.lend(lease_id, prompt, max_blocks, lora_salt)
        )
        return lent_to_proto(self.tiers, slots, checksums)

    def _drop_peer_read(self, request_id: str) -> None:
        """Engine thread: the request left while reading a peer's blocks."""
        if self.tiers is not None:
            self.tiers.abort(request_id)

    def _on_fetched(self, events: pb.EngineEvents) -> None:
        for request_id in events.fetched:
            landed = self._fetching.get(request_id)
            if landed is not None and not landed.done():
                landed.set_result(None)

    def _end_fetches(self, _failure=None) -> None:
        """The engine failed: every read is over (the add after it fails with the engine's reason)."""
        for landed in self._fetching.values():
            if not landed.done():
                landed.set_result(None)

    async def _close_peer_reads(self) -> None:
        await self.peer_lends.close()

    def _stop_peer_reads(self) -> None:
        """After the engine thread stopped: drop the reads in flight and every lease."""
        if self.tiers is not None:
            self.tiers.close()
            self.tiers.transfer.close()


async def lend_rpc(worker, request: pb.LendRequest, context) -> pb.LendResponse:
    """The Lend call of either role's service: refused at the edge when malformed."""
    if not 0 < len(request.lease_id) <= MAX_LEASE_ID:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"lease_id must be 1-{MAX_LEASE_ID} characters")
    if len(request.prompt_token_ids) > worker.limits.max_model_len:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the prompt is longer than the model's context")
    if worker.loop.failure is not None:
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"{worker.worker_id}: {worker.loop.failure}")
    try:
        return await worker.lend(
            request.lease_id, list(request.prompt_token_ids), request.max_blocks, request.lora_salt
        )
    except ValueError as exc:  # the lease's name is taken
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
