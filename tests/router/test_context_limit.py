"""The router's gRPC API is public: a prompt no worker can hold (a million tokens is 1.4 MB, under
gRPC's 4 MB limit) is refused there with INVALID_ARGUMENT, before it is hashed or routed (hashing
and recording it cost the router's event loop seconds, every stream on it stalled meanwhile), as is a
prompt whose max_tokens pass the context. The bound is the context length the decode workers publish
in their records. Real workers (tiny model, a context of 512 tokens), real gRPC, real Redis."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest
from engine_stack import EngineStack

from proto import pdserve_pb2 as pb
from registry.schema import WorkerRecord
from router.service import check_context

CONTEXT = 512  # the tiny model's


async def _status(stub, prompt: list[int], max_tokens: int) -> tuple[str, str]:
    params = pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    req = pb.GenerateRequest(request_id=f"n{len(prompt)}", prompt_token_ids=prompt, params=params)
    try:
        async for _ in stub.Generate(req, timeout=60):
            pass
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, exc.details()
    return "OK", ""


def test_a_request_past_the_context_is_refused_before_it_is_routed(redis_server, tiny_llama):
    async def main() -> None:
        async with EngineStack(redis_server.url, tiny_llama) as s:
            assert {w.max_model_len for w in s.view.live_workers()} == {CONTEXT}  # published
            code, details = await _status(s.stub, [(i % 200) + 3 for i in range(1_000_000)], 8)
            assert code == "INVALID_ARGUMENT" and f"context length of {CONTEXT} tokens" in details
            code, details = await _status(s.stub, list(range(3, 503)), 20)
            assert (code, details) == (
                "INVALID_ARGUMENT",
                f"prompt (500 tokens) + max_tokens (20) = 520 exceeds the model's context length of {CONTEXT} tokens",
            )
            assert s.router.stats.requests == 0, "a request past the context was routed to the workers"
            assert not s.router.decisions
            assert await _status(s.stub, list(range(3, 403)), 12) == ("OK", "")  # within it: served
            await s.until_all_free("the served request's KV is freed")

    asyncio.run(main())


def test_no_bound_while_a_decode_worker_publishes_no_context():
    def view(*lengths: int) -> SimpleNamespace:
        workers = [WorkerRecord(f"d{i}", "decode", "-", 1, max_model_len=n) for i, n in enumerate(lengths)]
        return SimpleNamespace(live_workers=lambda role: workers)

    check_context(10_000, 8, view(512, 0))  # a worker of an older version: the workers check
    check_context(10_000, 8, view())  # none registered: routing says so
    check_context(1000, 24, view(512, 1024))  # the largest context any decode worker serves
    with pytest.raises(ValueError, match="1024 tokens"):
        check_context(1000, 25, view(512, 1024))
    with pytest.raises(ValueError, match="leaves no room"):
        check_context(1024, None, view(1024))
