"""An Abort (the router's, or any caller's) ends the request's stream with finish reason ``abort``
and frees its blocks: for a request decoding in the batch, and for a pull still waiting for room.
No gRPC, no NIXL: the decode worker alone with the in-process transfer backend."""

from __future__ import annotations

import asyncio
import time

from decode_worker.kv_pull import PulledKV, PullState
from decode_worker.worker import DecodeWorker, DecodeWorkerConfig
from engine import EngineConfig, SamplingParams
from kv_transfer import InProcessFabric

LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


async def _until(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.01)


def _worker(tiny_llama, num_blocks: int) -> DecodeWorker:
    fabric = InProcessFabric()
    config = DecodeWorkerConfig(EngineConfig(model=str(tiny_llama), block_size=4, num_blocks=num_blocks))
    worker = DecodeWorker(config, fetch_peer=None, transfer_factory=fabric.transfer_factory)
    worker.start()
    return worker


def test_abort_ends_a_decoding_stream_with_finish_reason_abort(tiny_llama):
    worker = _worker(tiny_llama, num_blocks=256)

    async def main() -> None:
        outs = []

        async def consume() -> None:
            async for out in worker.decode("r", list(range(3, 23)), LONG):
                outs.append(out)

        task = asyncio.create_task(consume())
        await _until(lambda: _true(len(outs) >= 3), "a few tokens streamed")
        assert await worker.abort("r")
        await asyncio.wait_for(task, 30)  # the stream ends by itself: nobody cancels it
        assert outs[-1].finish_reason == "abort"
        assert sum(len(o.new_token_ids) for o in outs) < LONG.max_tokens
        stats = await worker.stats()
        assert stats.num_free_blocks == 256 and stats.num_running == 0

    try:
        asyncio.run(main())
    finally:
        worker.stop()


def test_abort_ends_a_pull_waiting_for_room(tiny_llama):
    worker = _worker(tiny_llama, num_blocks=30)
    worker._peers["p-agent"] = "127.0.0.1:1"  # as if the peer were connected (no read starts: no room)
    prompt = list(range(200, 240))  # 10 blocks, none of them cached here
    kv = PulledKV("p-agent", "127.0.0.1:1", list(range(10)), len(prompt), worker.compat.hash(), 7, None, 1)
    short = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def main() -> None:
        # 25 of the 30 blocks held (a prefilled prompt kept for a peer) until released below.
        await worker.loop.run(
            lambda: worker.core.add_request("hold", list(range(3, 103)), short, prefill_only=True)
        )
        await _until(lambda: _true(worker.core.stats().num_held == 1), "the blocks are held")
        outs = []

        async def consume() -> None:
            async for out in worker.decode("w", prompt, short, kv=kv):
                outs.append(out)

        task = asyncio.create_task(consume())

        async def waiting() -> bool:
            return await worker.loop.run(lambda: worker.pulls.state_of("w")) is PullState.WAITING_FOR_ROOM

        await _until(waiting, "the pull waits for room")
        assert await worker.abort("w")
        await asyncio.wait_for(task, 30)
        assert [o.finish_reason for o in outs] == ["abort"]
        await worker.loop.run(lambda: worker.core.release_held("hold"))
        assert await worker.busy() == 0
        assert (await worker.stats()).num_free_blocks == 30

    try:
        asyncio.run(main())
    finally:
        worker.stop()


async def _true(value: bool) -> bool:
    return value
