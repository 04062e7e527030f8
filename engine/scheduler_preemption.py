"""The scheduler's preemption: which running sequence gives way, and how (swapped to the CPU pool
when there is room, else freed for recompute); the ``priority`` policy's preemption of lower-priority
running sequences for an urgent waiting one."""

from __future__ import annotations

import logging
from collections import deque

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.scheduler_output import SchedulerOutput

logger = logging.getLogger("engine.scheduler")


class Preemption:
    """Part of ``engine.scheduler.Scheduler`` (its state: running, waiting, swapped, kv, policy)."""

    running: list[Request]
    waiting: deque[Request]
    swapped: deque[Request]
    kv: KVCacheManager
    policy: str
    max_num_seqs: int
    max_num_batched_tokens: int
    margin_blocks: int
    num_preemptions: int
    num_swap_outs: int
    _sent_to_runner: set[str]

    def _pick_victim(self, exclude: set[str]) -> Request | None:
        pool = [r for r in self.running if r.request_id not in exclude]
        if not pool:
            return None
        if self.policy == "priority":
            return max(pool, key=priority_key)
        return pool[-1]

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.num_preemptions += 1
        req.num_preemptions += 1
        self._sent_to_runner.discard(req.request_id)
        out.finished_seq_ids.add(req.request_id)  # the runner drops its state either way
        if self.kv.num_cpu_blocks and self.kv.can_swap_out(req):
            out.blocks_to_swap_out.extend(self.kv.swap_out(req))
            self.num_swap_outs += 1
            req.status = RequestStatus.SWAPPED
            self.swapped.append(req)
            logger.debug("swapped out %s", req.request_id)
            return
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        if self.policy == "priority":
            self._sort_waiting()
        logger.debug("preempted %s for recompute", req.request_id)

    def _preempt_for_priority(self, out: SchedulerOutput) -> None:
        """Before anything is scheduled: make room for the most urgent waiting request by preempting
        running sequences of lower priority (higher value), lowest first."""
        if not self.waiting:
            return
        req = self.waiting[0]
        while self.running:
            hit = self.kv.find_prefix_hit(req)
            req.num_computed_tokens = hit.num_tokens
            num_new = min(req.num_tokens - hit.num_tokens, self.max_num_batched_tokens)
            fits = self.kv.can_allocate(req, num_new, hit, self.margin_blocks)
            req.num_computed_tokens = 0
            seats = len(self.running) + 1 + req.pending_forks <= self.max_num_seqs
            if fits and seats:
                return
            victim = self._pick_victim(set())
            if victim is None or priority_key(victim) <= priority_key(req):
                return
            self._preempt(victim, out)

    def _sort_waiting(self) -> None:
        self.waiting = deque(sorted(self.waiting, key=WAITING_ORDER[self.policy]))


def priority_key(req: Request) -> tuple[int, float]:
    """The ``priority`` policy's order: lower value first, then earlier arrival."""
    return (req.priority, req.arrival_time)


def remaining_prefill(req: Request) -> int:
    """The ``fair`` policy's order of prompts: the shortest remaining prefill first."""
    return req.num_tokens - req.num_computed_tokens


WAITING_ORDER = {"priority": priority_key, "fair": remaining_prefill}  # policies that sort the queue
