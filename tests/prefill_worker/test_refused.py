"""A request the prefill engine refuses (it can never fit) raises ValueError and leaves nothing
behind: no open output stream, no blocks, no lease."""

from __future__ import annotations

import asyncio

import pytest

from engine import EngineConfig, SamplingParams
from kv_transfer import InProcessFabric
from prefill_worker.worker import PrefillWorker, PrefillWorkerConfig


def test_refused_request_leaves_no_stream_and_no_blocks(tiny_llama):
    worker = PrefillWorker(
        PrefillWorkerConfig(EngineConfig(model=str(tiny_llama), block_size=4, num_blocks=8)),
        InProcessFabric().transfer_factory,
    )
    worker.start()

    async def main() -> None:
        with pytest.raises(ValueError):  # 100 tokens cannot fit in 8 blocks of 4
            await worker.prefill("big", list(range(3, 103)), SamplingParams(temperature=0, max_tokens=2))
        assert not worker.loop.has_stream("big")
        assert await worker.busy() == 0
        assert (await worker.stats()).num_free_blocks == 8

    try:
        asyncio.run(main())
    finally:
        worker.stop()


def test_a_request_the_model_cannot_satisfy_fails_as_the_requests_own_fault(tiny_llama):
    """The word-level tiny tokenizer has no "{": a json_object grammar allows none of its tokens. The
    prefill ends with ``RequestFailed`` (FAILED_PRECONDITION on the wire, which the router never
    retries on another worker), not as a worker failure, and frees its blocks."""
    from engine.sampling_params import StructuredOutput
    from worker.runtime import RequestFailed

    worker = PrefillWorker(
        PrefillWorkerConfig(EngineConfig(model=str(tiny_llama), block_size=4, num_blocks=16)),
        InProcessFabric().transfer_factory,
    )
    worker.start()
    params = SamplingParams(temperature=0, max_tokens=4, structured=StructuredOutput("json_object"))

    async def main() -> None:
        with pytest.raises(RequestFailed, match="grammar allows none"):
            await worker.prefill("json", [5, 6, 7, 8], params)
        assert worker.loop.failure is None and await worker.busy() == 0
        assert (await worker.stats()).num_free_blocks == 16

    try:
        asyncio.run(main())
    finally:
        worker.stop()
