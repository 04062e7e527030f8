"""A decode worker's KV pulls: one small state machine per request, driven by the engine thread.

A pull's states:

    start ──no room──> WAITING_FOR_ROOM ──room──> READING ──done──> (request joins the batch)
      │                    │ lease ends                 │ failed / timed out
      │                    └──> recompute locally       └──> recompute locally | fail the request
      ├──room──> READING                 abort in READING ──> ABORTING ──read settled──> (freed)
      └──lease (nearly) over──> recompute locally

    begin_early ──> STREAMING ──finish_early──> READING        (abort: ABORTING, as above)

``start`` allocates the prompt's blocks (reusing local prefix-cache hits) and starts the READ; with
no room right now the pull waits, FIFO, while the prefill worker's lease lasts, then recomputes
locally. A READ must land inside the owner's lease (less ``LEASE_MARGIN_S``), which frees and reuses
the blocks at expiry: its timeout is cut to the lease left; with none left the prompt is recomputed.
``tick`` polls the reads. A *streamed* pull starts while the prefill worker still computes
the prompt (``begin_early``): its blocks are allocated at once and each batch of newly computed
blocks is read as it is announced (``extend``); the complete handle (first token, last blocks) comes
later (``finish_early``), and only the blocks not read yet are left for the hand-off. Its reads carry
no notification: the owner is told once, after the last of them landed, that it may free the prompt. A request never decodes from blocks it did not fully receive,
and its blocks are freed only once the read has settled: NIXL cannot abort a READ in flight, so the
blocks of a failed read that may still land stay *quarantined* until the backend says they are
reusable. A pull that fails under the ``fail`` policy leaves a ``KVTransferError`` for the stream.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.core_transfer import TransferPlan
from engine.engine_core import EngineCore
from engine.sampling_params import SamplingParams
from engine.scheduler_output import SequenceOutput
from engine.scheduler_transfer import NoKVRoomError
from kv_transfer import KVTransferBackend, TransferHandle, TransferState, merge_block_runs
from kv_transfer.stats import TransferStats
from proto import pdserve_pb2 as pb
from proto.convert import logprobs_from_proto

logger = logging.getLogger(__name__)


class FailurePolicy(str, enum.Enum):
    RECOMPUTE = "recompute"  # compute the prompt here instead
    FAIL = "fail"  # end the stream with a KVTransferError


FAILURE_POLICIES = tuple(p.value for p in FailurePolicy)
LEASE_MARGIN_S = 1.0  # a read ends this long before the lease: clocks differ, a poll may come late


class PullState(enum.Enum):
    WAITING_FOR_ROOM = "waiting_for_room"
    READING = "reading"
    STREAMING = "streaming"  # reading blocks as the peer computes them; the complete handle not in yet
    ABORTING = "aborting"  # the request is gone; the read must settle before its blocks are freed


class KVTransferError(RuntimeError):
    """The request's KV could not be pulled (and the policy says fail)."""


class PeerUnreachableError(KVTransferError):
    """The prefill worker holding the KV cannot be reached, or is a new incarnation."""


class IncompatibleKVError(ValueError):
    """The KV handle comes from an engine whose layout differs from ours."""


@dataclass(frozen=True, slots=True)
class PulledKV:
    """What the decode side needs of a prefill worker's KV handle."""

    agent_name: str
    address: str
    block_ids: list[int]
    num_tokens: int
    compat_hash: str
    first_token: int
    first_logprobs: dict[int, float] | None
    seed: int
    lease_expiry_unix: float = 0.0  # the prefill side frees the blocks then (0: unknown)
    owner_request_id: str = ""  # the id the prefill side holds the prompt under (default: ours)

    def read_time_left(self) -> float:
        """Seconds a read may still take: until the lease ends, less the margin (inf: no lease known)."""
        expiry = self.lease_expiry_unix
        return expiry - time.time() - LEASE_MARGIN_S if expiry else math.inf


@dataclass(slots=True)
class PendingPull:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    priority: int
    kv: PulledKV
    policy: FailurePolicy
    state: PullState = PullState.WAITING_FOR_ROOM
    handles: list[TransferHandle] = dataclasses.field(default_factory=list)
    started: float = 0.0  # time.monotonic() when the READ started (streamed: the complete handle came)
    give_up_at: float = math.inf  # time.monotonic(): waiting for room ends, recompute locally
    plan: TransferPlan | None = None  # streamed pulls: where the peer's blocks go
    requested: int = 0  # streamed pulls: blocks of the sequence asked for so far (hits included)
    complete: bool = True  # the complete handle is in (a streamed pull: once ``finish_early`` ran)
    broken: bool = False  # a streamed pull's read could not even be started: the pull has failed

    @property
    def owner_id(self) -> str:
        return self.kv.owner_request_id or self.request_id


