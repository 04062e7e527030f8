"""The prefill worker alone (no gRPC, no NIXL: the in-process transfer backend): the first token is
the engine's, the prompt's blocks are held, and they are freed by the decode side's notification, by
``release``, by lease expiry, or when the caller leaves before its handle; nothing else holds them."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.scheduler_output import SequenceOutput
from kv_transfer import InProcessBackend, InProcessFabric, TransferState
from prefill_worker.worker import PrefillWorker, PrefillWorkerConfig

BLOCK = 4
NUM_BLOCKS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [(31 * i + 17 * seed) % 1000 + 3 for i in range(n)]


async def wait_until(cond: Callable[[], Awaitable[bool]], what: str, timeout: float = 30.0) -> None:
    """Poll ``cond`` until it holds; the generous deadline only turns a hang into a failure."""
    deadline = time.monotonic() + timeout
    while not await cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def all_free(worker: PrefillWorker) -> bool:
    s = await worker.stats()
    return s.num_free_blocks == NUM_BLOCKS and s.num_held == 0 and s.num_running == s.num_waiting == 0


class Gate:
    """Holds the engine thread at a chosen point until the test lets it go."""

    def __init__(self) -> None:
        self.reached, self.proceed = threading.Event(), threading.Event()

    def hold(self) -> None:
        if not self.proceed.is_set():
            self.reached.set()
            self.proceed.wait(30)


class GatedPrefillWorker(PrefillWorker):
    """Stops the engine thread on the request's first output, before or after the worker holds its
    blocks under a lease."""

    gate: Gate
    gate_before_lease: bool

    def _on_output(self, out: SequenceOutput) -> None:
        if self.gate_before_lease:
            self.gate.hold()
        super()._on_output(out)
        if not self.gate_before_lease:
            self.gate.hold()


@pytest.fixture(scope="module")
def engine_alone(tiny_llama):
    return LLM(str(tiny_llama), block_size=BLOCK, num_blocks=64)


@pytest.fixture
def fabric() -> InProcessFabric:
    return InProcessFabric()


@pytest.fixture
def make_worker(tiny_llama, fabric):
    """``make(lease_seconds=30, cls=PrefillWorker, **engine_kw)`` -> a started worker, stopped afterwards."""
    workers: list[PrefillWorker] = []

    def make(lease_seconds: float = 30.0, cls: type[PrefillWorker] = PrefillWorker, **engine_kw):
        engine = EngineConfig(model=str(tiny_llama), block_size=BLOCK, num_blocks=NUM_BLOCKS, **engine_kw)
        worker = cls(PrefillWorkerConfig(engine, lease_seconds=lease_seconds), fabric.transfer_factory)
        workers.append(worker)
        worker.start()
        return worker

    yield make
    for worker in workers:
        worker.stop()


def test_first_token_equals_engine_and_blocks_are_held(make_worker, engine_alone):
    worker = make_worker()
    prompt = _prompt(3 * BLOCK + 2)

    async def run():
        res = await worker.prefill("r", prompt, GREEDY)
        assert res.first_token == engine_alone.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids[0]
        assert len(res.block_ids) == 4 and res.num_tokens == len(prompt) and res.finish_reason is None
        assert res.lease_expiry_unix > time.time()
        s = await worker.stats()
        assert s.num_held == 1 and s.num_free_blocks == NUM_BLOCKS - 4 and s.num_running == 0
        assert await worker.busy() == 1
        assert await worker.release("r")

    asyncio.run(run())


def test_decode_side_read_and_notification_free_the_blocks(make_worker, fabric):
    worker = make_worker()
    kv = torch.zeros_like(worker.core.runner.kv_cache)
    with InProcessBackend(fabric, "decode", kv, worker.compat) as reader:
        reader.add_peer(worker.transfer_info())

        async def run():
            res = await worker.prefill("r", _prompt(2 * BLOCK + 1), GREEDY)
            local = [7, 3, 9]
            h = reader.start_read(worker.transfer_info().agent_name, res.block_ids, local, b"r", timeout_s=30)
            assert reader.poll(h) is TransferState.DONE
            for remote_id, local_id in zip(res.block_ids, local):
                assert torch.equal(kv[local_id], worker.core.runner.kv_cache[remote_id])
            assert kv[local].any()  # real KV was computed, not zeros
            await wait_until(lambda: all_free(worker), "the notification to free the blocks")
            assert worker.released["notification"] == 1
            assert not await worker.release("r")  # already freed: harmless

        asyncio.run(run())


def test_notification_outside_a_read_frees_the_blocks(make_worker, fabric):
    worker = make_worker()
    with InProcessBackend(
        fabric, "decode", torch.zeros_like(worker.core.runner.kv_cache), worker.compat
    ) as d:
        d.add_peer(worker.transfer_info())

        async def run():
            await worker.prefill("r", _prompt(BLOCK + 1), GREEDY)
            d.send_notification(worker.transfer_info().agent_name, b"r")
            await wait_until(lambda: all_free(worker), "the notification to free the blocks")
            assert worker.released == {"notification": 1, "release": 0, "expiry": 0, "abandoned": 0}

        asyncio.run(run())


def test_release_frees_the_blocks_once(make_worker):
    worker = make_worker()

    async def run():
        res = await worker.prefill("r", _prompt(2 * BLOCK), GREEDY)
        assert len(res.block_ids) == 2
        assert await worker.release("r")
        assert await all_free(worker)  # release runs on the engine thread: freed when it returns
        assert not await worker.release("r")
        assert not await worker.release("never-seen")
        assert worker.released["release"] == 1

    asyncio.run(run())


def test_lease_expiry_frees_the_blocks(make_worker):
    worker = make_worker(lease_seconds=0.2)

    async def run():
        res = await worker.prefill("r", _prompt(2 * BLOCK + 3), GREEDY)
        assert len(res.block_ids) == 3
        await wait_until(lambda: all_free(worker), "the lease to expire")
        assert worker.released["expiry"] == 1 and await worker.busy() == 0
        assert (await worker.get_state()).transfer_stats.expired_leases == 1  # /metrics reads this

    asyncio.run(run())


def test_busy_counts_held_leases(make_worker):
    worker = make_worker()

    async def run():
        assert await worker.busy() == 0
        await worker.prefill("a", _prompt(5, 1), GREEDY)
        await worker.prefill("b", _prompt(6, 2), GREEDY)
        assert await worker.busy() == 2
        await worker.release("a")
        assert await worker.busy() == 1
        await worker.release("b")
        assert await worker.busy() == 0 and await all_free(worker)

    asyncio.run(run())


def test_request_finished_by_its_first_token_holds_nothing(make_worker, engine_alone):
    worker = make_worker()
    prompt = _prompt(2 * BLOCK + 1, 3)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    async def run():
        res = await worker.prefill("r", prompt, one)
        assert res.finish_reason == "length" and res.block_ids == [] and res.lease_expiry_unix == 0.0
        assert res.first_token == engine_alone.generate([prompt], one, use_tqdm=False)[0].token_ids[0]
        assert await all_free(worker) and await worker.busy() == 0

    asyncio.run(run())


@pytest.mark.parametrize("gate_before_lease", [True, False], ids=["before-lease", "after-lease"])
def test_caller_cancelled_before_the_handle_frees_everything(make_worker, gate_before_lease):
    """The first token is ready, but the caller is gone before the worker hands out the handle."""
    worker = make_worker(cls=GatedPrefillWorker)
    gate = Gate()
    worker.gate, worker.gate_before_lease = gate, gate_before_lease

    async def run():
        task = asyncio.ensure_future(worker.prefill("r", _prompt(3 * BLOCK), GREEDY))
        assert await asyncio.to_thread(gate.reached.wait, 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.proceed.set()
        await wait_until(lambda: all_free(worker), "the abandoned request's blocks to be freed")
        assert worker.released["abandoned"] == 1 and await worker.busy() == 0

    asyncio.run(run())


def test_caller_cancelled_mid_prefill_frees_everything(make_worker):
    """Chunked prefill (4 tokens a step): the caller leaves after the first chunk has run."""
    worker = make_worker(max_num_batched_tokens=BLOCK)
    gate, seen = Gate(), []

    def hold_mid_prefill() -> None:  # engine thread, after each step
        stats = worker.core.stats()
        if stats.num_running and not gate.proceed.is_set():
            seen.append(stats)
            gate.hold()

    worker.loop.add_tick(hold_mid_prefill)

    async def run():
        task = asyncio.ensure_future(worker.prefill("r", _prompt(4 * BLOCK), GREEDY))
        assert await asyncio.to_thread(gate.reached.wait, 30)
        assert seen[0].num_free_blocks < NUM_BLOCKS and seen[0].num_held == 0  # mid-prefill
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.proceed.set()
        await wait_until(lambda: all_free(worker), "the aborted request's blocks to be freed")
        assert await worker.busy() == 0

    asyncio.run(run())


def test_a_failed_engine_loop_ends_open_watches(make_worker):
    """A KV watch does not outlive its engine: the decode worker following it falls back at once."""
    worker = make_worker()
    worker.config.watch_wait_s = 600

    def broken_step():
        raise RuntimeError("device lost")

    async def run():
        watching = asyncio.ensure_future(_collect_watch(worker, "waiting"))
        await wait_until(lambda: _watched(worker, "waiting"), "the watch is registered")
        worker.core.step = broken_step
        with pytest.raises(RuntimeError):
            await worker.prefill("r", _prompt(5), GREEDY)
        assert await asyncio.wait_for(watching, 30) == []

    asyncio.run(run())


async def _collect_watch(worker, rid: str) -> list:
    return [item async for item in worker.watch_kv(rid)]


async def _watched(worker, rid: str) -> bool:
    return await worker.loop.run(lambda: rid in worker._watches)
