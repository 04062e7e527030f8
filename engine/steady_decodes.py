"""A steady decode batch, scheduled and updated in bulk rather than one sequence at a time.

When every running request was a fast-path decode last step (``Scheduler._schedule_running``: one
token into its own block), the batch is kept, and each later step schedules its members one
position further; only the members at a block boundary need a look: the one whose token fills its
block (cached once full) and the one whose token opens the next. Positions advance by one per
step, so those are found by residue (``due``), not by visiting all. Everything the per-request
fast path checks is then either fixed for the batch (not speculating, no forks owed, known to the
runner) or guarded: the members still running, in order, at the head of the running list, and
the token budget. With a step in flight (overlapped), a member whose token in flight is its last
is held back, as the per-request path holds it: it leaves the batch (``held``, ``release``).

The batch persists as requests come and go (``follow``, ``join``): a member that ended or was
preempted leaves it, and the requests after the members in the running list (arrivals, mid-prefill
or past it) are scheduled per request behind the batch; those that went the fast path, from the
first on, join it. Under ``prefill_first``, whose order puts running prefills before decodes, the
batch is followed only while nothing runs after it. Any other case (a member at a block boundary
off the fast path, a running list reordered) takes the per-request path for the step, which
captures a new batch when it finds every running request on the fast path.

``update`` has the same shape on its side (``StepResults._update_steady``): a steady batch's
samples are appended in one loop; only a batch with a stop token, or one reaching a length limit,
takes the per-request checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter

from engine.block_hash import BlockHash
from engine.kv_cache_manager import KVCacheManager
from engine.kv_decode_blocks import FillPlan
from engine.request import Request, RequestStatus
from engine.scheduler_output import SchedulerOutput

_next = (1).__add__
_NO_FILLS = FillPlan((), (), (), False)  # a step where no member fills its block (most steps)
_status = attrgetter("status")


@dataclass(slots=True)
class SteadyDecodes:
    running: list[Request]  # the members, in the running list's order (the batch's own list)
    ids: list[str]
    positions: list[int]  # the last step's
    max_len: int
    step: int = 0  # steps after the capture
    # Members by their position at the capture modulo the block size (a member that joined later:
    # its position less the steps since). Built by the first ``advance`` (a batch that changes
    # before its next step never pays for it).
    due: list[list[Request]] | None = None
    # Members by the bulk step whose token in flight is their last (``held``), and each one's step;
    # found when a step is first in flight.
    _ends: dict[int, list[Request]] | None = None
    _end_of: dict[str, int] | None = None

    @classmethod
    def capture(
        cls, running: list[Request], ids: list[str], positions: list[int], max_len: int
    ) -> SteadyDecodes:
        """From a step that scheduled every request of ``running``, in order, as a fast-path decode
        (``ids``, at ``positions``)."""
        return cls(list(running), list(ids), list(positions), max_len)

    def held(self) -> list[Request] | None:
        """The members the per-request path would hold back this step: with a step in flight
        (overlapped), those whose token in flight is their last (they end with its update). None
        when one of them should have ended already (the step goes per request). With no step in
        flight, a member at its limit has ended and left: none."""
        if not self.running[0].num_placeholders:
            return []
        t = self.step + 1
        if self._ends is None:
            # At bulk step t each member has t more tokens (or tokens in flight) than at the capture
            # (or its join, counted as a capture then): it is held at the step its count reaches its
            # limit.
            self._ends, self._end_of = {}, {}
            for r in self.running:
                self._end(r, t + min(r.stop_len, self.max_len) - len(r.token_ids))
        ends = self._ends
        if ends and min(ends) < t:
            return None
        return ends.get(t, [])

    def _end(self, req: Request, step: int) -> None:
        self._ends.setdefault(step, []).append(req)
        self._end_of[req.request_id] = step

    def release(self, held: list[Request]) -> None:
        """The members ``held`` leave the batch (they end with the step in flight)."""
        index = self.running.index
        self._drop(sorted(index(r) for r in held))

    def follow(self, running: list[Request], tail_ok: bool) -> list[Request] | None:
        """Drop the members that no longer run; then the requests of ``running`` after the members
        (none unless ``tail_ok``), or None when the members are not its head, in order (the caller
        schedules the step per request)."""
        members = self.running
        n = len(members)
        if len(running) == n and running == members:  # NOTE: every steady step: one list compare
            return []
        if running[:n] != members:
            states = list(map(_status, members))
            if states.count(RequestStatus.RUNNING) != n:
                self._drop([i for i, s in enumerate(states) if s != RequestStatus.RUNNING])
                n = len(members)
            if not n or running[:n] != members:
                return None
        tail = running[n:]
        return tail if tail_ok or not tail else None

    def _drop(self, gone: list[int]) -> None:
        """Members at indices ``gone`` (ascending) leave the batch."""
        bs = len(self.due) if self.due is not None else 0
        for i in reversed(gone):
            req = self.running.pop(i)
            del self.ids[i]
            pos = self.positions.pop(i)
            if bs:
                self.due[(pos - self.step) % bs].remove(req)
            if self._ends is not None:
                step = self._end_of.pop(req.request_id)
                ending = self._ends[step]
                ending.remove(req)
                if not ending:
                    del self._ends[step]

    def join(self, tail: list[Request], out: SchedulerOutput) -> None:
        """After a bulk step: the requests of ``tail`` (those after the members in the running
        list) that this step scheduled as fast-path decodes, right behind the members in
        ``out.decode_ids``, become members, up to the first that did not."""
        ids, positions, due = out.decode_ids, out.decode_positions, self.due
        k, t, bs = len(self.ids), self.step, len(due)
        for req in tail:
            if k >= len(ids) or ids[k] != req.request_id:
                break
            pos = positions[k]
            self.running.append(req)
            self.ids.append(req.request_id)
            self.positions.append(pos)
            due[(pos - t) % bs].append(req)
            if self._ends is not None:  # counted as at a capture now: its own limit, ``t`` steps on
                self._end(req, t + min(req.stop_len, self.max_len) - len(req.token_ids))
            k += 1

    def _evicted_after(
        self, filling: list[Request], plan: FillPlan, evicted: dict[BlockHash, int], opening: list[Request]
    ) -> set[int]:
        """The indices into ``filling`` of the members whose filled block's hash a free block holds
        until an opening after them in the batch evicts it (``evicted``: the hash, the index in
        ``opening`` of the member whose new block evicts it): the per-request path, taking them in
        batch order, found the hash cached and did not register their block."""
        skip: set[int] = set()
        for i, h in zip(plan.at, plan.hashes):
            k = evicted.get(h)
            if k is not None and self.running.index(opening[k]) > self.running.index(filling[i]):
                skip.add(i)
        return skip

    def advance(self, kv: KVCacheManager, out: SchedulerOutput) -> bool:
        """Schedule every member one token further into ``out`` (its ``decode_ids``,
        ``decode_positions``, ``num_scheduled_tokens`` and ``decode_new_blocks``); False, with
        nothing changed, when one at a block boundary cannot stay on the fast path (too few free
        blocks, a shared block): the caller schedules the step per request."""
        t = self.step + 1
        bs = kv.block_size
        reqs = self.running
        if self.due is None:  # the first steady step: its positions are the capture's
            self.due = [[] for _ in range(bs)]
            for req, p in zip(reqs, self.positions):
                self.due[p % bs].append(req)
        positions = list(map(_next, self.positions))
        tables, ref_cnt = kv.tables, kv.pool.ref_cnt
        filling = self.due[(bs - 1 - t) % bs]  # their token fills their block
        opening = []  # ... opens one
        for req in self.due[-t % bs]:
            table = tables[req.request_id]
            idx = req.num_computed_tokens // bs
            if idx == len(table):
                opening.append(req)
            elif idx > len(table) or ref_cnt[table[idx]] != 1:
                return False
        if len(opening) > kv.pool.num_free:
            return False
        plan = kv.plan_fills(filling) if filling else _NO_FILLS  # (checks each has its block to itself)
        if plan is None:
            return False
        skip: set[int] = set()
        if opening:
            evicted = kv.pool.evictions(len(opening))
            if (evicted and plan.loose) or ((plan.at or plan.loose) and kv.lagging(opening)):
                # Which of equal contents the prefix cache keeps depends on the order in which a
                # fill and an eviction (or a late cache) come: each member as the per-request path
                # takes it, in batch order.
                marked, ends = set(map(id, opening)), set(map(id, filling))
                ends |= marked
                blocks = kv.boundary_in_order([r for r in reqs if id(r) in ends], marked)
                filling = []
            else:
                if evicted and plan.at:
                    skip = self._evicted_after(filling, plan, evicted, opening)
                blocks = kv.open_blocks(opening)
            out.decode_new_blocks.update(zip([r.request_id for r in opening], blocks))
        if filling:
            kv.fill_blocks(filling, plan, skip)  # cached once full
        for req, pos in zip(reqs, positions):  # NOTE: every sequence, every steady step
            req.num_computed_tokens = pos + 1
        out.decode_ids = list(self.ids)  # copies: the step's requests after the batch extend them
        out.decode_positions = list(positions)
        out.num_scheduled_tokens.update(dict.fromkeys(self.ids, 1))
        self.positions, self.step = positions, t
        return True
