"""The decode role's parked requests: prompts whose KV is being pulled from a peer.

A mixin of ``engine.scheduler.Scheduler`` (it uses the scheduler's queues and KV manager): a pulled
prompt gets its blocks at once (reusing local prefix hits), waits in ``transferring`` while the pull
runs, and joins the running batch when it completes, or the waiting queue (recompute) when it fails.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from collections import deque

    from engine.kv_cache_manager import KVCacheManager


class NoKVRoomError(RuntimeError):
    """The KV pool cannot hold a transferred prompt right now (it may later)."""


class TransferQueue:
    kv: KVCacheManager
    requests: dict[str, Request]
    groups: dict[str, list[str]]
    transferring: dict[str, Request]
    running: list[Request]
    waiting: deque[Request]
    num_prompt_tokens: int
    parked: list[str]  # transfers complete, waiting for their adapter's device slot (still in transferring)

    def _adapter_fits(self, lora: str) -> bool: ...

    def add_transferring(self, req: Request, num_prompt_tokens: int) -> tuple[list[int], int]:
        """Allocate blocks for a prompt whose KV will be pulled from a peer.

        Returns (fresh local block ids to fill, index of the first of them in the sequence's block
        table); blocks before it are local prefix-cache hits. Raises ``NoKVRoomError`` when the pool
        cannot hold the prompt now (the caller may fall back to recompute or retry).
        """
        hit = self.kv.find_prefix_hit(req, host=False)  # the peer sends what the device lacks
        needed = self.kv.blocks_needed(num_prompt_tokens) - len(hit.block_ids)
        reclaimed = sum(1 for b in hit.block_ids if self.kv.pool.is_free(b))
        if needed > self.kv.num_free_blocks - reclaimed:
            raise NoKVRoomError(f"no room for {needed} KV blocks ({self.kv.num_free_blocks} free)")
        fresh = self.kv.allocate_for_transfer(req, hit, num_prompt_tokens)
        req.num_cached_tokens = hit.num_tokens
        self.num_prompt_tokens += req.prompt_len
        self.kv.record_prefix_query(req, hit)
        req.status = RequestStatus.TRANSFERRING
        self.requests[req.request_id] = req
        self.groups.setdefault(req.group_id, []).append(req.request_id)
        self.transferring[req.request_id] = req
        return fresh, len(hit.block_ids)

    def complete_transfer(self, seq_id: str, num_prompt_tokens: int) -> None:
        """The pulled KV is in place: the sequence joins the batch, its next input the first token.
        One whose LoRA adapter has no device slot now (as many other adapters run as there are
        slots) is *parked* with its KV until one frees (``admit_parked``, every step)."""
        req = self.transferring[seq_id]
        req.num_computed_tokens = num_prompt_tokens
        self.kv.commit_transfer(req)
        if req.lora is not None and not self._adapter_fits(req.lora):
            self.parked.append(seq_id)
            return
        self._join(seq_id)

    def admit_parked(self) -> None:
        for seq_id in list(self.parked):
            req = self.transferring[seq_id]
            if self._adapter_fits(req.lora):
                self.parked.remove(seq_id)
                self._join(seq_id)

    def _join(self, seq_id: str) -> None:
        req = self.transferring.pop(seq_id)
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def fail_transfer(self, seq_id: str) -> None:
        """The pull failed: drop its blocks and recompute the prompt (and first token) locally."""
        req = self.transferring.pop(seq_id)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
