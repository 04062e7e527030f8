"""``Router.Abort`` of a request between its prefill and its Decode, arriving while the caller's side
(gRPC sending the first token) has the request's task: the abort must not cancel that task there
(the cancel would land in gRPC's send, never reach the router's stream, and gRPC would end the call
with no status: the caller waits for its deadline). The stream ends with an ``abort`` finish, the
prompt's KV held for the Decode is released, and nothing is decoded. Real workers (tiny model),
real gRPC, real Redis."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import grpc
from engine_stack import EngineStack

import router.service as service
from proto import pdserve_pb2 as pb

PROMPT = list(range(3, 60))


def test_abort_while_the_first_token_is_sent_ends_the_stream_with_abort(
    redis_server, tiny_llama, monkeypatch
):
    real = service.caller_stream
    answers: list[bool] = []

    async def caller_stream(router, rid, *args):
        async with aclosing(real(router, rid, *args)) as stream:
            async for msg in stream:
                if msg.HasField("tokens") and not answers:
                    # An Abort RPC (a task of its own) runs while this task is outside the router's
                    # stream, as it is while gRPC sends a message.
                    answers.append(await asyncio.ensure_future(router.abort(rid)))
                yield msg

    monkeypatch.setattr(service, "caller_stream", caller_stream)

    async def main() -> None:
        async with EngineStack(redis_server.url, tiny_llama) as s:
            params = pb.SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
            req = pb.GenerateRequest(request_id="r", prompt_token_ids=PROMPT, params=params)
            kinds, status = [], "OK"
            try:
                async for msg in s.stub.Generate(req, timeout=10):
                    kinds.append(
                        msg.finished.finish_reason if msg.HasField("finished") else msg.WhichOneof("kind")
                    )
            except grpc.aio.AioRpcError as exc:
                status = exc.code().name
            assert (kinds[-1:], status) == (["abort"], "OK"), f"the aborted stream got {kinds}, then {status}"
            assert answers == [True]
            assert kinds.count("tokens") == 1  # the first token only: nothing was decoded
            await s.until_all_free("the aborted request's KV is released on the prefill worker")
            assert s.router.active == 0 and s.router.inflight["d0"].requests == 0

    asyncio.run(main())
