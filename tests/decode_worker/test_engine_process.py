"""A decode worker whose engine runs in a process of its own (``engine_process``): real engine process,
real pipes, real gRPC and Redis.

Outputs equal the engine alone (greedy, seeded sampling, logprobs, n > 1, prompt logprobs) and HF;
aborts and leaving callers free every block; a killed engine process fails the open streams at once
and the worker refuses new ones; a failing step is reported and ends the engine process; the worker
registers, publishes its prefix cache and leaves the registry on drain; KV hand-offs and bad requests
are refused at the edge; a shutdown hands running requests off.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from types import SimpleNamespace

import grpc
import pytest

from decode_worker.engine_host import DecodeEngineRole
from decode_worker.service import serve
from decode_worker.split import SplitDecodeWorker, build_decode_worker
from decode_worker.worker import DecodeWorkerConfig, Progress, WorkerUnavailableError
from engine import LLM, EngineConfig, EngineCore, SamplingParams
from engine.scheduler_output import PlainTokens, SequenceOutput
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from proto.convert import params_to_proto
from registry.cluster_view import ClusterView
from registry.schema import connect, read_workers
from worker.engine_channel import FrameBuffer, frame, outputs_from_proto, outputs_to_proto, read_frame
from worker.engine_process import CLOCK, EngineHost
from worker.request_clock import RequestClocks

BLOCKS = 128
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
CASES = [
    ([5, 9, 14, 3, 7, 22, 8], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
    ([11, 4, 4, 19, 30], SamplingParams(temperature=0.9, seed=7, max_tokens=10, ignore_eos=True)),
    (
        [2, 6, 40, 41, 42, 43, 44, 45, 46],
        SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True),
    ),
    ([17, 18, 19], SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=8, ignore_eos=True)),
    ([9, 8, 7, 6, 5, 4], SamplingParams(temperature=0, max_tokens=5, prompt_logprobs=2, ignore_eos=True)),
]


def _config(model, redis_url: str | None = None) -> DecodeWorkerConfig:
    engine = EngineConfig(model=str(model), block_size=4, num_blocks=BLOCKS)
    return DecodeWorkerConfig(engine, redis_url=redis_url, engine_process=True, keepalive_s=0)


async def _until(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.01)


async def _free_blocks(worker) -> int:
    return (await worker.stats()).num_free_blocks


async def _collect(worker, rid, prompt, params):
    """Per sample: (tokens, logprobs, finish reason, prompt logprobs)."""
    samples: dict[int, list] = {}
    async for out in worker.decode(rid, prompt, params):
        s = samples.setdefault(out.sample_index, [[], [], None, None])
        s[0].extend(out.new_token_ids)
        s[1].extend(out.new_logprobs or [])
        s[2] = out.finish_reason or s[2]
        s[3] = out.prompt_logprobs if out.prompt_logprobs is not None else s[3]
    return [tuple(samples[i]) for i in sorted(samples)]


class _Consumer:
    def __init__(self, worker, rid: str, prompt: list[int], params=LONG) -> None:
        self.tokens: list[int] = []
        self.finish: str | None = None
        self.error: BaseException | None = None
        self.task = asyncio.ensure_future(self._run(worker.decode(rid, prompt, params)))

    async def _run(self, stream) -> None:
        try:
            async for out in stream:
                if not isinstance(out, Progress):
                    self.tokens.extend(out.new_token_ids)
                    self.finish = out.finish_reason or self.finish
        except Exception as exc:
            self.error = exc


@pytest.fixture
def worker(tiny_llama):
    w = build_decode_worker(_config(tiny_llama), transfer="none")
    assert isinstance(w, SplitDecodeWorker) and w.core is None and w.engine.process.pid != os.getpid()
    yield w
    w.stop()
    assert w.engine.process.poll() is not None


def test_outputs_equal_the_engine_alone_and_hf(worker, tiny_llama, hf_greedy):
    llm = LLM(str(tiny_llama), block_size=4, num_blocks=BLOCKS)
    expected = []
    for prompt, params in CASES:
        res = llm.generate([prompt], params, use_tqdm=False)[0]
        expected.append(
            [(o.token_ids, o.logprobs or [], o.finish_reason, res.prompt_logprobs) for o in res.outputs]
        )

    async def run():
        await worker.serve(lambda server: None)
        start = await _free_blocks(worker)
        got = await asyncio.gather(*(_collect(worker, f"r{i}", p, sp) for i, (p, sp) in enumerate(CASES)))
        assert await _free_blocks(worker) == start
        await worker.server.stop(0)
        return got

    got = asyncio.run(run())
    for (prompt, params), g, e in zip(CASES, got, expected, strict=True):
        # Logprobs cross the pipe as float32 (as they cross gRPC), and a batch of other requests
        # moves float32 sums in their last bits: the same tokens, values within 1e-5.
        for a, b in zip(g, e, strict=True):
            assert a[0] == b[0] and a[2] == b[2], (prompt, params)
            assert close(a[1], b[1]), (a[1], b[1])
        if params.prompt_logprobs is not None:
            assert g[0][3][0] is None and close(g[0][3][1:], e[0][3][1:])
    assert got[0][0][0] == hf_greedy(tiny_llama, CASES[0][0], 12)


def close(got: list[dict[int, float]], want: list[dict[int, float]]) -> bool:
    return len(got) == len(want) and all(
        g.keys() == w.keys() and all(abs(g[t] - w[t]) < 1e-5 for t in g) for g, w in zip(got, want)
    )


def test_abort_and_a_leaving_caller_free_every_block(worker):
    async def run():
        await worker.serve(lambda server: None)
        start = await _free_blocks(worker)
        aborted = _Consumer(worker, "a", list(range(3, 40)))
        left = _Consumer(worker, "b", list(range(5, 30)))
        await _until(lambda: len(aborted.tokens) >= 2 and len(left.tokens) >= 2, "both decode")
        assert await worker.abort("a") is True
        await asyncio.wait_for(aborted.task, 10)
        assert aborted.finish == "abort" and aborted.error is None
        left.task.cancel()  # the caller goes away: the stream's clean-up aborts it
        await asyncio.gather(left.task, return_exceptions=True)
        deadline = time.monotonic() + 10
        while await _free_blocks(worker) != start:
            assert time.monotonic() < deadline, "blocks were not freed"
            await asyncio.sleep(0.01)
        assert await worker.abort("a") is False  # already gone
        assert (await worker.stats()).generation_tokens < LONG.max_tokens  # neither ran to its end
        await worker.server.stop(0)

    asyncio.run(run())


def test_killed_engine_process_fails_open_streams_at_once(worker):
    async def run():
        await worker.serve(lambda server: None)
        streams = [_Consumer(worker, f"k{i}", list(range(3 + i, 20 + i))) for i in range(2)]
        await _until(lambda: all(len(s.tokens) >= 2 for s in streams), "both streams decode")
        os.kill(worker.engine.process.pid, signal.SIGKILL)  # the child this test's worker started
        await asyncio.wait_for(asyncio.gather(*(s.task for s in streams)), 10)
        for s in streams:
            assert isinstance(s.error, WorkerUnavailableError), s.error
            assert "SIGKILL" in str(s.error)
        assert not worker.loop.alive
        with pytest.raises(WorkerUnavailableError):
            async for _ in worker.decode("late", [1, 2, 3], LONG):
                pass
        await worker.server.stop(0)

    asyncio.run(run())


def test_a_failing_step_is_reported_and_ends_the_engine_loop(tiny_llama, monkeypatch):
    core = EngineCore(EngineConfig(model=str(tiny_llama), block_size=4, num_blocks=BLOCKS))
    real_step = core.step

    def broken_step(plain=None):
        real_step(plain)
        raise RuntimeError("injected scheduler fault")

    monkeypatch.setattr(core, "step", broken_step)
    commands_r, commands_w = os.pipe()
    events_r, events_w = os.pipe()
    clock = bytearray(CLOCK.size)
    host = EngineHost(core, commands_r, events_w, memoryview(clock), idle_tick_s=0.005)
    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.append(host.serve()))
    thread.start()
    add = pb.EngineAdd(request_id="x", prompt_token_ids=[3, 4, 5], params=params_to_proto(LONG))
    os.write(commands_w, frame(pb.EngineCommands(commands=[pb.EngineCommand(command_id=1, add=add)])))
    failure = ""
    while not failure:
        events = read_frame(events_r, pb.EngineEvents)
        assert events is not None
        failure = events.failure
    thread.join(10)
    assert result == [False] and "injected scheduler fault" in failure
    assert CLOCK.unpack_from(clock)[0] > 0  # it beat while it ran
    for fd in (commands_r, commands_w, events_r, events_w):
        os.close(fd)


def test_the_clock_carries_a_long_steps_budget_while_it_runs(tiny_llama):
    """The worker reads the engine process's shared clock for its stall signals (heartbeats, a
    stream's keepalives): while a step of many tokens runs, the clock's budget is what those tokens
    should take (``engine.step_budget``), written once the step is scheduled, not the short steps
    before it."""
    from engine.step_budget import COLD_TOKEN_S

    core = EngineCore(EngineConfig(model=str(tiny_llama), block_size=4, num_blocks=BLOCKS))
    commands_r, commands_w = os.pipe()
    events_r, events_w = os.pipe()
    clock = bytearray(CLOCK.size)
    host = EngineHost(core, commands_r, events_w, memoryview(clock), idle_tick_s=0.005)
    seen: list[tuple[int, float]] = []  # (the step's tokens, the clock's budget) from inside each step
    real_launch = core.runner.launch

    def launch(sched, **kw):
        seen.append((sched.total_num_scheduled_tokens, CLOCK.unpack_from(clock)[2]))
        return real_launch(sched, **kw)

    core.runner.launch = launch
    thread = threading.Thread(target=host.serve)
    thread.start()
    params = params_to_proto(SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    add = pb.EngineAdd(request_id="x", prompt_token_ids=list(range(3, 303)), params=params)
    os.write(commands_w, frame(pb.EngineCommands(commands=[pb.EngineCommand(command_id=1, add=add)])))
    finished = False
    while not finished:
        events = read_frame(events_r, pb.EngineEvents)
        finished = any(o.finish_reason for o in events.outputs)
    os.write(commands_w, frame(pb.EngineCommands(commands=[pb.EngineCommand(command_id=2, stop=True)])))
    thread.join(10)
    tokens, budget = seen[0]
    assert tokens == 300 and budget == pytest.approx(300 * COLD_TOKEN_S)
    assert seen[1][0] == 1 and seen[1][1] < budget  # the decode step after it is announced short
    for fd in (commands_r, commands_w, events_r, events_w):
        os.close(fd)


def test_frames_split_anywhere_reassemble():
    msgs = [
        pb.EngineCommands(commands=[pb.EngineCommand(command_id=i, abort=f"r{i}" * i)]) for i in range(1, 6)
    ]
    data = b"".join(frame(m) for m in msgs)
    buf, got = FrameBuffer(pb.EngineCommands), []
    for i in range(0, len(data), 3):
        got.extend(buf.feed(data[i : i + 3]))
    assert got == msgs


def test_registers_publishes_its_cache_and_leaves_on_drain(tiny_llama, redis_server):
    worker = build_decode_worker(_config(tiny_llama, redis_server.url), transfer="none")
    view = ClusterView(redis_server.url)
    view.start()

    async def run():
        client = connect(redis_server.url)
        await worker.serve(lambda server: None)
        await _until(lambda: list(read_workers(client)) == ["decode-0"], "registered")
        record = read_workers(client)["decode-0"]
        assert (
            record.num_blocks == BLOCKS
            and record.block_size == 4
            and record.kv_compat == worker.compat.hash()
        )
        assert record.kv_handoff == 0  # the router runs its requests aggregated
        await _collect(worker, "p", list(range(3, 23)), SamplingParams(temperature=0, max_tokens=2))
        await _until(lambda: len(view.index.blocks_of("decode-0")) >= 5, "its prompt's blocks are indexed")
        await _until(lambda: read_workers(client)["decode-0"].num_free_blocks > 0, "its load is published")
        assert await worker.drain(timeout_s=5, quiet_s=0.05)
        await _until(lambda: not read_workers(client), "left the registry")
        await worker.server.stop(0)

    try:
        asyncio.run(run())
    finally:
        view.stop()
        worker.stop()


def test_kv_handoffs_and_bad_requests_are_refused_at_the_edge(worker):
    async def run():
        server, address = await serve(worker)
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.DecodeWorkerStub(channel)
            params = params_to_proto(SamplingParams(temperature=0, max_tokens=4))
            handle = pb.KVHandle(request_id="h", agent_name="p-1", num_tokens=3, first_token=5)
            for request, expect in (
                (
                    pb.DecodeRequest(
                        request_id="h", prompt_token_ids=[1, 2, 3], params=params, handle=handle
                    ),
                    "no KV hand-offs",
                ),
                (
                    pb.DecodeRequest(
                        request_id="s", prompt_token_ids=[1, 2, 3], params=params, kv_source="x:1"
                    ),
                    "no KV hand-offs",
                ),
                (
                    pb.DecodeRequest(request_id="v", prompt_token_ids=[1, 10**6], params=params),
                    "outside the vocabulary",
                ),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in stub.Decode(request):
                        pass
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert expect in err.value.details()
            ok = [
                m
                async for m in stub.Decode(
                    pb.DecodeRequest(request_id="ok", prompt_token_ids=[1, 2, 3], params=params)
                )
            ]
            assert ok[-1].finished.finish_reason == "length"
            state = await stub.GetState(pb.GetStateRequest())
            assert state.stats.num_free_blocks == BLOCKS and not state.HasField("transfer")
            assert state.HasField("transfer_stats") and state.transfer_stats.completed == 0  # no pulls
        await server.stop(0)

    asyncio.run(run())


def test_shutdown_hands_running_requests_off(worker):
    async def run():
        await worker.serve(lambda server: None)
        streams = [_Consumer(worker, f"h{i}", list(range(4 + i, 24 + i))) for i in range(3)]
        await _until(lambda: all(len(s.tokens) >= 1 for s in streams), "all decode")
        await worker.shutdown(grace_s=5)
        for s in streams:
            await asyncio.wait_for(s.task, 10)
            assert isinstance(s.error, WorkerUnavailableError) and "shutting down" in str(s.error)
        assert worker.engine.process.returncode == 0

    asyncio.run(run())


def test_a_steps_outputs_cross_the_channel_unchanged():
    """Plain outputs travel as columns, the others whole; every field comes back."""
    outs = [
        SequenceOutput("a", 0, [5], num_prompt_tokens=7, num_cached_tokens=4),
        SequenceOutput("b", 1, [6, 7], num_prompt_tokens=3),
        SequenceOutput("c", 0, [8], new_logprobs=[{8: -0.5, 2: -1.25}], num_prompt_tokens=2),
        SequenceOutput("d", 0, [9], finish_reason="stop", stop_reason="\n\n", num_prompt_tokens=2),
        SequenceOutput("e", 0, [], finish_reason="stop", stop_reason=2),
        SequenceOutput("f", 0, [], finish_reason="error", error="grammar allows no token"),
        SequenceOutput("g", 0, [1], seed=-3, prompt_logprobs=[None, {4: -0.75}]),
    ]
    events = pb.EngineEvents()
    outputs_to_proto(outs, events)
    data = frame(events)
    (back,) = FrameBuffer(pb.EngineEvents).feed(data)
    assert list(back.tokens.request_ids) == ["a", "b"]  # the plain ones, as columns
    got = outputs_from_proto(back)
    assert sorted(got, key=lambda o: o.request_id) == outs


def test_plain_tokens_the_engine_kept_as_columns_cross_as_the_objects_would(tiny_llama):
    """``EngineCore.step(plain)``'s columns, sent beside the step's whole outputs, come back as the
    outputs ``step()`` returns for the same requests."""
    received, returned = [], []
    for columns in (True, False):
        core = EngineCore(EngineConfig(model=str(tiny_llama), block_size=4, num_blocks=BLOCKS))
        for i, (prompt, params) in enumerate(CASES):
            core.add_request(f"r{i}", prompt, params)
        while core.has_unfinished():
            if columns:
                plain = PlainTokens()
                events = pb.EngineEvents()
                outputs_to_proto(core.step(plain), events, plain)
                (back,) = FrameBuffer(pb.EngineEvents).feed(frame(events))
                received.append(sorted(outputs_from_proto(back), key=_key))
            else:
                returned.append(sorted(core.step(), key=_key))
    assert received == returned
    assert sum(len(o.new_token_ids) for step in received for o in step) > 40


def test_a_plain_token_and_its_finish_in_one_message_keep_their_order():
    """One message can carry two steps' outputs (an overlapped step's, then the next's): a
    sequence's plain token, sent as a column, must still reach the worker before its finish."""
    r = SimpleNamespace(group_id="r", sample_index=0, prompt_len=4, num_cached_tokens=2)
    s = SimpleNamespace(group_id="s", sample_index=1, prompt_len=3, num_cached_tokens=-1)
    plain = PlainTokens([r, s], [5, 6])
    outputs = [
        SequenceOutput("q", 0, [], finish_reason="abort"),  # before the step
        SequenceOutput("r", 0, [7], finish_reason="stop", stop_reason=7, num_prompt_tokens=4),
        SequenceOutput("t", 0, [8], num_prompt_tokens=1),  # a plain one the engine returned whole
    ]
    events = pb.EngineEvents()
    outputs_to_proto(outputs, events, plain, [0, 1, 2])
    (back,) = FrameBuffer(pb.EngineEvents).feed(frame(events))
    got = [(o.request_id, o.sample_index, o.new_token_ids, o.finish_reason) for o in outputs_from_proto(back)]
    assert got == [
        ("q", 0, [], "abort"),
        ("r", 0, [5], None),
        ("r", 0, [7], "stop"),
        ("s", 1, [6], None),
        ("t", 0, [8], None),
    ]


