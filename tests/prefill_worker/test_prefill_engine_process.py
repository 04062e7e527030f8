"""A prefill worker whose engine runs in a process of its own (``engine_process``): real engine
process and pipes, the role's transfer backend inside it (``--transfer inprocess`` here; real NIXL in
tests/e2e/test_engine_process_serving.py).

The first token equals the engine alone's and the prompt's blocks are held under a lease; release,
lease expiry and a leaving caller (held or mid-prefill) free every block, counted by why; a watched
prompt's blocks are announced as its chunks are computed, then the rest with the handle; a watch of
a request that never comes ends empty; a request its first token ends holds nothing; a dead
engine process ends the open watches at once and fails new prefills.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from engine import LLM, EngineConfig, SamplingParams
from prefill_worker.split import SplitPrefillWorker, build_prefill_worker
from prefill_worker.worker import PrefillWorkerConfig

BLOCK = 4
NUM_BLOCKS = 64
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [(31 * i + 17 * seed) % 1000 + 3 for i in range(n)]


async def _until(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.01)


async def _all_free(worker) -> bool:
    s = await worker.stats()
    return s.num_free_blocks == NUM_BLOCKS and s.num_held == 0 and s.num_running == s.num_waiting == 0


@pytest.fixture
def make_worker(tiny_llama):
    made = []

    def make(lease_seconds: float = 30.0, **engine_kw) -> SplitPrefillWorker:
        engine = EngineConfig(model=str(tiny_llama), block_size=BLOCK, num_blocks=NUM_BLOCKS, **engine_kw)
        config = PrefillWorkerConfig(engine, lease_seconds=lease_seconds, engine_process=True)
        w = build_prefill_worker(config, transfer="inprocess")
        assert isinstance(w, SplitPrefillWorker) and w.core is None and w.engine.process.pid != os.getpid()
        made.append(w)
        return w

    yield make
    for w in made:
        w.stop()
        assert w.engine.process.poll() is not None


def test_first_token_held_and_released(make_worker, tiny_llama):
    worker = make_worker()
    prompt = _prompt(3 * BLOCK + 2)
    want = LLM(str(tiny_llama), block_size=BLOCK, num_blocks=64).generate([prompt], GREEDY, use_tqdm=False)

    async def run():
        worker.start()
        res = await worker.prefill("r", prompt, GREEDY)
        assert res.first_token == want[0].token_ids[0]
        assert len(res.block_ids) == 4 and res.num_tokens == len(prompt) and res.finish_reason is None
        assert res.lease_expiry_unix > time.time()
        s = await worker.stats()
        assert s.num_held == 1 and s.num_free_blocks == NUM_BLOCKS - 4
        assert await worker.busy() == 1
        assert (await worker.get_state()).transfer.agent_name == worker.transfer_info().agent_name
        assert await worker.release("r")
        assert await _all_free(worker) and await worker.busy() == 0
        assert not await worker.release("r") and not await worker.release("never-seen")
        assert worker.released["release"] == 1

    asyncio.run(run())


def test_lease_expiry_frees_the_blocks(make_worker):
    worker = make_worker(lease_seconds=0.2)

    async def run():
        worker.start()
        res = await worker.prefill("r", _prompt(2 * BLOCK + 3), GREEDY)
        assert len(res.block_ids) == 3
        await _until(lambda: _all_free(worker), "the lease expired")
        assert (await worker.get_state()).transfer_stats.expired_leases == 1
        assert worker.released["expiry"] == 1 and await worker.busy() == 0

    asyncio.run(run())


def test_request_finished_by_its_first_token_holds_nothing(make_worker):
    worker = make_worker()
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    async def run():
        worker.start()
        res = await worker.prefill("r", _prompt(2 * BLOCK + 1, 3), one)
        assert res.finish_reason == "length" and res.block_ids == [] and res.lease_expiry_unix == 0.0
        assert await _all_free(worker) and await worker.busy() == 0

    asyncio.run(run())


def test_watched_prompt_blocks_come_as_computed_and_a_leaving_caller_frees_them(make_worker):
    """Chunked prefill (one block a step): the watch sees blocks before the handle, then the rest
    with it; a second request's caller leaves mid-prefill and everything is freed."""
    worker = make_worker(max_num_batched_tokens=BLOCK)
    prompt = _prompt(10 * BLOCK + 1)

    async def watch(rid: str) -> list[tuple[list[int], bool]]:
        return [item async for item in worker.watch_kv(rid)]

    async def run():
        worker.start()
        watching = asyncio.ensure_future(watch("r"))
        res = await worker.prefill("r", prompt, GREEDY)
        seen = await watching
        assert len(seen) >= 3 and not any(done for _, done in seen[:-1]) and seen[-1][1]
        assert [b for ids, _ in seen for b in ids] == res.block_ids  # each once, in order
        assert await worker.release("r")

        # 40 blocks, one a step: the caller leaves (the engine process stopped first) as soon as the
        # watch announces the first ones, with some 40 steps to go, so no loaded machine finishes it.
        gone = worker.watch_kv("gone")
        task = asyncio.ensure_future(worker.prefill("gone", _prompt(40 * BLOCK + 1, 5), GREEDY))
        first = await anext(gone)
        await _leave_mid_prefill(worker, task)
        rest = [item async for item in gone]
        await _until(lambda: _all_free(worker), "the abandoned prompt's blocks are freed")
        assert first[0] and not any(done for _, done in [first, *rest])  # it ended without a handle
        assert await worker.busy() == 0

    asyncio.run(run())


