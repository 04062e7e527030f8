"""An engine step that raises fails the worker at once, not after a health check: every open stream
ends with ``WorkerUnavailableError`` naming the failure (the router resumes them elsewhere), a new
request is refused, the engine loop is no longer alive (the deployment's health check fails) and
the worker leaves the registry. A worker shut down with requests running hands them off the same
way instead of cutting their streams. The decode worker alone, real engine, real Redis."""

from __future__ import annotations

import asyncio
import time

import pytest

from decode_worker.worker import DecodeWorker, DecodeWorkerConfig, Progress, WorkerUnavailableError
from engine import EngineConfig, SamplingParams
from kv_transfer import InProcessFabric
from registry.schema import connect, read_workers

LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


async def _until(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.01)


def _worker(tiny_llama, redis_url: str | None = None) -> DecodeWorker:
    config = DecodeWorkerConfig(
        EngineConfig(model=str(tiny_llama), block_size=4, num_blocks=256), redis_url=redis_url
    )
    return DecodeWorker(config, fetch_peer=None, transfer_factory=InProcessFabric().transfer_factory)


class _Consumer:
    """Reads one decode stream in the background: its outputs and how it ended."""

    def __init__(self, worker: DecodeWorker, rid: str, prompt: list[int], params=LONG, **kw) -> None:
        self.tokens: list[int] = []
        self.progress: list[Progress] = []
        self.error: BaseException | None = None
        self.task = asyncio.ensure_future(self._run(worker.decode(rid, prompt, params, **kw)))

    async def _run(self, stream) -> None:
        try:
            async for out in stream:
                if isinstance(out, Progress):
                    self.progress.append(out)
                else:
                    self.tokens.extend(out.new_token_ids)
        except Exception as exc:
            self.error = exc


def test_engine_step_raising_fails_streams_at_once_and_leaves_the_registry(tiny_llama, redis_server):
    worker = _worker(tiny_llama, redis_server.url)

    async def main() -> None:
        await worker.serve(lambda server: None)  # registers once serving
        try:
            await body()
        finally:
            await worker.server.stop(0)

    async def body() -> None:
        client = connect(redis_server.url)
        await _until(lambda: list(read_workers(client)) == ["decode-0"], "registered")
        streams = [_Consumer(worker, f"r{i}", list(range(3 + i, 23 + i))) for i in range(2)]
        await _until(lambda: all(len(s.tokens) >= 2 for s in streams), "both streams decode")
        real_step = worker.core.step

        def broken_step():
            real_step()
            raise RuntimeError("injected scheduler fault")

        worker.core.step = broken_step
        await asyncio.wait_for(asyncio.gather(*(s.task for s in streams)), 30)
        for s in streams:
            assert isinstance(s.error, WorkerUnavailableError), s.error
            assert "engine step failed: RuntimeError: injected scheduler fault" in str(s.error)
            assert len(s.tokens) < LONG.max_tokens
        assert not worker.loop.alive  # what the deployment's health check looks at
        with pytest.raises(WorkerUnavailableError):
            async for _ in worker.decode("late", [5, 6, 7], LONG):
                pass
        await _until(lambda: not read_workers(client), "the worker left the registry")
        assert not await worker.drain(timeout_s=5)  # nothing to wait for: its streams already failed

    try:
        asyncio.run(main())
    finally:
        worker.stop()


def test_shutdown_hands_running_requests_off(tiny_llama):
    worker = _worker(tiny_llama)
    worker.start()

    async def main() -> None:
        s = _Consumer(worker, "h", list(range(3, 23)), keepalive_s=0.2)
        await _until(lambda: len(s.tokens) >= 2, "the stream decodes")
        await worker.hand_off()
        await asyncio.wait_for(s.task, 30)
        assert isinstance(s.error, WorkerUnavailableError) and "shutting down" in str(s.error)
        stats = await worker.stats()
        assert stats.num_free_blocks == 256 and stats.num_running == 0
        with pytest.raises(WorkerUnavailableError):
            async for _ in worker.decode("late", [5, 6, 7], LONG):
                pass

    try:
        asyncio.run(main())
    finally:
        worker.stop()


def test_a_quiet_stream_carries_progress_while_the_engine_is_busy(tiny_llama):
    """A request queued behind another (one sequence at a time) is silent for as long as the first
    runs, but its stream says the engine is alive: Progress with the engine's step time."""
    config = DecodeWorkerConfig(
        EngineConfig(model=str(tiny_llama), block_size=4, num_blocks=256, max_num_seqs=1)
    )
    worker = DecodeWorker(config, fetch_peer=None, transfer_factory=InProcessFabric().transfer_factory)
    worker.start()

    async def main() -> None:
        first = _Consumer(worker, "a", list(range(3, 23)))
        await _until(lambda: len(first.tokens) >= 1, "the first request runs")
        short = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        queued = _Consumer(worker, "b", list(range(30, 50)), short, keepalive_s=0.05)
        await _until(lambda: len(queued.progress) >= 3, "the queued stream got keepalives")
        assert not queued.tokens and all(p.step_s > 0 for p in queued.progress)
        assert all(p.interval_s == 0.05 and p.blocked_s < 5 for p in queued.progress)
        assert await worker.abort("a")
        await asyncio.wait_for(asyncio.gather(first.task, queued.task), 60)
        assert first.error is None and queued.error is None
        assert len(queued.tokens) == short.max_tokens

    try:
        asyncio.run(main())
    finally:
        worker.stop()


def test_a_shutdown_leaves_the_registry_before_it_hands_requests_off(tiny_llama, redis_server):
    """SIGTERM's path: the worker deregisters first, so no router sends it a request while its
    streams are handed off and its server's grace runs (it left only at the end: requests routed
    there meanwhile bounced, each marking it suspect and counting a migration)."""
    worker = _worker(tiny_llama, redis_server.url)
    client = connect(redis_server.url)
    listed_at_hand_off: list[list[str]] = []
    hand_off = worker.hand_off

    async def recorded() -> int:
        listed_at_hand_off.append(list(read_workers(client)))
        return await hand_off()

    worker.hand_off = recorded

    async def main() -> None:
        await worker.serve(lambda server: None)
        await _until(lambda: list(read_workers(client)) == ["decode-0"], "registered")
        s = _Consumer(worker, "h", list(range(3, 23)))
        await _until(lambda: len(s.tokens) >= 2, "the stream decodes")
        await worker.shutdown(grace_s=2.0)
        await asyncio.wait_for(s.task, 30)
        assert isinstance(s.error, WorkerUnavailableError) and "shutting down" in str(s.error)

    asyncio.run(main())
    assert listed_at_hand_off == [[]] and not read_workers(client)
    stats = worker.core.stats()
    assert stats.num_free_blocks == stats.num_blocks and stats.num_running == 0