def pulled_kv_from_handle(h: pb.KVHandle) -> PulledKV:
    return PulledKV(
        agent_name=h.agent_name,
        address=h.address,
        block_ids=list(h.block_ids),
        num_tokens=h.num_tokens,
        compat_hash=h.compat_hash,
        first_token=h.first_token,
        first_logprobs=logprobs_from_proto(h.first_logprobs),
        seed=h.seed,
        lease_expiry_unix=h.lease_expiry_unix,
        owner_request_id=h.request_id,
    )


class KVPuller:
    """Every pull of one decode worker. Engine thread only (``take_error`` excepted)."""

    def __init__(
        self,
        core: EngineCore,
        transfer: KVTransferBackend,
        publish: Callable[[list[SequenceOutput]], None],
        timeout_s: float,
        on_landed: Callable[[str, float], None] | None = None,
    ) -> None:
        self.core = core
        self.on_landed = on_landed  # (request id, seconds of its READ) once its KV is in
        self.transfer = transfer
        self.publish = publish
        self.timeout_s = timeout_s
        self.stats = TransferStats()
        self._pulls: dict[str, PendingPull] = {}  # insertion order: waiters are served FIFO
        self._quarantine: dict[str, list[TransferHandle]] = {}  # held-block key -> unsettled reads
        self._errors: dict[str, KVTransferError] = {}

    def __len__(self) -> int:
        return len(self._pulls)

    def count(self, state: PullState) -> int:
        return sum(1 for p in self._pulls.values() if p.state is state)

    def landing(self, window_s: float = 0.1) -> bool:
        """A read started less than ``window_s`` ago is in flight: worth polling without a pause (a
        hand-off lands within milliseconds; a slower one is polled every engine-loop tick)."""
        now = time.monotonic()
        return any(p.state is PullState.READING and now - p.started < window_s for p in self._pulls.values())

    def state_of(self, request_id: str) -> PullState | None:
        p = self._pulls.get(request_id)
        return p.state if p is not None else None

    # Transitions ------------------------------------------------------------------------------

    def start(self, pull: PendingPull, *, reachable: bool) -> bool:
        """Begin a pull; False when the first token already ended the request (nothing to stream)."""
        if not reachable:  # no peer to read from: compute the prompt here, the first token kept
            try:
                plan = self._plan(pull)
            except NoKVRoomError:
                self._recompute(pull, notify=False)
                return True
            if plan is not None:
                self.stats.recomputed += 1
                self.core.fail_transfer(pull.request_id)
            return plan is not None
        if self.count(PullState.WAITING_FOR_ROOM):  # behind earlier waiters: keep their order
            self._wait_for_room(pull)
            return True
        try:
            return self._read(pull)
        except NoKVRoomError:
            self._wait_for_room(pull)
            return True

    def abort(self, request_id: str) -> bool | None:
        """Abort the request's pull; None when it has no pull (the engine owns it)."""
        pull = self._pulls.get(request_id)
        if pull is None:
            return None
        if pull.state is PullState.WAITING_FOR_ROOM:  # nothing allocated here; free the peer's blocks
            del self._pulls[request_id]
            self._notify_owner(pull)
            self.publish([SequenceOutput(request_id, 0, [], finish_reason="abort")])
        else:
            pull.state = PullState.ABORTING  # freed by tick once the read has settled
        return True

    def take_error(self, request_id: str) -> KVTransferError | None:
        """The error a failed pull left for its stream (called from the stream's event loop: the
        engine thread wrote it before publishing the failure, so it is there when the stream looks)."""
        return self._errors.pop(request_id, None)

    def tick(self) -> None:
        if self.count(PullState.WAITING_FOR_ROOM):
            self._retry_waiting()
        for rid, pull in list(self._pulls.items()):
            if pull.state is PullState.WAITING_FOR_ROOM:
                continue
            states = [self.transfer.poll(h) for h in pull.handles]
            if pull.state is PullState.STREAMING or TransferState.IN_PROGRESS in states:
                continue  # a streamed pull waits for its complete handle; every read must settle
            del self._pulls[rid]
            if all(s is TransferState.DONE for s in states) and not pull.broken:
                self._finish_read(pull)
            else:
                self._fail_read(pull)
        for key, handles in list(self._quarantine.items()):
            for h in handles:
                self.transfer.poll(h)
            if all(h.local_blocks_reusable for h in handles):
                for h in handles:
                    self.transfer.release(h)
                self.core.release_held(key)
                del self._quarantine[key]

    # Streamed pulls -----------------------------------------------------------------------------

    def begin_early(self, pull: PendingPull) -> bool:
        """Allocate a streamed pull's blocks while the peer still computes the prompt; False when
        there is no room now, or earlier pulls wait for room (the pull then starts as an ordinary one,
        in their queue, once its handle is complete)."""
        if self.count(PullState.WAITING_FOR_ROOM):
            return False
        try:
            pull.plan = self.core.add_transferred_request(
                pull.request_id, pull.prompt, None, pull.params, seed=0, priority=pull.priority
            )
        except NoKVRoomError:
            return False
        pull.state, pull.complete = PullState.STREAMING, False
        self._pulls[pull.request_id] = pull
        return True

    def extend(self, request_id: str, block_ids: list[int], complete: bool = False) -> None:
        """Read the blocks the peer finished since the last call (``block_ids``: all of the
        request's blocks computed so far, in sequence order; ``complete``: the prompt is done)."""
        pull = self._pulls.get(request_id)
        if pull is None or pull.state is not PullState.STREAMING:
            return
        if pull.broken or any(h.state is TransferState.FAILED for h in pull.handles):
            return  # failed already: settled with the complete handle, as a failed pull
        self._read_from(pull, block_ids, overlapped=not complete)

    def finish_early(self, request_id: str, kv: PulledKV) -> bool | None:
        """The complete handle of a streamed pull: read what is left. None when the request has no
        streamed pull (start it as an ordinary one); False when the first token ended the request;
        True otherwise (also for a pull aborted meanwhile: its stream gets the abort once its reads
        settled). A pull whose early reads failed settles as a failed pull (``kv_failure_policy``)."""
        pull = self._pulls.get(request_id)
        if pull is None:
            return None
        if pull.state is not PullState.STREAMING:
            return True
        if kv.agent_name != pull.kv.agent_name:
            raise ValueError(
                f"{request_id}: its KV was streamed from {pull.kv.agent_name}, not {kv.agent_name}"
            )
        pull.kv, pull.complete = kv, True
        pull.started = time.monotonic()
        if not self.core.set_first_token(request_id, kv.first_token, kv.first_logprobs, kv.seed):
            pull.state = PullState.ABORTING  # freed once its reads settled; the owner holds nothing
            return False
        pull.state = PullState.READING
        timeout = min(self.timeout_s, kv.read_time_left())
        if timeout <= 0:  # the owner frees the prompt (lease over) before what is left could land
            logger.warning("lease of %s's KV is (nearly) over: not reading the rest", request_id)
            pull.broken = True  # settles as a failed pull (its early reads included)
        elif not pull.broken and not any(h.state is TransferState.FAILED for h in pull.handles):
            for h in pull.handles:  # early reads, started before the lease, end inside it too
                h.deadline = min(h.deadline, time.monotonic() + timeout)
            self._read_from(pull, kv.block_ids, timeout_s=timeout)
        return True

    def _read_from(self, pull: PendingPull, block_ids: list[int], overlapped=False, timeout_s=None) -> None:
        """Start a READ of ``block_ids[pull.requested:]`` into the pull's blocks (no notification);
        ``overlapped``: the peer is still computing the prompt (no lease runs yet)."""
        plan, first = pull.plan, pull.requested
        skip = max(0, plan.first_block_index - first)  # local prefix-cache hits are not read
        remote = block_ids[first + skip :]
        local = plan.local_block_ids[first + skip - plan.first_block_index :][: len(remote)]
        remote = remote[: len(local)]
        if remote:
            try:
                timeout = timeout_s or self.timeout_s
                handle = self.transfer.start_read(pull.kv.agent_name, remote, local, b"", timeout)
            except Exception as exc:  # nothing was posted; these blocks will never be read
                logger.warning("KV read for %s could not start: %s", pull.request_id, exc)
                pull.broken = True
                return
            pull.handles.append(handle)
        pull.requested = max(first, len(block_ids))
        if not remote:
            return
        self.stats.bytes += len(remote) * self.core.layout.block_bytes
        self.stats.descriptors += len(merge_block_runs(remote, local))
        if overlapped:
            self.stats.streamed_bytes += len(remote) * self.core.layout.block_bytes

    # Internals --------------------------------------------------------------------------------

    def _plan(self, pull: PendingPull):
        kv = pull.kv
        return self.core.add_transferred_request(
            pull.request_id,
            pull.prompt,
            kv.first_token,
            pull.params,
            seed=kv.seed,
            first_logprobs=kv.first_logprobs,
            priority=pull.priority,
        )

    def _read(self, pull: PendingPull) -> bool:
        """Allocate the blocks and start the READ (no lease left: recompute); NoKVRoomError: no room."""
        rid, kv = pull.request_id, pull.kv
        plan = self._plan(pull)
        if plan is None:
            self._notify_owner(pull)
            return False
        remote = kv.block_ids[plan.first_block_index : plan.first_block_index + len(plan.local_block_ids)]
        if not plan.local_block_ids:  # everything was a local prefix hit
            self._notify_owner(pull)
            self.core.complete_transfer(rid)
            return True
        timeout = min(self.timeout_s, kv.read_time_left())  # a read that outlives the lease fails
        if timeout <= 0:  # the owner frees the blocks (and reuses them) before a read could land
            logger.warning("lease of %s's KV is (nearly) over: recomputing it locally", rid)
            self._notify_owner(pull)
            self.stats.recomputed += 1
            self.core.fail_transfer(rid)
            return True
        pull.started = time.monotonic()  # before posting: a read over shared memory may copy at once
        pull.handles = [
            self.transfer.start_read(
                kv.agent_name, remote, plan.local_block_ids, pull.owner_id.encode(), timeout
            )
        ]
        pull.state = PullState.READING
        self._pulls[rid] = pull
        self.stats.bytes += len(remote) * self.core.layout.block_bytes
        self.stats.descriptors += len(merge_block_runs(remote, plan.local_block_ids))
        return True

    def _wait_for_room(self, pull: PendingPull) -> None:
        pull.state = PullState.WAITING_FOR_ROOM
        pull.give_up_at = time.monotonic() + max(0.0, min(self.timeout_s, pull.kv.read_time_left()))
        self.stats.waited += 1
        self._pulls[pull.request_id] = pull

    def _retry_waiting(self) -> None:
        now = time.monotonic()
        for rid, pull in list(self._pulls.items()):
            if pull.state is not PullState.WAITING_FOR_ROOM:
                continue
            if now >= pull.give_up_at:
                del self._pulls[rid]
                logger.info("no KV room for %s before its lease ends: recomputing it locally", rid)
                self._recompute(pull)
                continue
            try:
                self._read(pull)  # a started READ keeps this entry (and its place)
            except NoKVRoomError:
                return  # still no room; later waiters stay behind this one
            if pull.state is not PullState.READING:  # nothing to read after all
                del self._pulls[rid]

    def _recompute(self, pull: PendingPull, notify: bool = True) -> None:
        """Give up on the peer's KV: free it there, and compute the prompt here (the engine queues the
        request until blocks free up).

        NOTE: the first token was already streamed by the router, so it joins the prompt and one
        token less is left to generate: positions, and so seeded samples, are those of one engine."""
        kv = pull.kv
        if notify:
            self._notify_owner(pull)
        self.stats.recomputed += 1
        rest = dataclasses.replace(pull.params.continued(1), seed=kv.seed)
        self.core.add_request(pull.request_id, [*pull.prompt, kv.first_token], rest, priority=pull.priority)

    def _notify_owner(self, pull: PendingPull) -> None:
        """Tell the prefill worker its blocks are no longer needed, so it frees them now. Best effort
        (on the engine thread, a raise would strand the request): a peer that is gone has its lease."""
        try:
            self.transfer.send_notification(pull.kv.agent_name, pull.owner_id.encode())
        except Exception as exc:
            logger.warning("could not tell %s to free %s: %s", pull.kv.agent_name, pull.request_id, exc)

    def _finish_read(self, pull: PendingPull) -> None:
        rid = pull.request_id
        for h in pull.handles:
            self.transfer.release(h)
        if pull.plan is not None and pull.complete:  # its reads carry no notification: tell the owner
            self._notify_owner(pull)
        if pull.state is PullState.ABORTING:
            self.publish(self.core.abort_request(rid))
            return
        self.stats.streamed += pull.plan is not None
        seconds = time.monotonic() - pull.started
        self.stats.record_done(seconds)
        self.core.complete_transfer(rid)
        if self.on_landed is not None:
            self.on_landed(rid, seconds)

    def _fail_read(self, pull: PendingPull) -> None:
        rid, handles = pull.request_id, pull.handles
        # NOTE: NIXL cannot abort a READ in flight: until the backend says the local blocks are
        # reusable, they stay allocated (quarantined) and the request goes on without them.
        if not all(h.local_blocks_reusable for h in handles):
            self._quarantine[self.core.quarantine_blocks(rid)] = handles
        else:
            for h in handles:
                self.transfer.release(h)
        # The owner would otherwise hold the blocks until its lease ends. Safe even if the read may
        # still land: its deadline has passed, and what lands goes to quarantined blocks. (A streamed
        # pull without its complete handle does not: the prompt may still be computed, or read again
        # by another attempt; the owner frees it on the router's release, an abort or the lease.)
        if pull.complete:
            self._notify_owner(pull)
        self.stats.failures += 1
        if pull.state is PullState.ABORTING:
            self.publish(self.core.abort_request(rid))
        elif pull.policy is FailurePolicy.RECOMPUTE:
            logger.warning("KV pull of %s failed: recomputing its prompt locally", rid)
            self.stats.recomputed += 1
            self.core.fail_transfer(rid)
        else:
            message = f"kv transfer of {rid} failed or timed out"
            self._errors[rid] = KVTransferError(message)
            self.publish(self.core.fail_request(rid, message))
