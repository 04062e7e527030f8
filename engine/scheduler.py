"""Iteration-level scheduler: continuous batching with chunked prefill, prefix caching, preemption.

One idea covers prompts, chunks, prefix hits and decodes: each step a sequence gets up to
``num_tokens - num_computed_tokens`` tokens of the step's token budget. A prompt longer than the
budget runs in chunks over several steps; a prefix-cache hit starts ``num_computed_tokens`` past
the hit; a decode is a sequence one token behind.

Order within a step, by policy:
- ``fifo``: running decodes, running prefill chunks, swapped-in sequences, new requests (FIFO).
- ``prefill_first``: running prefill chunks, new requests, swapped-in, then decodes.
- ``priority``: as fifo, but queues sorted by (priority, arrival); a waiting request may preempt
  running ones of lower priority (higher value).
- ``fair``: decodes, then swapped-in, new requests and running prefill chunks, prompts shortest
  remaining first, within a prefill allowance sized to an ITL target (``engine.batching_policy``).
When a running sequence cannot get a block, the latest-arrived (or lowest-priority) running sequence
not yet scheduled this step is preempted: swapped to the CPU pool if there is room, else freed and
requeued for recompute. New requests are admitted only while a margin of free blocks remains.
"""

from __future__ import annotations

import logging
from collections import deque
from operator import attrgetter

from engine.batching_policy import FairBatching
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.scheduler_output import (
    NewSequenceData,
    RunningSequenceData,
    SchedulerOutput,
)
from engine.scheduler_preemption import WAITING_ORDER, Preemption, priority_key, remaining_prefill
from engine.scheduler_results import StepResults
from engine.scheduler_transfer import TransferQueue
from engine.steady_decodes import SteadyDecodes

_pending_forks = attrgetter("pending_forks")

logger = logging.getLogger(__name__)


