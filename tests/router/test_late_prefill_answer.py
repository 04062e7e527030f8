"""A caller that leaves while its prefill's answer is on its way to the router: the prefill worker has
answered (the prompt's KV is held under a lease) and ignores the cancel of a call it has ended; the
router, which cancelled the call, gets the answer late. It releases that KV at once (DESIGN.md §2.6)
rather than leaving it held until the lease expires. Real workers (tiny model, leases of 10 minutes),
real gRPC, real Redis; the answer is held back in the router's reader of the prefill call stream until
the caller has gone, as a slow network would."""

from __future__ import annotations

import asyncio

import grpc
from engine_stack import EngineStack
from fake_decode_worker import until

from proto import pdserve_pb2 as pb
from proto.socket_stream import SocketCall

PROMPT = list(range(3, 120))


def test_a_prefill_answer_that_crosses_the_callers_cancel_is_released(redis_server, tiny_llama, monkeypatch):
    on_the_way, deliver = asyncio.Event(), asyncio.Event()
    real_read = SocketCall.read

    async def read(self):
        batch = await real_read(self)
        if batch is not grpc.aio.EOF and any(i.WhichOneof("kind") == "prefill" for i in batch.items):
            on_the_way.set()  # the worker answered: its KV is held
            await deliver.wait()
        return batch

    monkeypatch.setattr(SocketCall, "read", read)

    async def main() -> None:
        async with EngineStack(redis_server.url, tiny_llama) as s:
            assert s.view.workers["p0"].streams  # the router's Prefill calls go on its socket stream
            params = pb.SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
            call = s.stub.Generate(pb.GenerateRequest(request_id="r", prompt_token_ids=PROMPT, params=params))

            async def read_all() -> None:
                async for _ in call:
                    pass

            reader = asyncio.ensure_future(read_all())
            await on_the_way.wait()
            call.cancel()  # the caller leaves (a client timeout, a disconnect)
            await asyncio.gather(reader, return_exceptions=True)
            await until(lambda: s.router.active == 0, "the router's stream ended")
            deliver.set()  # the answer reaches the router, its call long cancelled
            await s.until_all_free("the late-answered prompt's KV is released on the prefill worker")
            releases = await s.prefill.loop.run(lambda: dict(s.prefill.held.releases))
            assert releases["release"] == 1 and releases["expiry"] == 0

    asyncio.run(main())
