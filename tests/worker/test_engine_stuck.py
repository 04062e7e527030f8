"""An engine process hung between steps (SIGSTOP stands in for a hang in a transfer poll, a blocked
write or a command) while a request waits on it counts as stuck, so a replica's health check fails
after ``engine_stuck_timeout_s``; an idle engine is never blamed, and once it runs again the request
completes, the stall clears and every KV block is free."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from deploy.config import PDServeConfig
from deploy.deployments import DecodeServer
from engine import EngineConfig, SamplingParams
from worker.engine_client import EngineProcess


class _Worker:  # what a replica's health check reads of its worker
    worker_id = "decode-hung"

    def __init__(self, loop: EngineProcess) -> None:
        self.loop = loop


async def _until(condition, what, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what()
        await asyncio.sleep(0.05)


def test_a_hung_engine_process_with_a_waiting_request_fails_the_health_check(tiny_llama):
    probe = type("Probe", (DecodeServer.func_or_class,), {"__del__": lambda self: None})
    replica = probe.__new__(probe)
    replica.config = PDServeConfig(model="m", engine_stuck_timeout_s=1.0)

    async def scenario() -> None:
        engine = EngineProcess(EngineConfig(model=str(tiny_llama), num_blocks=64, block_size=16))
        engine.start()
        replica.worker = _Worker(engine)
        blocks = (await engine.stats()).num_free_blocks
        stopped = False
        try:
            os.kill(engine.process.pid, signal.SIGSTOP)
            stopped = True
            assert engine.stuck_for() == 0.0  # idle: nothing waits on it
            await replica.check_health()
            outputs = engine.open_stream("r1")
            params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
            add = asyncio.ensure_future(engine.add_request("r1", list(range(10, 60)), params))
            await _until(
                lambda: engine.stuck_for() > 1.0,
                lambda: (
                    f"a request waited on a hung engine, stuck_for stayed {engine.stuck_for():.2f}s "
                    f"(blocked for {engine.blocked_for():.2f}s)"
                ),
            )
            assert not add.done()
            with pytest.raises(RuntimeError, match="engine loop made no progress"):
                await replica.check_health()
            os.kill(engine.process.pid, signal.SIGCONT)
            stopped = False
            await add
            finished = None
            while finished is None:
                out = await asyncio.wait_for(outputs.get(), 60)
                finished = out.finish_reason
            engine.close_stream("r1")
            assert finished == "length"
            await _until(lambda: engine.stuck_for() < 1.0, lambda: "the stall did not clear")
            await replica.check_health()
            assert (await engine.stats()).num_free_blocks == blocks
        finally:
            if stopped:
                os.kill(engine.process.pid, signal.SIGCONT)
            engine.stop(10)

    asyncio.run(scenario())