class Scheduler(TransferQueue, StepResults, Preemption):
    def __init__(
        self,
        kv: KVCacheManager,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        policy: str = "fifo",
        admission_margin: float = 0.01,
        itl_target_ms: float = 100.0,
        num_spec_tokens: int = 0,
        spec_max_batch: int | None = None,
        max_loras: int = 0,
    ) -> None:
        self.kv = kv
        self.max_loras = max_loras  # distinct LoRA adapters running at once (the device's slots)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.policy = policy
        self.num_spec_tokens = num_spec_tokens  # k drafts per speculating decode; 0: off
        self.spec_max_batch = spec_max_batch or 1 << 62  # no speculation with this many running
        # The fair policy's step sizing; the engine reports each step's duration to it.
        self.batching = (
            FairBatching(max_num_batched_tokens, itl_target_ms / 1e3) if policy == "fair" else None
        )
        self.margin_blocks = int(admission_margin * kv.num_blocks)
        self.requests: dict[str, Request] = {}
        self.groups: dict[str, list[str]] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.transferring: dict[str, Request] = {}
        self.parked: list[str] = []  # of those, pulled but waiting for an adapter slot (TransferQueue)
        self._finished_ids: set[str] = set()
        self._sent_to_runner: set[str] = set()
        self._repeat_ids: list[str] | None = None  # StepResults._requests_of's cache
        self._repeat_requests: list[Request | None] = []
        self._repeat_checks: tuple[list[int], frozenset[int], int] | None = None  # ... its bulk checks
        self._steady: SteadyDecodes | None = None  # the running requests, scheduled in bulk
        self._tail: list[Request] = []  # ... and those after it this step, scheduled per request
        self._swapped_in: set[str] = set()  # request ids swapped in by this step (``schedule``)
        self.num_preemptions = 0
        self.num_swap_outs = 0
        self.num_prompt_tokens = 0

    # Queue management -------------------------------------------------------------------------

    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.groups.setdefault(req.group_id, []).append(req.request_id)
        self.waiting.append(req)
        if self.policy in WAITING_ORDER:
            self._sort_waiting()

    def finish(self, seq_id: str, status: RequestStatus) -> Request | None:
        """End a sequence (abort, stop string, error) wherever it is; frees its blocks."""
        req = self.requests.pop(seq_id, None)
        if req is None:
            return None
        if req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req.status == RequestStatus.SWAPPED:
            self.swapped.remove(req)
        elif req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.TRANSFERRING:
            # NOTE: the caller must have settled the pull first: a live transfer may still write.
            del self.transferring[seq_id]
            if seq_id in self.parked:
                self.parked.remove(seq_id)
        req.status = status
        self._release(req)
        return req

    def sequences_of(self, group_id: str) -> list[str]:
        return list(self.groups.get(group_id, ()))

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:  # a step has something to do: requests pulling KV wait outside it
        return len(self.requests) > len(self.transferring) - len(self.parked)

    @property
    def finished_not_sent(self) -> frozenset[str]:
        """Sequences that ended since the last ``schedule`` (the runner drops them with the next)."""
        return frozenset(self._finished_ids)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.swapped)

    # Scheduling -------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self.kv.begin_step()
        out = SchedulerOutput(finished_seq_ids=self._finished_ids)
        self._finished_ids = set()
        self._swapped_in: set[str] = set()  # this step's swap-ins: no victim before their copy lands
        budget = [self.max_num_batched_tokens]
        scheduled = out.num_scheduled_tokens  # seq_id -> tokens; membership = scheduled this step
        if self.parked:
            self.admit_parked()
        if self.policy == "priority":
            self._preempt_for_priority(out)
        decodes: list[Request] = []
        prefills: list[Request] = []
        steady, self._steady = self._steady, None
        rest = self.running  # scheduled per request: all, or those after a steady batch's members
        if steady is not None and not scheduled:  # a steady decode batch (engine.steady_decodes)
            first = self.policy == "prefill_first"  # its prefills go first: no more than the batch
            tail = (
                steady.follow(self.running, not first)
                if not (first and (self.waiting or self.swapped))
                else None
            )
            held = steady.held() if tail is not None else None
            if held:  # (overlapped) their token in flight is their last: not scheduled, as per request
                steady.release(held)
            if (
                held is not None and steady.running and len(steady.ids) <= budget[0]
                and steady.advance(self.kv, out)
            ):  # fmt: skip
                self._steady, self._tail, rest = steady, tail, tail
                budget[0] -= len(steady.ids)
        for r in rest:
            (decodes if len(r.token_ids) - r.num_computed_tokens == 1 else prefills).append(r)
        if self.policy == "priority":
            decodes.sort(key=priority_key)
            prefills.sort(key=priority_key)
        if self.policy == "prefill_first":
            self._schedule_running(prefills, out, budget, scheduled)
            self._schedule_waiting(out, budget, scheduled)
            self._schedule_swapped(out, budget, scheduled)
            self._schedule_running(decodes, out, budget, scheduled)
            self._capture_steady(decodes, prefills, out)
        elif self.batching is not None:
            self._schedule_running(decodes, out, budget, scheduled)
            self._capture_steady(decodes, prefills, out)
            held = max(0, budget[0] - self.batching.prefill_budget(len(scheduled)))
            budget[0] -= held
            self._schedule_swapped(out, budget, scheduled)
            self._schedule_waiting(out, budget, scheduled)
            self._schedule_running(sorted(prefills, key=remaining_prefill), out, budget, scheduled)
            budget[0] += held
        else:
            self._schedule_running(decodes, out, budget, scheduled)
            self._capture_steady(decodes, prefills, out)
            self._schedule_running(prefills, out, budget, scheduled)
            self._schedule_swapped(out, budget, scheduled)
            self._schedule_waiting(out, budget, scheduled)
        out.total_num_scheduled_tokens = self.max_num_batched_tokens - budget[0]
        return out

    def _schedule_running(
        self, candidates: list[Request], out: SchedulerOutput, budget: list[int], scheduled: dict[str, int]
    ) -> None:
        # NOTE: every running sequence, every step: names bound once, the decode fast path inline.
        running, sent, max_len = RequestStatus.RUNNING, self._sent_to_runner, self.max_model_len
        spec, kv = self.num_spec_tokens, self.kv
        tables, ref_cnt, bs = kv.tables, kv.pool.ref_cnt, kv.block_size
        fill_block, append_block = kv.fill_block, kv.append_block
        fast_ids, fast_pos = out.decode_ids, out.decode_positions
        left = budget[0]
        for req in candidates:
            if left == 0:
                break
            if req.status != running:
                continue  # preempted earlier in this step
            n = len(req.token_ids)
            if req.num_placeholders and (n >= req.stop_len or n >= max_len):
                continue  # the step in flight samples its last token (max_tokens or the context)
            pos = req.num_computed_tokens
            num_new = n - pos
            seq_id = req.request_id
            if num_new == 1:
                if spec:
                    budget[0] = left
                    if self._speculate(req, out, scheduled, budget):
                        left = budget[0]
                        continue
                if not req.pending_forks and seq_id in sent:
                    # Fast path: the token goes into the sequence's own last block (the block it
                    # fills is cached by ``fill_block``), or opens a fresh one.
                    table, idx, ok = tables[seq_id], pos // bs, False
                    if idx < len(table):
                        ok = ref_cnt[table[idx]] == 1 and (pos % bs != bs - 1 or fill_block(req, table))
                    elif idx == len(table) and (block := append_block(req)) is not None:
                        out.decode_new_blocks[seq_id] = block
                        ok = True
                    if ok:
                        fast_ids.append(seq_id)
                        fast_pos.append(pos)
                        req.num_computed_tokens = pos + 1
                        scheduled[seq_id] = 1
                        left -= 1
                        continue
            budget[0] = left
            self._schedule_one(req, min(num_new, left), out, scheduled, budget)
            left = budget[0]
        budget[0] = left

    def _capture_steady(self, decodes: list[Request], prefills: list[Request], out: SchedulerOutput) -> None:
        """Keep a steady decode batch when every running request was just scheduled, in order, as a
        fast-path decode (``engine.steady_decodes``; not under ``priority``, which reorders, nor
        while speculating)."""
        if self._steady is not None:  # in bulk this step: the requests after it may join
            self._steady.join(self._tail, out)
            return
        all_fast = decodes and not prefills and len(out.decode_ids) == len(self.running) == len(decodes)
        if all_fast and not self.num_spec_tokens and self.policy != "priority":
            self._steady = SteadyDecodes.capture(
                self.running, out.decode_ids, out.decode_positions, self.max_model_len
            )

    def _schedule_one(
        self, req: Request, num_new: int, out: SchedulerOutput, scheduled: dict[str, int], budget: list[int]
    ) -> None:
        """A running sequence off the fast path (it needs a block, shares its last one, forks, or
        returns to the runner): allocate, preempting later sequences while no block is free."""
        while not self.kv.can_allocate(req, num_new, None, 0):
            # Not one swapped in this step either: swapped out again, its copy would read the blocks
            # before the swap-in wrote them (the runner applies swap-outs first).
            victim = self._pick_victim(scheduled.keys() | self._swapped_in | {req.request_id})
            self._preempt(victim or req, out)
            if victim is None:
                return
        self._emit(req, num_new, out, scheduled, budget)

    def _speculate(
        self, req: Request, out: SchedulerOutput, scheduled: dict[str, int], budget: list[int]
    ) -> bool:
        """Schedule a decode with ``1 + k`` slots for its last token and k drafts, k bounded by the
        budget and by what is left to generate; False when it decodes one token (opted out, logits
        processing or a grammar, no room)."""
        p = req.params
        if not p.speculative or p.structured is not None or p.processes_logits or req.pending_forks:
            return False
        if len(self.running) >= self.spec_max_batch:
            return False
        k = min(
            self.num_spec_tokens,
            budget[0] - 1,
            p.max_tokens - req.num_output_tokens - 1,
            self.max_model_len - req.num_tokens - 1,
        )
        if k <= 0 or req.prefill_only or not self.kv.can_allocate(req, 1 + k, None, 0):
            return False
        self._emit(req, 1 + k, out, scheduled, budget)
        out.num_spec_tokens[req.request_id] = k
        return True

    def _schedule_swapped(self, out: SchedulerOutput, budget: list[int], scheduled: dict[str, int]) -> None:
        while self.swapped and budget[0] > 0 and len(self.running) < self.max_num_seqs:
            req = self.swapped[0]
            if req.num_placeholders:
                return  # resumes with its token list in full: once the step in flight has filled it
            if req.lora is not None and not self._adapter_fits(req.lora):
                return
            # With others running, keep the margin plus a block for the token this one will write;
            # alone it may take the whole pool (validation guarantees it fits).
            if not self.kv.can_swap_in(req, self.margin_blocks + 1 if self.running else 0):
                return
            self.swapped.popleft()
            out.blocks_to_swap_in.extend(self.kv.swap_in(req))
            self._swapped_in.add(req.request_id)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._sent_to_runner.discard(req.request_id)
            num_new = min(req.num_tokens - req.num_computed_tokens, budget[0])
            if self.kv.can_allocate(req, num_new, None, 0):
                self._emit(req, num_new, out, scheduled, budget)

    def _schedule_waiting(self, out: SchedulerOutput, budget: list[int], scheduled: dict[str, int]) -> None:
        # Nothing new while a swapped-out sequence waits to come back (as vLLM's swapping scheduler):
        # new prompts would take its blocks a few at a time and it would wait out the traffic.
        if not self.waiting or budget[0] <= 0 or self.swapped:  # steady decodes: no pass over it
            return
        # Parallel samples fork after their prompt: reserve their sequence slots at admission.
        # NOTE: every step a request arrives: a C-level pass over the running list.
        reserved = len(self.running) + sum(map(_pending_forks, self.running))
        skipped: list[Request] = []  # waiting for an adapter slot: later requests go first meanwhile
        try:
            self._admit_waiting(out, budget, scheduled, reserved, skipped)
        finally:
            self.waiting.extendleft(reversed(skipped))

    def _adapter_fits(self, lora: str, running: set[str] | None = None) -> bool:
        """Whether a sequence of adapter ``lora`` can run now: its adapter runs already, or a slot
        is free of running adapters (``running``: those adapters, when the caller keeps them)."""
        if running is None:
            running = {r.lora for r in self.running if r.lora is not None}
        return lora in running or len(running) < self.max_loras

    def _admit_waiting(
        self, out: SchedulerOutput, budget: list[int], scheduled: dict[str, int], reserved: int, skipped: list
    ) -> None:
        adapters: set[str] | None = None  # the running adapters, found once per call (not per request)
        while self.waiting and budget[0] > 0:
            req = self.waiting[0]
            if req.num_placeholders:
                return  # preempted with a token in flight: it resumes once the value is known
            if reserved + 1 + req.pending_forks > self.max_num_seqs:
                return
            if req.lora is not None:
                if adapters is None:
                    adapters = {r.lora for r in self.running if r.lora is not None}
                if not self._adapter_fits(req.lora, adapters):
                    skipped.append(self.waiting.popleft())
                    continue
                adapters.add(req.lora)  # (admitted below, or the loop ends before anything else runs)
            hit = self.kv.find_prefix_hit(req)
            req.num_computed_tokens = hit.num_tokens
            num_new = min(req.num_tokens - hit.num_tokens, budget[0])
            margin = self.margin_blocks if self.running else 0
            if not self.kv.can_allocate(req, num_new, hit, margin):
                req.num_computed_tokens = 0
                return
            reserved += 1 + req.pending_forks
            self.waiting.popleft()
            out.blocks_to_copy.extend(self.kv.allocate(req, num_new, hit))  # may shorten the hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = hit.num_tokens
                self.num_prompt_tokens += req.prompt_len
                self.kv.record_prefix_query(req, hit)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._sent_to_runner.discard(req.request_id)
            self._emit(req, num_new, out, scheduled, budget, allocated=True)

    def _emit(
        self,
        req: Request,
        num_new: int,
        out: SchedulerOutput,
        scheduled: dict[str, int],
        budget: list[int],
        allocated: bool = False,
    ) -> None:
        seq_id = req.request_id
        old_len = len(self.kv.block_ids(req))
        cow = []
        if not allocated:
            cow = self.kv.allocate(req, num_new)
            out.blocks_to_copy.extend(cow)
        table = self.kv.tables[seq_id]
        ends_known_tokens = req.num_computed_tokens + num_new == req.num_tokens
        num_samples = req.pending_forks + 1 if ends_known_tokens else 1
        if seq_id not in self._sent_to_runner:
            self._sent_to_runner.add(seq_id)
            out.new_seqs.append(
                NewSequenceData(
                    seq_id,
                    list(req.token_ids),
                    list(table),
                    req.num_computed_tokens,
                    req.params,
                    req.seed,
                    req.sample_index,
                    num_samples,
                    req.output_start,
                    req.prompt_len,
                    req.lora,
                )
            )
        elif cow:
            out.running_seqs.append(
                RunningSequenceData(seq_id, [], list(table), req.num_computed_tokens, num_samples)
            )
        else:
            out.running_seqs.append(
                RunningSequenceData(seq_id, table[old_len:], None, req.num_computed_tokens, num_samples)
            )
        out.num_scheduled_tokens[seq_id] = num_new
        req.num_computed_tokens += num_new
        budget[0] -= num_new

    def _release(self, req: Request, hold: bool = False) -> list[int]:
        held = self.kv.hold(req) if hold else []
        if not hold:
            self.kv.free(req)
        self._finished_ids.add(req.request_id)
        self._sent_to_runner.discard(req.request_id)
        ids = self.groups.get(req.group_id)
        if ids is not None:
            ids.remove(req.request_id)
            if not ids:
                del self.groups[req.group_id]
        return held