async def _leave_mid_prefill(worker, task: asyncio.Task) -> None:
    """The caller of ``task`` leaves while the engine process is stopped, so the abort is in its pipe
    before its next step: on a loaded machine it could otherwise finish the prompt first (CI did)."""
    os.kill(worker.engine.process.pid, signal.SIGSTOP)
    try:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        os.kill(worker.engine.process.pid, signal.SIGCONT)


async def _mid_prefill(worker) -> bool:
    s = await worker.stats()
    return s.num_running == 1 and s.num_free_blocks < NUM_BLOCKS - 2


def test_a_watch_for_a_request_that_never_comes_ends_empty(make_worker):
    worker = make_worker()
    worker.config.watch_wait_s = 0.2

    async def run():
        worker.start()
        assert [item async for item in worker.watch_kv("never")] == []

    asyncio.run(run())


def test_a_dead_engine_process_ends_open_watches_and_fails_new_prefills(make_worker):
    worker = make_worker()
    worker.config.watch_wait_s = 600

    async def run():
        worker.start()
        watching = asyncio.ensure_future(_collect_watch(worker, "waiting"))
        await _until(_sent(worker, "waiting"), "the watch reached the engine process")
        os.kill(worker.engine.process.pid, signal.SIGKILL)
        assert await asyncio.wait_for(watching, 30) == []  # ended, not left hanging
        with pytest.raises(RuntimeError):
            await worker.prefill("late", _prompt(5), GREEDY)

    asyncio.run(run())


async def _collect_watch(worker, rid: str) -> list:
    return [item async for item in worker.watch_kv(rid)]


def _sent(worker, rid: str):
    async def cond() -> bool:  # the watch command was answered: the engine process has the watch
        await worker.stats()
        return rid in worker._split_watches

    return cond


def test_a_newer_reader_of_a_prompt_gets_every_block_once(make_worker):
    """A second WatchKV of a prompt being computed (a decode worker taking over) replaces the first:
    the first ends without the handle, the second gets each block once, in order, then the handle."""
    worker = make_worker(max_num_batched_tokens=BLOCK)
    prompt = _prompt(16 * BLOCK + 1)

    async def run():
        worker.start()
        first: list = []
        second: list = []

        async def read(into: list, rid: str) -> None:
            async for item in worker.watch_kv(rid):
                into.append(item)

        async def first_has_blocks() -> bool:
            return bool(first)

        a = asyncio.ensure_future(read(first, "r"))
        task = asyncio.ensure_future(worker.prefill("r", prompt, GREEDY))
        await _until(first_has_blocks, "the first reader has blocks")
        b = asyncio.ensure_future(read(second, "r"))
        res = await task
        await asyncio.wait_for(asyncio.gather(a, b), 30)
        assert not any(done for _, done in first)
        assert second[-1][1] and [blk for ids, _ in second for blk in ids] == res.block_ids
        assert await worker.release("r") and worker.released["release"] == 1
        assert await _all_free(worker)

    asyncio.run(run())


def test_a_retry_under_the_same_id_after_its_caller_left_is_served(make_worker, tiny_llama):
    """The abandoned request's abort is nobody's output: a retry of the same id, sent right after its
    caller left mid-prefill, gets its own first token."""
    worker = make_worker(max_num_batched_tokens=BLOCK)
    prompt = _prompt(40 * BLOCK + 1, 7)  # 41 steps: polls see it mid-prefill (11 were done unseen)
    want = LLM(str(tiny_llama), block_size=BLOCK, num_blocks=64).generate([prompt], GREEDY, use_tqdm=False)

    async def run():
        worker.start()
        task = asyncio.ensure_future(worker.prefill("x", prompt, GREEDY))
        await _until(lambda: _mid_prefill(worker), "the prompt is partly computed")
        await _leave_mid_prefill(worker, task)
        res = await worker.prefill("x", prompt, GREEDY)
        assert res.first_token == want[0].token_ids[0] and res.finish_reason is None
        assert await worker.release("x") and await _all_free(worker)

    asyncio.run(run())
