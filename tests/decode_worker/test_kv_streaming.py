"""KV streamed while the prompt is computed (no gRPC, no NIXL: one in-process fabric).

The prefill worker announces each step's finished blocks (``watch_kv``) and pins them; the decode
worker reads them at once and, given the complete handle, reads only the rest. Output is identical to
the engine alone; early blocks survive the prefill request's abort until released; an aborted or
finished-at-once streamed pull frees every block on both sides.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest
from test_decode_worker import BLOCK, P_BLOCKS, _prompt, collect, pulled_kv, wait_until

from decode_worker.kv_pull import PulledKV, PullState
from decode_worker.worker import DecodeWorker, DecodeWorkerConfig, WorkerUnavailableError
from engine import LLM, EngineConfig, SamplingParams
from kv_transfer import InProcessBackend, InProcessFabric, KVCompat, RemoteKVInfo
from prefill_worker.worker import PrefillWorker, PrefillWorkerConfig

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
CHUNK = 2 * BLOCK  # the prefill worker's step budget: a prompt is computed two blocks per step


class SizedBackend(InProcessBackend):
    """Remembers how many blocks each read moved, in order."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.sizes: list[int] = []

    def start_read(self, remote_agent, remote_block_ids, local_block_ids, notify, timeout_s):
        self.sizes.append(len(local_block_ids))
        return super().start_read(remote_agent, remote_block_ids, local_block_ids, notify, timeout_s)


@dataclasses.dataclass
class Pair:
    p: PrefillWorker
    d: DecodeWorker
    fabric: InProcessFabric
    watch_blocks: int | None = None  # the decode side's watch breaks off once it saw this many blocks

    def final(self, res) -> PulledKV:
        return pulled_kv(self.p, res, "p")

    async def watched(self, rid: str) -> bool:
        return await self.p.loop.run(lambda: rid in self.p._watches)

    async def all_free(self) -> bool:
        p, d = await self.p.stats(), await self.d.stats()
        return (
            p.num_free_blocks == P_BLOCKS
            and p.num_held == 0
            and not self.p.core.kv.pinned
            and d.num_free_blocks == d.num_blocks
            and d.num_running == d.num_transferring == 0
            and await self.d.busy() == 0
        )


@pytest.fixture
def pair(tiny_llama):
    fabric = InProcessFabric()
    p = PrefillWorker(
        PrefillWorkerConfig(
            EngineConfig(
                model=str(tiny_llama), block_size=BLOCK, num_blocks=P_BLOCKS, max_num_batched_tokens=CHUNK
            ),
            lease_seconds=600,  # blocks freed here are freed by the decode side's notification
        ),
        fabric.transfer_factory,
    )

    async def fetch_peer(address: str) -> RemoteKVInfo:
        return p.transfer_info()

    async def watch(address: str, rid: str):
        so_far: list[int] = []
        async for ids, complete in p.watch_kv(rid):
            so_far.extend(ids)
            yield p.transfer_info().agent_name, p.compat.hash(), list(so_far), complete
            if pair.watch_blocks is not None and len(so_far) >= pair.watch_blocks:
                return

    def transfer(core, name: str, compat: KVCompat) -> SizedBackend:
        return SizedBackend(fabric, name, core.runner.kv_cache, compat)

    d = DecodeWorker(
        DecodeWorkerConfig(EngineConfig(model=str(tiny_llama), block_size=BLOCK, num_blocks=64)),
        fetch_peer=fetch_peer,
        transfer_factory=transfer,
        watch_kv=watch,
    )
    p.start()
    d.start()
    yield (pair := Pair(p, d, fabric))
    d.stop()
    p.stop()


def _hold_after_first_step(p: PrefillWorker, gate: threading.Event) -> None:
    """The prefill worker's second step waits for ``gate`` (its first step's blocks are announced)."""
    step, steps = p.core.step, []

    def held_step():
        steps.append(None)
        if len(steps) == 2:
            assert gate.wait(60), "the decode worker never read the first step's blocks"
        return step()

    p.core.step = held_step


def _requested(d: DecodeWorker, rid: str) -> int:
    pull = d.pulls._pulls.get(rid)
    return 0 if pull is None else pull.requested


@pytest.fixture(scope="module")
def engine_alone(tiny_llama):
    llm = LLM(str(tiny_llama), block_size=BLOCK, num_blocks=64)
    return lambda prompt, params=GREEDY: llm.generate([prompt], params, use_tqdm=False)[0].token_ids


