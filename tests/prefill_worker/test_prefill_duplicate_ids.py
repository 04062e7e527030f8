"""A Prefill whose request id names a prompt still being computed is refused (INVALID_ARGUMENT), and
the refusal touches nothing of the first call: it gets its handle. Real gRPC; the engine in-process
and in a process of its own (the transfer backend: the in-process one)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from engine import EngineConfig, SamplingParams
from kv_transfer import InProcessFabric
from prefill_worker.service import serve
from prefill_worker.split import build_prefill_worker
from prefill_worker.worker import PrefillWorkerConfig
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from proto.convert import params_to_proto

BLOCK = 4
NUM_BLOCKS = 160
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [(31 * i + 17 * seed) % 1000 + 3 for i in range(n)]


async def _until(cond, what: str, timeout: float = 30.0) -> None:
    """Poll ``cond`` until it holds; the generous deadline only turns a hang into a failure."""
    deadline = time.monotonic() + timeout
    while not await cond():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("engine_process", [False, True], ids=["in-process", "engine-process"])
def test_a_second_prefill_with_a_computing_prompts_id_is_refused_and_the_first_gets_its_handle(
    tiny_llama, engine_process
):
    # One token per step: the 480-token prompt is computed over hundreds of steps.
    engine = EngineConfig(
        model=str(tiny_llama), block_size=BLOCK, num_blocks=NUM_BLOCKS, max_num_batched_tokens=1
    )
    config = PrefillWorkerConfig(engine, engine_process=engine_process)
    kw = {} if engine_process else {"transfer_factory": InProcessFabric().transfer_factory}
    worker = build_prefill_worker(config, transfer="inprocess", **kw)
    prompt = _prompt(480, 1)

    async def run():
        server, address = await serve(worker)
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.PrefillWorkerStub(channel)

            def call(rid: str, tokens: list[int]):
                request = pb.PrefillRequest(
                    request_id=rid, prompt_token_ids=tokens, params=params_to_proto(GREEDY)
                )
                return stub.Prefill(request, timeout=60)

            async def state() -> pb.EngineStats:
                return (await stub.GetState(pb.GetStateRequest())).stats

            first = asyncio.ensure_future(call("dup", prompt))

            async def computing() -> bool:
                return (await state()).num_running == 1

            await _until(computing, "the first prompt is being computed")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call("dup", _prompt(20, 2))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details() == "request id 'dup' is already in use"
            assert not first.done(), "the first prompt was done before the second call: nothing tested"
            got = await first  # a refusal that cut the first call off left it hanging to its deadline
            assert len(got.handle.block_ids) == -(-len(prompt) // BLOCK)
            assert (await stub.Release(pb.ReleaseRequest(request_id="dup"))).released

            async def all_free() -> bool:
                s = await state()
                return s.num_free_blocks == NUM_BLOCKS and s.num_held_requests == s.num_running == 0

            await _until(all_free, "every block is free")
        await server.stop(0)

    try:
        asyncio.run(run())
    finally:
        worker.stop()
