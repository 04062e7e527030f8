"""The router makes one channel and one stub per worker address and keeps them: a stub built per
request builds a callable for every method of its service each time."""

from __future__ import annotations

import asyncio

from router.worker_stubs import WorkerStubs


def test_a_workers_channel_and_stubs_are_made_once():
    async def run():
        stubs = WorkerStubs()
        decode, prefill = stubs.decode("127.0.0.1:1"), stubs.prefill("127.0.0.1:1")
        assert stubs.decode("127.0.0.1:1") is decode and stubs.prefill("127.0.0.1:1") is prefill
        assert stubs.channel("127.0.0.1:1") is stubs.channel("127.0.0.1:1")
        assert stubs.decode("127.0.0.1:2") is not decode
        assert stubs.channel("127.0.0.1:2") is not stubs.channel("127.0.0.1:1")
        await stubs.close()

    asyncio.run(run())