def test_prefill_worker_announces_blocks_step_by_step(pair):
    prompt = _prompt(10 * BLOCK + 1, 3)

    async def run():
        batches: list[list[int]] = []
        completes: list[bool] = []

        async def follow():
            async for ids, complete in pair.p.watch_kv("r"):
                batches.append(ids)
                completes.append(complete)

        watcher = asyncio.ensure_future(follow())
        await wait_until(lambda: pair.watched("r"), "the watch to be registered")
        res = await pair.p.prefill("r", prompt, GREEDY)
        await watcher
        # Several announcements, the earlier ones made while the prompt was still being computed
        # (only then are blocks announced in part), together exactly the held blocks, in order.
        assert len(batches) >= 3, batches
        assert [b for batch in batches for b in batch] == res.block_ids
        assert len(batches[0]) < len(res.block_ids)
        assert completes == [False] * (len(batches) - 1) + [True]
        assert await pair.p.release("r")
        await wait_until(pair.all_free, "every block free")

    asyncio.run(run())


@pytest.mark.parametrize("provide_when", ["all_read", "at_once", "watch_broke_off"])
def test_streamed_pull_equals_engine_alone_and_frees_everything(pair, engine_alone, provide_when):
    """``watch_broke_off``: the announcements stop after the first step's blocks, so the complete
    handle's read moves the rest."""
    prompt = _prompt(12 * BLOCK + 3, 5)
    if provide_when == "watch_broke_off":
        pair.watch_blocks = 1
    gate = threading.Event()
    if provide_when == "at_once":  # on a loaded machine the prompt may finish before any early read
        _hold_after_first_step(pair.p, gate)

    async def run():
        stream = pair.d.decode("r", prompt, GREEDY, kv_source="p")
        first = asyncio.Event()
        got: list[int] = []

        async def consume():
            async for out in stream:
                got.extend(out.new_token_ids)
                first.set()

        consumer = asyncio.ensure_future(consume())
        await wait_until(lambda: pair.watched("r"), "the decode worker to watch the prompt")
        prefill = asyncio.ensure_future(pair.p.prefill("r", prompt, GREEDY))
        if provide_when == "at_once":  # the first step's blocks are read before the prompt goes on
            await wait_until(
                lambda: pair.d.loop.run(lambda: _requested(pair.d, "r") > 0), "a block read early"
            )
            gate.set()
        res = await prefill
        if provide_when == "all_read":  # every block was announced before the handle comes
            n = len(res.block_ids)
            await wait_until(
                lambda: pair.d.loop.run(lambda: pair.d.pulls._pulls["r"].requested == n), "all blocks read"
            )
        assert pair.d.provide_kv("r", pair.final(res))
        await consumer
        assert [res.first_token, *got] == engine_alone(prompt)
        stats = await pair.d.transfer_snapshot()
        assert stats.streamed == 1 and stats.failures == stats.recomputed == 0
        assert stats.streamed_bytes > 0
        reads = pair.d.transfer.sizes
        assert sum(reads) == len(res.block_ids) and len(reads) >= 2, reads
        await wait_until(pair.all_free, "every block free on both sides")
        assert pair.p.released["notification"] == 1

    asyncio.run(run())


def test_pinned_blocks_outlive_an_aborted_prefill(pair):
    """Blocks a reader may be copying are not reused when their request is aborted mid-prefill."""
    core = pair.p.core
    prompt = _prompt(10 * BLOCK, 7)

    def run() -> None:
        core.add_request("r", prompt, GREEDY, prefill_only=True)
        core.step()
        core.step()
        pinned = core.expose_computed("r", 0)
        assert len(pinned) == 2 * CHUNK // BLOCK
        assert core.expose_computed("r", len(pinned)) == []  # nothing new until the next step
        core.abort_request("r")
        assert all(core.kv.pool.ref_cnt[b] == 1 for b in pinned)
        assert core.kv.num_free_blocks == P_BLOCKS - len(pinned)
        core.unpin("r")
        assert core.kv.num_free_blocks == P_BLOCKS

    pair.p.loop.call(run).result(timeout=30)


@pytest.mark.parametrize("how", ["aborted", "first_token_ends_it"])
def test_streamed_pull_that_never_decodes_frees_everything(pair, how):
    prompt = _prompt(10 * BLOCK + 2, 9)
    params = GREEDY if how == "aborted" else dataclasses.replace(GREEDY, max_tokens=1)

    async def run():
        task = asyncio.ensure_future(collect(0, pair.d.decode("r", prompt, params, kv_source="p")))
        await wait_until(lambda: pair.watched("r"), "the decode worker to watch the prompt")
        res = await pair.p.prefill("r", prompt, params)
        if how == "aborted":
            await wait_until(
                lambda: pair.d.loop.run(lambda: pair.d.pulls.state_of("r") is PullState.STREAMING),
                "the streamed pull",
            )
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # Without the complete handle the decode side does not free the prompt (another attempt
            # may read it): the router releases it, as it does for any KV no decode took over.
            assert await pair.p.release("r")
        else:
            assert res.finish_reason == "length" and not res.block_ids
            assert pair.d.provide_kv("r", pair.final(res))
            assert await task == [0]  # nothing streamed past the first token
        await wait_until(pair.all_free, "every block free on both sides")

    asyncio.run(run())


