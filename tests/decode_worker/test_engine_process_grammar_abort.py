"""An abort that reaches the engine process while a request's grammar still compiles (the add parked
on the compiler thread, seconds for a new schema) ends every sample with ``abort`` and answers the
add, as the engine ends a request it has. The add used to be dropped unanswered: the worker waited
for its reply forever, the stream never ended (the router took the abort for done), and with n > 1
only sample 0 would have ended anyway."""

from __future__ import annotations

import asyncio
import json

import pytest

from decode_worker.split import build_decode_worker
from decode_worker.worker import DecodeWorkerConfig, Progress
from engine import EngineConfig, SamplingParams
from engine.sampling_params import StructuredOutput

BLOCKS = 256


def _schema(title: str) -> str:
    """A schema no engine has compiled yet (its title), slow to compile: the abort lands meanwhile."""
    fields = {f"field_{i}": {"type": "string", "pattern": "^[a-z]{2,8}[0-9]{1,3}$"} for i in range(20)}
    return json.dumps({"title": title, "type": "object", "properties": fields, "required": sorted(fields)})


@pytest.mark.parametrize("n", [1, 2])
def test_an_abort_while_the_grammar_compiles_ends_every_sample(byte_level_model, n):
    engine = EngineConfig(model=str(byte_level_model), block_size=4, num_blocks=BLOCKS)
    w = build_decode_worker(DecodeWorkerConfig(engine, engine_process=True, keepalive_s=0), transfer="none")
    params = SamplingParams(
        temperature=0.8,
        seed=1,
        n=n,
        max_tokens=50,
        structured=StructuredOutput("json_schema", _schema(f"abort-while-compiling-{n}")),
    )

    async def main() -> tuple[bool, dict[int, str], list[int]]:
        await w.serve(lambda server: None)  # its engine's events read on this loop
        finishes: dict[int, str] = {}

        async def consume() -> None:
            async for out in w.decode("r", [5, 6, 7, 8], params):
                if not isinstance(out, Progress) and out.finish_reason:
                    finishes[out.sample_index] = out.finish_reason

        task = asyncio.ensure_future(consume())
        while not w.loop.has_stream("r"):  # the add goes out in the turn its stream opens
            await asyncio.sleep(0)
        aborted = await w.abort("r")
        await asyncio.wait_for(task, timeout=60)  # before the fix: never ends
        while (await w.stats()).num_free_blocks != BLOCKS:
            await asyncio.sleep(0.01)
        unanswered = sorted(w.engine._pending)
        await w.server.stop(0)
        return aborted, finishes, unanswered

    try:
        aborted, finishes, unanswered = asyncio.run(main())
    finally:
        w.stop()
    assert aborted and finishes == dict.fromkeys(range(n), "abort") and unanswered == []
