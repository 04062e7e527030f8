"""A Decode whose request id is already streaming on the worker is refused (``invalid_argument``), and
the refusal touches nothing of the running call: it keeps its tokens coming and finishes. Real gRPC;
the engine in-process and in a process of its own."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from decode_worker.service import serve
from decode_worker.split import build_decode_worker
from decode_worker.worker import DecodeWorkerConfig
from engine import EngineConfig, SamplingParams
from kv_transfer import InProcessFabric
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from proto.convert import params_to_proto

BLOCKS = 128
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


async def _until(cond, what: str, timeout: float = 30.0) -> None:
    """Poll ``cond`` until it holds; the generous deadline only turns a hang into a failure."""
    deadline = time.monotonic() + timeout
    while not await cond():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.01)


class _Call:
    """One Decode call over gRPC: its tokens, and how it ended (a finish reason or an in-band error)."""

    def __init__(self, stub, rid: str, prompt: list[int], params: SamplingParams) -> None:
        self.tokens: list[int] = []
        self.end: str | None = None
        request = pb.DecodeRequest(request_id=rid, prompt_token_ids=prompt, params=params_to_proto(params))
        self.task = asyncio.ensure_future(self._run(stub.Decode(request)))

    async def _run(self, call) -> None:
        async for msg in call:
            kind = msg.WhichOneof("kind")
            if kind == "tokens":
                self.tokens.extend(msg.tokens.token_ids)
            elif kind == "finished":
                self.end = msg.finished.finish_reason
            elif kind == "error":
                self.end = f"{msg.error.code}: {msg.error.message}"


@pytest.mark.parametrize("engine_process", [False, True], ids=["in-process", "engine-process"])
def test_a_second_decode_with_a_running_ones_id_is_refused_and_the_first_goes_on(tiny_llama, engine_process):
    engine = EngineConfig(model=str(tiny_llama), block_size=4, num_blocks=BLOCKS)
    config = DecodeWorkerConfig(engine, engine_process=engine_process, keepalive_s=0)
    kw = {} if engine_process else {"transfer_factory": InProcessFabric().transfer_factory}
    worker = build_decode_worker(config, transfer="none", **kw)

    async def run():
        server, address = await serve(worker)
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.DecodeWorkerStub(channel)
            first = _Call(stub, "dup", list(range(3, 23)), LONG)

            async def streaming() -> bool:
                return len(first.tokens) > 0

            await _until(streaming, "the first call streams")
            second = _Call(stub, "dup", list(range(40, 50)), SamplingParams(max_tokens=5))
            await asyncio.wait_for(second.task, 30)
            assert not first.task.done(), "the first call ended before the second came: nothing tested"
            assert second.end == "invalid_argument: request id 'dup' is already in use"
            assert second.tokens == []

            async def first_ended() -> bool:
                return first.task.done()

            await _until(first_ended, "the first call ends (the second must not cut it off)")
            first.task.result()
            assert first.end == "length" and len(first.tokens) == LONG.max_tokens

            async def all_free() -> bool:
                s = (await stub.GetState(pb.GetStateRequest())).stats
                return s.num_free_blocks == BLOCKS and s.num_running == s.num_waiting == 0

            await _until(all_free, "every block is free")
        await server.stop(0)

    try:
        asyncio.run(run())
    finally:
        worker.stop()
