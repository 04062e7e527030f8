"""The scheduler tests' driver: a scheduler stepped on CPU by a fake runner that also checks, in a
simulated KV cache, that every sequence reads back the KV of its own tokens (so lost swaps, bad copies
or wrong block tables fail).
"""

from __future__ import annotations

import zlib
from collections import defaultdict
from collections.abc import Callable

from engine.fake_runner import FakeRunner
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.scheduler_output import RunnerOutput, SchedulerOutput


def seq_token(seq_id: str, position: int) -> int:
    """Distinct tokens per sequence and position, so two sequences' KV never look alike by chance."""
    return zlib.crc32(f"{seq_id}:{position}".encode()) % 50_000


def make_prompt(rid: str, length: int) -> list[int]:
    return [zlib.crc32(f"{rid}/{j}".encode()) % 50_000 for j in range(length)]


class KVCheckingRunner:
    """``FakeRunner`` plus a simulated KV cache that checks what attention would read.

    A written slot holds a key of the sequence's tokens up to that position (a token's KV depends on
    its whole prefix). Each step applies swap-outs, swap-ins and copies in ``ModelRunner``'s order,
    then every scheduled token's write, then every scheduled sequence reads its whole context back.
    """

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.fake = FakeRunner(seq_token)
        self.gpu: dict[int, dict[int, int]] = defaultdict(dict)
        self.cpu: dict[int, dict[int, int]] = defaultdict(dict)
        self.tokens: dict[str, list[int]] = {}
        self.tables: dict[str, list[int]] = {}
        self.keys: dict[str, list[int]] = {}

    def __call__(self, sched: SchedulerOutput) -> RunnerOutput:
        for src, dst in sched.blocks_to_swap_out:
            self.cpu[dst] = dict(self.gpu[src])
        for src, dst in sched.blocks_to_swap_in:
            self.gpu[dst] = dict(self.cpu[src])
        for src, dst in sched.blocks_to_copy:
            self.gpu[dst] = dict(self.gpu[src])
        for seq_id in sched.finished_seq_ids:
            self.tokens.pop(seq_id, None)
            self.tables.pop(seq_id, None)
        for new in sched.new_seqs:
            self.tokens[new.seq_id] = list(new.token_ids)
            self.tables[new.seq_id] = list(new.block_ids)
            self.keys[new.seq_id] = []
        for seq_id, block in sched.decode_new_blocks.items():
            self.tables[seq_id].append(block)
        for run in sched.running_seqs:
            if run.block_ids is not None:
                self.tables[run.seq_id] = list(run.block_ids)
            else:
                self.tables[run.seq_id].extend(run.new_block_ids)
        bs = self.kv.block_size
        ends: dict[str, int] = {}
        for seq_id, computed, _ in sched.spans():
            table = self.tables[seq_id]
            assert table == self.kv.tables[seq_id], f"runner's block table of {seq_id} is stale"
            end = computed + sched.num_scheduled_tokens[seq_id]
            for pos in range(computed, end):
                self.gpu[table[pos // bs]][pos % bs] = self._key(seq_id, pos)
            ends[seq_id] = end
        for seq_id, end in ends.items():
            table = self.tables[seq_id]
            for pos in range(end):
                block = table[pos // bs]
                assert self.gpu[block].get(pos % bs) == self._key(seq_id, pos), (
                    f"{seq_id} reads wrong KV at position {pos} (block {block})"
                )
        out = self.fake(sched)
        for seq_id, toks in out.sampled.items():
            self.tokens[seq_id].append(toks[0])
        for seq_id, tok in zip(out.repeat_ids or (), out.repeat_tokens or ()):
            self.tokens[seq_id].append(tok)
        return out

    def _key(self, seq_id: str, pos: int) -> int:
        keys, toks = self.keys[seq_id], self.tokens[seq_id]
        while len(keys) <= pos:
            keys.append(hash((keys[-1] if keys else None, toks[len(keys)])))
        return keys[pos]


class Driver:
    """A scheduler, its KV manager and the checking runner, stepped as ``EngineCore.step`` does."""

    def __init__(
        self,
        *,
        num_blocks: int = 64,
        block_size: int = 4,
        max_num_batched_tokens: int = 64,
        max_num_seqs: int = 16,
        policy: str = "fifo",
        num_cpu_blocks: int = 0,
        admission_margin: float = 0.0,
        itl_target_ms: float = 100.0,
        step_seconds: Callable[[SchedulerOutput], float] | None = None,
    ) -> None:
        """``step_seconds(step)``: the duration each step is reported to have taken (the fair
        policy's input); None reports none."""
        self.kv = KVCacheManager(num_blocks, block_size, num_cpu_blocks=num_cpu_blocks)
        self.sched = Scheduler(
            self.kv,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=4096,
            policy=policy,
            admission_margin=admission_margin,
            itl_target_ms=itl_target_ms,
        )
        self.step_seconds = step_seconds
        self.runner = KVCheckingRunner(self.kv)
        self.outputs: dict[tuple[str, int], list[int]] = defaultdict(list)
        self.finish_reasons: dict[tuple[str, int], str] = {}
        self.steps: list[SchedulerOutput] = []
        self._num_added = 0

    def add(
        self,
        rid: str,
        prompt: int | list[int],
        max_tokens: int,
        *,
        n: int = 1,
        priority: int = 0,
    ) -> Request:
        """Add a request arriving after every earlier one; an int ``prompt`` is a length."""
        req = Request(
            rid,
            make_prompt(rid, prompt) if isinstance(prompt, int) else prompt,
            SamplingParams(n=n, max_tokens=max_tokens),
            seed=0,
            eos_token_ids=frozenset(),
            priority=priority,
            arrival_time=float(self._num_added),
        )
        self._num_added += 1
        self.sched.add(req)
        return req

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        scheduled = out.num_scheduled_tokens
        assert out.total_num_scheduled_tokens == sum(scheduled.values())
        assert out.total_num_scheduled_tokens <= self.sched.max_num_batched_tokens
        assert len(scheduled) <= self.sched.max_num_seqs, f"{len(scheduled)} sequences in one step"
        assert all(n > 0 for n in scheduled.values())
        assert all(self.sched.requests[s].status == RequestStatus.RUNNING for s in scheduled)
        for o in self.sched.update(out, self.runner(out)):
            self.outputs[(o.request_id, o.sample_index)].extend(o.new_token_ids)
            if o.finished:
                self.finish_reasons[(o.request_id, o.sample_index)] = o.finish_reason
        if self.step_seconds is not None and self.sched.batching is not None:
            self.sched.batching.observe(out.total_num_scheduled_tokens, self.step_seconds(out))
        self.steps.append(out)
        return out

    def run(self, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return
            self.step()
        raise AssertionError(f"unfinished after {max_steps} steps: {list(self.sched.requests.values())}")

    def step_until_preemption(self, max_steps: int = 100) -> SchedulerOutput:
        for _ in range(max_steps):
            out = self.step()
            if self.sched.num_preemptions:
                return out
        raise AssertionError(f"no preemption in {max_steps} steps")

    def scheduled(self, seq_id: str) -> list[int]:
        """Tokens scheduled for ``seq_id`` in each step so far (0 where it was not scheduled)."""
        return [s.num_scheduled_tokens.get(seq_id, 0) for s in self.steps]

    def assert_drained(self) -> None:
        s = self.sched
        assert not s.has_unfinished() and not s.waiting and not s.running and not s.swapped
        assert s.groups == {}
        assert self.kv.num_free_blocks == self.kv.num_blocks
        assert self.kv.tables == {} and self.kv.cpu_tables == {}
        assert sorted(self.kv.cpu_free) == list(range(self.kv.num_cpu_blocks))