def _key(out: SequenceOutput) -> tuple[str, int]:
    return out.request_id, out.sample_index


def test_a_landed_kv_is_reported_with_when_it_landed():
    """The engine process stamps a pull's landing when it lands (its thread, ``KVPuller``'s callback),
    and the report carries that time over the pipe: the worker reads it with the next step's outputs,
    and a clock that took the reading's time counted that step as queueing."""
    role = DecodeEngineRole(SimpleNamespace(core=None, publish=lambda outs: None), None, 1.0)
    before = time.monotonic()
    role.pulls.on_landed("r", 0.002)  # what KVPuller._finish_read calls once the READ settled
    after = time.monotonic()
    events = pb.EngineEvents()
    role.finish(events, [])
    [landed] = pb.EngineEvents.FromString(events.SerializeToString()).landed  # as the pipe carries it
    assert (landed.request_id, landed.seconds) == ("r", 0.002) and before <= landed.at <= after
    loop = SimpleNamespace(add_output_hook=lambda fn: None, step_started=0.0)
    clocks = RequestClocks(loop)
    clocks.arrive("r")
    clocks.transferred(landed.request_id, landed.seconds, landed.at)  # read later: the engine client's call
    assert clocks.get("r").ready == landed.at
    assert not role.landed  # reported once


