"""Two live processes of one decode worker id (a replacement started while the old one was stopped,
then the old one continued): when the old incarnation hands its request off, the request resumes on
the replacement, token for token. The router excluded the lost worker by its id, and with it the
replacement: 503 "no other decode worker is available" while a healthy one served."""

from __future__ import annotations

import asyncio
import threading

from fake_decode_worker import until
from test_migration import GREEDY, NUM_BLOCKS, Stream, running

from decode_worker.service import serve as serve_decode
from decode_worker.worker import DecodeWorker, DecodeWorkerConfig
from engine import EngineConfig
from kv_transfer import InProcessFabric
from router.migration import MigrationOptions


def test_a_request_handed_off_by_a_replaced_incarnation_resumes_on_its_replacement(redis_server, tiny_llama):
    async def main() -> None:
        no_stalls = MigrationOptions(stall_floor_s=60.0)  # the old engine is held below, on purpose
        async with running(redis_server, tiny_llama, no_stalls, num_decode=1) as stack:
            want = await Stream(stack, "ref", GREEDY).result()
            await stack.all_free()
            old = stack.workers[0]
            gate, step = threading.Event(), old.core.step

            def held_step():  # the old engine waits until its replacement is registered
                gate.wait(60)  # (bounded: a test that never opens it fails, it does not hang)
                return step()

            s = Stream(stack, "r", GREEDY)
            await until(lambda: len(s.tokens) >= 4, "a few tokens streamed")
            old.core.step = held_step
            new = DecodeWorker(
                DecodeWorkerConfig(
                    EngineConfig(model=str(tiny_llama), block_size=4, num_blocks=NUM_BLOCKS),
                    worker_id="d0",
                    redis_url=redis_server.url,
                    keepalive_s=0.1,
                ),
                fetch_peer=None,
                transfer_factory=InProcessFabric().transfer_factory,
            )
            try:
                await serve_decode(new)
                await until(lambda: stack.view.workers["d0"].epoch == new.epoch, "the replacement is d0")
                gate.set()
                await old.shutdown(grace_s=5)  # hands the request off
                assert old.core.stats().num_free_blocks == NUM_BLOCKS  # the handed-off request freed its
                assert await s.result() == want and s.finished.finish_reason == "length"
                assert stack.router.stats.migrations == 1 and "d0" not in stack.router.suspects
                await stack.all_free([new])
            finally:
                gate.set()
                await new.shutdown(0)

    asyncio.run(main())
