"""A steady decode batch, scheduled and updated in bulk rather than one sequence at a time.

When every running request was a fast-path decode last step (``Scheduler._schedule_running``: one
token into its own block) and the running list has not changed since, this step schedules each of
them one position further, and only the requests at a block boundary need a look: the one whose
token fills its block (cached once full) and the one whose token opens the next. Positions advance
by one per step, so those are found by residue (``due``), not by visiting all. Everything the
per-request fast path checks is then either fixed for the batch (not speculating, no forks owed,
known to the runner) or guarded: the running list equal to the captured one (the same requests,
all still running, in order), the token budget, and ``horizon`` (no request reaches a length
where an overlapped step would hold it back). Any other case takes the per-request path, which
captures a new batch when it again finds every running request on the fast path.

``update`` has the same shape on its side (``StepResults._update_steady``): a steady batch's
samples are appended in one loop; only a batch with a stop token, or one reaching a length limit,
takes the per-request checks.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.scheduler_output import SchedulerOutput

_next = (1).__add__


@dataclass(slots=True)
class SteadyDecodes:
    running: list[Request]  # the scheduler's running list when captured (a copy)
    ids: list[str]
    positions: list[int]  # the last step's
    max_len: int
    length: int  # the first request's token count at the capture (every list grows in step with it)
    step: int = 0  # steps after the capture
    # By the capture positions' residue mod the block size: request indices. Built by the first
    # ``advance`` (a batch that changes before its next step, as under churn, never pays for it).
    due: list[list[int]] | None = None
    _horizon: int | None = None

    @classmethod
    def capture(
        cls, running: list[Request], ids: list[str], positions: list[int], max_len: int
    ) -> SteadyDecodes:
        """From a step that scheduled every request of ``running``, in order, as a fast-path decode
        (``ids``, at ``positions``)."""
        return cls(list(running), list(ids), list(positions), max_len, len(running[0].token_ids))

    @property
    def horizon(self) -> int:
        """Steps after the capture before a request may reach a length limit (found once, counted
        from the capture: the lists have grown since by as much as the first one has)."""
        if self._horizon is None:
            reqs = self.running
            grown = len(reqs[0].token_ids) - self.length
            self._horizon = min(min(r.stop_len, self.max_len) - len(r.token_ids) for r in reqs) + grown
        return self._horizon

    def advance(self, kv: KVCacheManager, out: SchedulerOutput) -> bool:
        """Schedule every request one token further into ``out`` (its ``decode_ids``,
        ``decode_positions``, ``num_scheduled_tokens`` and ``decode_new_blocks``); False, with
        nothing changed, when one at a block boundary cannot stay on the fast path (too few free
        blocks, a shared block): the caller schedules the step per request."""
        t = self.step + 1
        bs = kv.block_size
        reqs = self.running
        if self.due is None:  # the first steady step: its positions are the capture's
            self.due = [[] for _ in range(bs)]
            for i, p in enumerate(self.positions):
                self.due[p % bs].append(i)
        positions = list(map(_next, self.positions))
        tables, ref_cnt = kv.tables, kv.pool.ref_cnt
        filling = [reqs[i] for i in self.due[(bs - 1 - t) % bs]]  # their token fills their block
        for req in filling:
            table = tables[req.request_id]
            idx = req.num_computed_tokens // bs
            if idx >= len(table) or ref_cnt[table[idx]] != 1:
                return False
        opening = []  # ... opens one
        for req in (reqs[i] for i in self.due[-t % bs]):
            table = tables[req.request_id]
            idx = req.num_computed_tokens // bs
            if idx == len(table):
                opening.append(req)
            elif idx > len(table) or ref_cnt[table[idx]] != 1:
                return False
        if opening:
            blocks = kv.open_blocks(opening)
            if blocks is None:
                return False
            out.decode_new_blocks.update(zip([r.request_id for r in opening], blocks))
        kv.fill_blocks(filling)  # cached once full
        for req, pos in zip(reqs, positions):  # NOTE: every sequence, every steady step
            req.num_computed_tokens = pos + 1
        out.decode_ids = list(self.ids)
        out.decode_positions = positions
        out.num_scheduled_tokens.update(dict.fromkeys(self.ids, 1))
        self.positions, self.step = positions, t
        return True