def test_an_idle_engine_waits_longer_each_empty_turn_and_a_command_wakes_it_at_once(tiny_llama, monkeypatch):
    """Nothing to do: the wait on the command pipe doubles each empty turn up to IDLE_WAIT_MAX_S (an
    idle engine process was 200 empty turns a second, 4% of a core); a command is answered at once
    and the waits start short again."""
    import worker.engine_process as engine_process

    core = EngineCore(EngineConfig(model=str(tiny_llama), block_size=4, num_blocks=BLOCKS))
    commands_r, commands_w = os.pipe()
    events_r, events_w = os.pipe()
    host = EngineHost(core, commands_r, events_w, memoryview(bytearray(CLOCK.size)), idle_tick_s=0.005)
    waits: list[float] = []
    real_select = engine_process.select.select

    def select(r, w, x, timeout):
        waits.append(timeout)
        if len(waits) == 8:  # a command arrives during the eighth wait
            stats = pb.EngineCommand(command_id=1, stats=True)
            os.write(commands_w, frame(pb.EngineCommands(commands=[stats])))
        if len(waits) == 12:
            os.write(
                commands_w, frame(pb.EngineCommands(commands=[pb.EngineCommand(command_id=2, stop=True)]))
            )
        return real_select(r, w, x, 0)  # no real waiting in the test

    monkeypatch.setattr(engine_process.select, "select", select)
    assert host.serve()
    assert waits[:9] == [0.005, 0.01, 0.02, 0.04, 0.05, 0.05, 0.05, 0.05, 0.005]
    assert waits[9:12] == [0.01, 0.02, 0.04]
    reply = read_frame(events_r, pb.EngineEvents).replies[0]
    assert reply.command_id == 1 and reply.HasField("stats")
    for fd in (commands_r, commands_w, events_r, events_w):
        os.close(fd)