def test_an_abort_before_the_handle_came_ends_the_request_at_once(pair):
    """An abort while the prompt is still computed elsewhere ends the stream then, not once the
    prefill returns; a handle provided afterwards is not taken."""
    prompt = _prompt(10 * BLOCK + 2, 11)

    async def run():
        outs = []

        async def consume():
            async for out in pair.d.decode("r", prompt, GREEDY, kv_source="p"):
                outs.append(out)

        consumer = asyncio.ensure_future(consume())
        await wait_until(lambda: pair.watched("r"), "the decode worker to watch the prompt")
        assert await pair.d.abort("r")
        await asyncio.wait_for(consumer, 30)  # ended without any prefill having run
        assert [o.finish_reason for o in outs] == ["abort"]
        res = await pair.p.prefill("r", prompt, GREEDY)
        assert not pair.d.provide_kv("r", pair.final(res))
        assert await pair.p.release("r")  # what the router does with KV no decode took over
        await wait_until(pair.all_free, "every block free on both sides")

    asyncio.run(run())


def test_a_read_that_cannot_start_fails_the_pull_instead_of_skipping_blocks(pair, engine_alone, monkeypatch):
    """The backend refuses the second early read: those blocks are never read, so the pull must fail
    (here: recompute, the default policy) rather than decode over whatever the blocks held."""
    calls = []
    start_read = SizedBackend.start_read

    def refusing(self, *args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("refused")
        return start_read(self, *args)

    monkeypatch.setattr(SizedBackend, "start_read", refusing)
    prompt = _prompt(12 * BLOCK + 3, 13)

    async def run():
        # Stale KV in the decode pool first, so blocks left unread would change the output.
        await collect(0, pair.d.decode("stale", _prompt(40 * BLOCK, 17), GREEDY))
        task = asyncio.ensure_future(collect(0, pair.d.decode("r", prompt, GREEDY, kv_source="p")))
        await wait_until(lambda: pair.watched("r"), "the decode worker to watch the prompt")
        res = await pair.p.prefill("r", prompt, GREEDY)
        await wait_until(lambda: len(calls) >= 2, "the refused read")
        assert pair.d.provide_kv("r", pair.final(res))
        got = await task
        assert [res.first_token, *got[1:]] == engine_alone(prompt)
        stats = await pair.d.transfer_snapshot()
        assert stats.failures == 1 and stats.recomputed == 1
        await wait_until(pair.all_free, "every block free on both sides")

    asyncio.run(run())


def test_a_hand_off_ends_a_stream_still_waiting_for_its_handle(pair):
    """Shutting down, the worker hands a request whose prompt is still computed elsewhere back to the
    router (``WorkerUnavailableError``) instead of holding its stream open until the prefill ends."""
    prompt = _prompt(10 * BLOCK + 2, 19)

    async def run():
        task = asyncio.ensure_future(collect(0, pair.d.decode("r", prompt, GREEDY, kv_source="p")))
        await wait_until(lambda: pair.watched("r"), "the decode worker to watch the prompt")
        await pair.d.hand_off()
        with pytest.raises(WorkerUnavailableError):
            await asyncio.wait_for(task, 30)
        await wait_until(pair.all_free, "every block free on both sides")

    asyncio.run(run())


def test_a_complete_handle_whose_lease_is_over_fails_the_pull_instead_of_reading_the_rest(pair, engine_alone):
    """The owner frees the prompt when its lease ends: blocks left to read then are not read (the
    pull fails: recompute, the default policy), and the owner is told to free the prompt."""
    prompt = _prompt(12 * BLOCK + 3, 23)
    pair.watch_blocks = 1  # the announcements stop early: the complete handle has blocks left to read

    async def run():
        task = asyncio.ensure_future(collect(0, pair.d.decode("r", prompt, GREEDY, kv_source="p")))
        await wait_until(lambda: pair.watched("r"), "the decode worker to watch the prompt")
        res = await pair.p.prefill("r", prompt, GREEDY)
        expired = dataclasses.replace(pair.final(res), lease_expiry_unix=time.time() - 1)
        assert pair.d.provide_kv("r", expired)
        got = await task
        assert [res.first_token, *got[1:]] == engine_alone(prompt)
        assert sum(pair.d.transfer.sizes) < len(res.block_ids), "read the rest after the lease ended"
        stats = await pair.d.transfer_snapshot()
        assert stats.failures == 1 and stats.recomputed == 1
        await wait_until(pair.all_free, "every block free on both sides")
        assert pair.p.released["notification"] == 1

    asyncio.run(run())
