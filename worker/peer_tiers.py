"""A worker's reads of prefix blocks from a peer's host tier over NIXL, both ends (issue 33).

When the router's index shows a prompt's first blocks on another worker of the same role (its device
or host tier) and computing them here would cost more than reading them, the request comes with a
``PeerPrefix``: a prefill worker's Prefill, or an aggregated Decode on a decode worker (one that
computes the prompt itself). The worker's process asks the peer to ``Lend`` them (gRPC): the peer's engine pins the
blocks in its host tier under a lease (``engine.kv_lending``) and answers with their host slots, a CRC
of each and its host-tier agent. This engine then reads those slots into reserved slots of its own
host tier (one NIXL READ; the notification ends the peer's lease), publishes the blocks whose CRC
matches, and only then admits the request, whose prefix hit now continues into its host tier: the
blocks load to the device as any host hit. Whatever goes wrong (the peer gone, blocks evicted before
the lend, a read that fails or times out, a CRC that differs) leaves blocks to compute, never a wrong
one: the output is the same either way.

Each engine with a host tier registers the tier's memory with an agent of its own (``<agent>-tier``),
beside the agent over its device KV that decode workers read: a peer reads host memory to host memory.
Everything here runs where the engine's KV lives (the engine thread, or the engine process's loop:
``EngineTierPeers``), polled each iteration like the held prompts' notifications; the worker process's
side (the Lend call, the fetch command) is ``worker.peer_reads``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch

from engine.block_hash import hash_blocks
from engine.kv_lending import TierLending
from kv_transfer import InProcessBackend, KVCompat, KVTransferBackend, TransferHandle, TransferState
from kv_transfer.base import RemoteKVInfo
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from worker.state import transfer_info_from_proto, transfer_info_to_proto

logger = logging.getLogger(__name__)

READ_COST_WEIGHT = 0.25  # the last read's weight in the measured cost per block (a moving average)


@dataclass(frozen=True, slots=True)
class LendOffer:
    """A peer's answer to Lend: its host-tier agent, the slots of the prompt's blocks 0.., their CRCs."""

    peer: RemoteKVInfo | None
    slots: list[int]
    checksums: list[int]
    lease_id: str
    lease_s: float = 0.0  # how long the owner keeps them pinned (a read must end well before)


@dataclass(eq=False, slots=True)
class _Fetch:
    request_id: str
    hashes: list[bytes]
    taken: list[tuple[int, int]]  # (block index, reserved local slot)
    checksums: list[int]
    handle: TransferHandle
    done: Callable[[int], None]
    started: float


class PeerTiers:
    """Lends this engine's host-tier blocks to peers and reads peers' blocks into it."""

    def __init__(self, core, transfer: KVTransferBackend, lease_s: float, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"the peer read timeout must be positive, got {timeout_s}")
        self.core = core
        self.kv = core.kv
        self.lending = TierLending(core.kv, lease_s)
        self.transfer = transfer
        self.timeout_s = timeout_s
        self._fetches: dict[str, _Fetch] = {}
        self._unsettled: list[_Fetch] = []  # failed reads that may still write their slots
        self.failed_reads = 0
        self.fetch_s_per_block: float | None = None  # measured on landed reads (recent ones weigh most)
        self.kv.host_blocks.peer_reads = True  # the router may send it prompts to read from peers

    def info(self) -> RemoteKVInfo:
        return self.transfer.local_info()

    def _hashes(self, prompt: list[int], max_blocks: int, lora_salt: str = "") -> list[bytes]:
        # At most the blocks before the prompt's last token: that one is always computed. An
        # adapter's prompt is hashed in its namespace, as the engine hashes it (``Request``).
        n = min(max_blocks, max(0, (len(prompt) - 1) // self.kv.block_size))
        return hash_blocks(prompt[: n * self.kv.block_size], self.kv.block_size, self.kv.salt + lora_salt)

    # Owner ----------------------------------------------------------------------------------------

    def lend(
        self, lease_id: str, prompt: list[int], max_blocks: int, lora_salt: str = ""
    ) -> tuple[list[int], list[int]]:
        """Pin the prompt's leading held blocks (at most ``max_blocks``) for a peer's read;
        ``lora_salt``: the namespace of the prompt's adapter (the reader's, so the same content)."""
        lent = self.lending.lend(lease_id, self._hashes(prompt, max_blocks, lora_salt))
        return lent.slots, lent.checksums

    # Reader ---------------------------------------------------------------------------------------

    def fetch(
        self,
        request_id: str,
        prompt: list[int],
        offer: LendOffer,
        done: Callable[[int], None],
        asked_s: float = 0.0,
        lora_salt: str = "",
    ) -> None:
        """Read ``offer``'s blocks into this host tier; ``done(blocks published)`` is called once the
        read is over (at once when there is nothing to read), before the request may be admitted.
        ``asked_s``: how long the Lend call took, counted in the read's measured cost (the router
        weighs a read by all it costs the request, not by the transfer alone)."""
        if request_id in self._fetches:
            raise ValueError(f"request {request_id} is already reading a peer's blocks")
        hashes = self._hashes(prompt, len(offer.slots), lora_salt)
        whole = offer.peer is not None and len(offer.checksums) == len(offer.slots)  # else: read nothing
        taken = self.lending.reserve(hashes) if whole else []
        if not taken:
            self._end_lease(offer)
            done(0)
            return
        # The slots may have copies still queued on the device's stream (an offload into one just
        # evicted, a load out of it): they land before the peer's bytes do, not on top of them.
        self.kv.host_blocks.settle()
        try:
            self.transfer.add_peer(offer.peer)
            handle = self.transfer.start_read(
                offer.peer.agent_name,
                [offer.slots[i] for i, _ in taken],
                [slot for _, slot in taken],
                notify=offer.lease_id.encode(),
                # Over well before the owner's lease: no slot it reads can have been reused.
                timeout_s=min(self.timeout_s, offer.lease_s / 2) if offer.lease_s > 0 else self.timeout_s,
            )
        except Exception as exc:  # an incompatible or unreachable peer: compute the blocks instead
            logger.warning(
                "reading %s's prefix blocks for %s failed: %s", offer.peer.agent_name, request_id, exc
            )
            self.lending.abandon(taken)
            self.failed_reads += 1
            done(0)
            return
        self._fetches[request_id] = _Fetch(
            request_id, hashes, taken, list(offer.checksums), handle, done, time.monotonic() - asked_s
        )

    def _end_lease(self, offer: LendOffer) -> None:
        """Nothing will be read: tell the owner now rather than let its lease pin the slots."""
        if offer.peer is None or not offer.slots:
            return
        try:
            self.transfer.add_peer(offer.peer)
            self.transfer.send_notification(offer.peer.agent_name, offer.lease_id.encode())
        except Exception as exc:  # best effort: the lease runs out on its own
            logger.warning("could not end lease %s at %s: %s", offer.lease_id, offer.peer.agent_name, exc)

    def abort(self, request_id: str) -> bool:
        """The request left while reading: its read is dropped (its slots freed once settled)."""
        fetch = self._fetches.pop(request_id, None)
        if fetch is None:
            return False
        self._settle_later(fetch)
        return True

    def pending(self) -> int:
        return len(self._fetches)

    # Both -----------------------------------------------------------------------------------------

    def tick(self) -> None:
        """Every iteration: end the leases whose reader is done (its notification) or late; finish
        the reads that are over."""
        for _agent, msg in self.transfer.get_notifications():
            self.lending.end(msg.decode(errors="replace"))
        self.lending.expire()
        for rid, fetch in list(self._fetches.items()):
            state = self.transfer.poll(fetch.handle)
            if state is TransferState.IN_PROGRESS:
                continue
            del self._fetches[rid]
            if state is TransferState.DONE:
                self.transfer.release(fetch.handle)
                published = self.lending.receive(fetch.hashes, fetch.taken, fetch.checksums)
                self._record(len(fetch.taken), time.monotonic() - fetch.started)
                fetch.done(published)
            else:
                logger.warning("reading a peer's prefix blocks for %s failed: %s", rid, fetch.handle.error)
                self.failed_reads += 1
                self._settle_later(fetch)
                fetch.done(0)
        self._reap()

    def _settle_later(self, fetch: _Fetch) -> None:
        self._unsettled.append(fetch)
        self._reap()

    def _reap(self) -> None:
        """Free the slots of failed or dropped reads once nothing can land in them any more (a dropped
        read that landed publishes its blocks: they are as good as any)."""
        still = []
        for fetch in self._unsettled:
            state = self.transfer.poll(fetch.handle)
            if state is TransferState.IN_PROGRESS or not fetch.handle.local_blocks_reusable:
                still.append(fetch)
                continue
            self.transfer.release(fetch.handle)
            if state is TransferState.DONE:
                self.lending.receive(fetch.hashes, fetch.taken, fetch.checksums)
            else:
                self.lending.abandon(fetch.taken)
        self._unsettled = still

    def _record(self, blocks: int, seconds: float) -> None:
        """A landed read's time per block, into a moving average: what a read costs follows the
        owners' load (a Lend waits for the owner's step), which changes as the traffic does."""
        last = seconds / blocks
        old = self.fetch_s_per_block
        self.fetch_s_per_block = last if old is None else old + READ_COST_WEIGHT * (last - old)
        self.kv.host_blocks.peer_read_s_per_block = self.fetch_s_per_block

    def close(self) -> None:
        """Drop the reads in flight and every lease (the transfer backend is closed by its owner)."""
        self._unsettled.extend(self._fetches.values())
        self._fetches.clear()
        self.lending.close()


def tier_backend(device_transfer: KVTransferBackend, rows: torch.Tensor, agent_name: str, compat: KVCompat):
    """A transfer agent over the host tier's ``rows``, of the device agent's kind (NIXL, or the same
    in-process fabric in tests)."""
    if isinstance(device_transfer, InProcessBackend):
        return InProcessBackend(device_transfer.fabric, agent_name, rows, compat)
    from kv_transfer.nixl_backend import NixlBackend

    # No progress thread: the engine's loop polls every iteration, as it does the device agent.
    return NixlBackend(agent_name, rows, compat, progress_thread=False)


def lent_to_proto(tiers: PeerTiers, slots: list[int], checksums: list[int]) -> pb.LendResponse:
    msg = pb.LendResponse(slots=slots, checksums=checksums, lease_s=tiers.lending.lease_s)
    if slots:
        msg.tier.CopyFrom(transfer_info_to_proto(tiers.info()))
    return msg


def offer_from_proto(msg: pb.LendResponse, lease_id: str) -> LendOffer:
    peer = transfer_info_from_proto(msg.tier) if msg.HasField("tier") else None
    return LendOffer(peer, list(msg.slots), list(msg.checksums), lease_id, msg.lease_s)


class PeerLends:
    """The worker process's side of a read: ask the peer for a lease (gRPC, a channel per peer).
    ``stub``: the peers' gRPC stub (a peer is of the reader's role: its service answers Lend)."""

    def __init__(self, timeout_s: float, stub=pb_grpc.PrefillWorkerStub) -> None:
        self.timeout_s = timeout_s
        self.stub = stub
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def ask(
        self, peer: pb.PeerPrefix, prompt: list[int], lora_salt: str = ""
    ) -> tuple[pb.LendResponse, str] | None:
        """The peer's offer and its lease's name; None when the peer could not be asked (its blocks
        are then computed here). ``lora_salt``: the prompt's adapter's cache namespace."""
        channel = self._channels.get(peer.address)
        if channel is None:
            channel = self._channels[peer.address] = grpc.aio.insecure_channel(peer.address)
        lease_id = uuid.uuid4().hex
        req = pb.LendRequest(
            lease_id=lease_id, prompt_token_ids=prompt, max_blocks=peer.num_blocks, lora_salt=lora_salt
        )
        try:
            resp = await self.stub(channel).Lend(req, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            logger.warning("peer %s lent no blocks: %s", peer.worker_id, exc.details() or exc.code().name)
            return None
        return resp, lease_id

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()


def engine_tiers(
    core,
    transfer: KVTransferBackend | None,
    agent_name: str,
    compat: KVCompat,
    lease_s: float,
    timeout_s: float,
) -> PeerTiers | None:
    """The peer reads of an engine with a host tier and a transfer agent over its KV (None without
    either: such an engine reads and lends nothing). Its host tier gets an agent ``<agent_name>-tier``."""
    if core.kv.host_tier is None or transfer is None:
        return None
    rows = core.kv.host_blocks.rows
    return PeerTiers(core, tier_backend(transfer, rows, f"{agent_name}-tier", compat), lease_s, timeout_s)


class EngineTierPeers:
    """An engine process role's part in peer reads: the ``lend`` and ``fetch`` commands, polled each
    iteration, and the requests whose read is over (``EngineEvents.fetched``, after which the worker
    adds them). Without ``tiers`` every fetch is over at once and nothing is lent."""

    def __init__(self, tiers: PeerTiers | None) -> None:
        self.tiers = tiers
        self._fetched: list[str] = []

    def run(self, cmd: pb.EngineCommand, reply: pb.EngineReply) -> bool:
        kind = cmd.WhichOneof("kind")
        if kind == "lend":
            if self.tiers is not None:
                req = cmd.lend
                slots, sums = self.tiers.lend(
                    req.lease_id, list(req.prompt_token_ids), req.max_blocks, req.lora_salt
                )
                reply.lent.CopyFrom(lent_to_proto(self.tiers, slots, sums))
        elif kind == "fetch":
            msg, rid = cmd.fetch, cmd.fetch.request_id
            if self.tiers is None:
                self._fetched.append(rid)
            else:
                offer = offer_from_proto(msg.lent, msg.lease_id)
                over = lambda _n: self._fetched.append(rid)  # noqa: E731
                self.tiers.fetch(rid, list(msg.prompt_token_ids), offer, over, msg.asked_s, msg.lora_salt)
        else:
            return False
        return True

    def abort(self, request_id: str) -> bool:
        """Whether the request was reading a peer's blocks. Its read is dropped and announced as over:
        whoever waits for it goes on (a cancelled caller is gone; an Abort call's caller then cancels
        the stream, which aborts the request it adds)."""
        if self.tiers is None or not self.tiers.abort(request_id):
            return False
        self._fetched.append(request_id)
        return True

    def tick(self) -> None:
        if self.tiers is not None:
            self.tiers.tick()

    def finish(self, events: pb.EngineEvents) -> None:
        events.fetched.extend(self._fetched)
        self._fetched.clear()
