"""The worker writes its engine process's commands without ever waiting on the pipe: with the
engine not reading (busy in a long step, or stopped), commands past the pipe's buffer wait in the
worker and go out as it drains, in order, while the worker's event loop runs on. The write was
blocking: the loop froze, and deadlocked with an engine process blocked writing its events (each
waiting for the other to read); a stop from another thread then waited forever."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

from engine import EngineConfig, SamplingParams
from worker.engine_client import EngineProcess

ADDS = 24
PROMPT = 20_000  # tokens, 3 bytes each on the wire: 60 KB an add, 1.4 MB in all, past the 1 MiB pipe
BIG_ID = 1 << 20  # (out of the vocabulary: the engine refuses each add, after reading it whole)


def test_commands_past_the_pipe_wait_in_the_worker_and_its_loop_runs_on(tiny_llama):
    engine = EngineProcess(EngineConfig(model=str(tiny_llama), num_blocks=64, block_size=16))
    rescued = threading.Event()

    def rescue_after(seconds: float, started: threading.Event) -> None:
        """Continue the engine if the loop stayed stuck in a write (the old behaviour): the test
        then fails on ``rescued`` instead of hanging."""
        if not started.wait(seconds):
            rescued.set()
            os.kill(engine.process.pid, signal.SIGCONT)

    async def scenario() -> list:
        engine.start()
        os.kill(engine.process.pid, signal.SIGSTOP)  # it reads no command until continued
        params = SamplingParams(max_tokens=1)
        loop_ran = threading.Event()
        threading.Thread(target=rescue_after, args=(20.0, loop_ran), daemon=True).start()
        adds = [
            asyncio.ensure_future(engine.add_request(f"r{i}", [BIG_ID + i] * PROMPT, params))
            for i in range(ADDS)
        ]
        await asyncio.sleep(0.05)  # the loop runs on: the adds wait in the worker, not in a write
        loop_ran.set()
        assert engine._commands._unsent  # the pipe is full: the rest waits its turn
        os.kill(engine.process.pid, signal.SIGCONT)
        return await asyncio.gather(*adds, return_exceptions=True)

    try:
        results = asyncio.run(scenario())
    finally:
        os.kill(engine.process.pid, signal.SIGCONT)
    # Every command arrived whole and in order, and was answered (its tokens out of the vocabulary:
    # refused by the engine itself).
    assert not rescued.is_set(), "the worker's loop blocked writing to a full command pipe"
    assert len(results) == ADDS and all(isinstance(r, ValueError) for r in results), results[:2]
    t0 = time.monotonic()
    engine.stop(10)  # from this thread, the loop gone: it returns
    assert engine.process.poll() is not None and time.monotonic() - t0 < 15
