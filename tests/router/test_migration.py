"""Request migration through the router, over real decode workers (real engines, in this process)
serving real gRPC and registered in a real Redis: a decode worker lost mid-stream — its engine step
raised, it shut down, its engine thread hung — and the caller's stream just goes on, token for token
what an unfaulted run gives (greedy, and seeded sampling with logprobs); a worker merely busy is not
mistaken for a stalled one; a request that cannot move (limit reached, no other worker, n > 1)
fails with a clear UNAVAILABLE. Every worker's blocks come back afterwards. (tests/e2e covers worker
processes killed or SIGSTOPped under P/D with NIXL.)"""

from __future__ import annotations

import asyncio
import threading
from contextlib import asynccontextmanager

import grpc
import pytest
from fake_decode_worker import until

from decode_worker.service import serve as serve_decode
from decode_worker.worker import DecodeWorker, DecodeWorkerConfig
from engine import EngineConfig
from kv_transfer import InProcessFabric
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from registry.cluster_view import ClusterView
from router.migration import DecodeLost, MigrationOptions, ProgressWatch, Resumption
from router.router import Router
from router.service import serve

NUM_BLOCKS = 128
PROMPT = list(range(3, 40))
GREEDY = pb.SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
LONG = pb.SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)  # 437 of 512 pool tokens
SEEDED = pb.SamplingParams(temperature=0.9, top_k=20, seed=4242, max_tokens=48, ignore_eos=True, logprobs=2)


class Stack:
    """Decode workers d0.. (in-process, registered), a router over them, and its gRPC stub."""

    def __init__(
        self, redis_url: str, tiny_llama, options: MigrationOptions, num_decode: int, **engine
    ) -> None:
        self.redis_url = redis_url
        self.view = ClusterView(redis_url, poll_s=0.05)
        self.router = Router(self.view, "least_load", migration=options)
        fabric = InProcessFabric()
        self.workers = [
            DecodeWorker(
                DecodeWorkerConfig(
                    EngineConfig(model=str(tiny_llama), block_size=4, **{"num_blocks": NUM_BLOCKS, **engine}),
                    worker_id=f"d{i}",
                    redis_url=redis_url,
                    keepalive_s=0.1,
                ),
                fetch_peer=None,
                transfer_factory=fabric.transfer_factory,
            )
            for i in range(num_decode)
        ]

    async def start(self) -> None:
        self.view.start()
        for w in self.workers:
            await serve_decode(w)
        await until(lambda: len(self.view.live_workers("decode")) == len(self.workers), "workers registered")
        self.server, address = await serve(self.router)
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = pb_grpc.RouterStub(self.channel)

    async def stop(self) -> None:
        await self.channel.close()
        await self.server.stop(0)
        await self.router.close()
        for w in self.workers:
            await w.shutdown(0)
        self.view.stop()

    def worker_of(self, rid: str) -> DecodeWorker:
        record, _ = self.router.cancellation.decoding[rid]
        return next(w for w in self.workers if w.worker_id == record.worker_id)

    async def all_free(self, workers: list[DecodeWorker] | None = None) -> None:
        for w in workers or self.workers:
            await until(
                lambda w=w: (
                    w.core.stats().num_free_blocks == w.core.kv.num_blocks and not w.core.has_unfinished()
                ),
                f"{w.worker_id}'s blocks are all free",
            )


@asynccontextmanager
async def running(redis_server, tiny_llama, options=None, num_decode: int = 2, **engine):
    stack = Stack(
        redis_server.url, tiny_llama, options or MigrationOptions(stall_floor_s=2.0), num_decode, **engine
    )
    await stack.start()
    try:
        yield stack
    finally:
        await stack.stop()


class Stream:
    """One Generate call read in the background: tokens, logprobs, the final Finished."""

    def __init__(self, stack: Stack, rid: str, params: pb.SamplingParams, prompt=PROMPT) -> None:
        self.tokens: list[int] = []
        self.logprobs: list[pb.TokenLogprobs] = []
        self.finished: pb.Finished | None = None
        req = pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, params=params)
        self.task = asyncio.ensure_future(self._read(stack.stub.Generate(req, timeout=120)))

    async def _read(self, call) -> None:
        async for msg in call:
            assert msg.WhichOneof("kind") != "error", msg.error
            self.tokens.extend(msg.tokens.token_ids)
            self.logprobs.extend(msg.tokens.logprobs)
            if msg.HasField("finished"):
                self.finished = msg.finished

    async def result(self) -> list[int]:
        await asyncio.wait_for(self.task, 120)
        return self.tokens


async def _fail_engine(w: DecodeWorker) -> None:
    real_step = w.core.step

    def step():
        real_step()
        raise RuntimeError("injected engine fault")

    w.core.step = step


async def _shut_down(w: DecodeWorker) -> None:
    await w.shutdown(grace_s=5)


def _same_logprobs(got: list[pb.TokenLogprobs], want: list[pb.TokenLogprobs]) -> bool:
    """Per token, the same entries up to float noise (a resumed prompt is computed as one prefill)."""
    if len(got) != len(want):
        return False
    for g, w in zip(got, want):
        if [e.token_id for e in g.entries][:1] != [e.token_id for e in w.entries][:1]:
            return False
        if any(abs(a.logprob - b.logprob) > 1e-3 for a, b in zip(g.entries, w.entries)):
            return False
    return True


@pytest.mark.parametrize("fault", [_fail_engine, _shut_down], ids=["engine_step_raises", "shutdown"])
def test_lost_decode_worker_mid_stream_resumes_token_identical(redis_server, tiny_llama, fault):
    """Two requests, each losing its decode worker a few tokens in (three workers: the second
    request still has somewhere to go): the stream goes on elsewhere, identical to its unfaulted run."""

    async def main() -> None:
        async with running(redis_server, tiny_llama, num_decode=3) as stack:
            seen: list[str] = []  # the request ids the workers' engines were given
            for w in stack.workers:
                add = w.core.add_request
                w.core.add_request = lambda rid, *a, _add=add, **k: (seen.append(rid), _add(rid, *a, **k))[1]
            cases = [("greedy", GREEDY), ("seeded", SEEDED)]
            references = {}
            for name, params in cases:
                ref = Stream(stack, f"ref-{name}", params)
                references[name] = (await ref.result(), list(ref.logprobs))
            await stack.all_free()
            # Each worker's heartbeats carry its engine's recent step (what stall deadlines scale with).
            await until(lambda: any(w.step_ms > 0 for w in stack.view.live_workers("decode")), "step times")
            for name, params in cases:
                s = Stream(stack, name, params)
                await until(lambda s=s: len(s.tokens) >= 4, "a few tokens streamed")
                victim = stack.worker_of(name)
                await fault(victim)
                tokens, logprobs = references[name]
                assert await s.result() == tokens  # no token repeated, none missing, none different
                assert _same_logprobs(s.logprobs, logprobs)
                u = s.finished.usage
                assert (u.prompt_tokens, u.completion_tokens) == (len(PROMPT), params.max_tokens)
                assert s.finished.finish_reason == "length"
                # The resumed attempt has an id of its own on the workers (the last one's may still be
                # held: KV whose release has not landed, a stalled worker that wakes up).
                assert seen[-2:] == [name, f"{name}~m1"], seen
                stack.workers.remove(victim)
                await until(
                    lambda v=victim: v.worker_id not in {w.worker_id for w in stack.view.live_workers()},
                    "the lost worker left the registry",
                )
                await victim.shutdown(0)
                await stack.all_free()  # the survivors' blocks all came back
            cs = await stack.stub.GetClusterState(pb.ClusterStateRequest())
            assert cs.migrations == stack.router.stats.migrations == 2 and cs.migrations_refused == 0
            if fault is _fail_engine:  # a failed engine makes its worker suspect; a drained one is not
                assert cs.stalls == 0 and len(cs.suspect_workers) == 2

    asyncio.run(main())


def test_stalled_worker_is_given_up_on_and_its_request_moves(redis_server, tiny_llama):
    """d's engine thread hangs (a fault hook blocks its step) while its process stays up: its
    keepalives report the engine blocked past the deadline (floor 2 s here); the router gives up on
    it, marks it suspect and the stream finishes elsewhere while d is still hung."""

    async def main() -> None:
        async with running(redis_server, tiny_llama) as stack:
            ref = await Stream(stack, "ref", SEEDED).result()
            s = Stream(stack, "s", SEEDED)
            await until(lambda: len(s.tokens) >= 4, "a few tokens streamed")
            victim = stack.worker_of("s")
            hang = threading.Event()
            real_step = victim.core.step

            def step():
                hang.wait()
                return real_step()

            victim.core.step = step
            try:
                assert await s.result() == ref
                assert not hang.is_set()  # finished without waiting for the hung worker
                assert stack.router.stats.stalls == 1 and stack.router.stats.migrations == 1
                cs = await stack.stub.GetClusterState(pb.ClusterStateRequest())
                assert list(cs.suspect_workers) == [victim.worker_id]
                assert not {w.state.worker_id: w.healthy for w in cs.workers}[victim.worker_id]
            finally:
                victim.core.step = real_step
                hang.set()
            await stack.all_free()  # the hung worker, once free again, aborted the moved request

    asyncio.run(main())


def test_busy_worker_is_not_mistaken_for_a_stalled_one(redis_server, tiny_model_factory):
    """One worker, one sequence at a time: a request queued behind a long one is silent for well
    past the stall deadline (2 s), but its keepalives say the engine is stepping: nothing moves."""
    model = tiny_model_factory("llama", max_position_embeddings=4096)

    async def main() -> None:
        async with running(redis_server, model, num_decode=1, max_num_seqs=1, num_blocks=1024) as stack:
            ref = await Stream(stack, "ref", GREEDY).result()
            long = Stream(stack, "long", pb.SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True))
            await until(lambda: len(long.tokens) >= 1, "the long request runs")
            queued = Stream(stack, "queued", GREEDY)
            loop = asyncio.get_running_loop()
            since = loop.time()
            deadline = stack.router.watch.deadline_s("d0")
            await until(
                lambda: loop.time() - since > deadline + 1.0, "the queued request waited past its deadline"
            )
            assert not queued.tokens and not long.task.done()  # still queued behind the long one
            assert await stack.router.abort("long")
            assert await queued.result() == ref
            await asyncio.wait_for(long.task, 60)
            assert stack.router.stats.stalls == 0 and stack.router.stats.migrations == 0
            await stack.all_free()

    asyncio.run(main())


def test_a_step_much_longer_than_the_recent_ones_is_no_stall(redis_server, tiny_model_factory):
    """A stream decodes in short steps on the only decode worker; a 300-token prompt joins it and its
    step takes 2.5 s, past the 1 s floor and 20 x the recent steps, so the stream is silent that long.
    The engine announced the step's length from its tokens once it scheduled them
    (``engine.step_budget``): nothing is taken for a stall and both requests finish (a user saw a
    503 here, for a cold worker's first long prompt)."""
    import time

    model = tiny_model_factory("llama", max_position_embeddings=4096)
    options = MigrationOptions(stall_floor_s=1.0, stall_step_multiple=20.0)

    async def main() -> None:
        async with running(redis_server, model, options, num_decode=1, num_blocks=1024) as stack:
            (w,) = stack.workers
            real_launch = w.core.runner.launch

            def launch(sched, **kw):
                if sched.total_num_scheduled_tokens >= 256:
                    time.sleep(2.5)  # the injected long step (a big prompt on a slow device)
                return real_launch(sched, **kw)

            running_one = Stream(
                stack, "running", pb.SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            )
            await until(lambda: len(running_one.tokens) >= 4, "the first request decodes")
            w.core.runner.launch = launch
            long_prompt = Stream(stack, "long", GREEDY, prompt=list(range(3, 303)))
            assert len(await long_prompt.result()) == GREEDY.max_tokens
            assert len(await running_one.result()) == 200
            assert stack.router.stats.stalls == 0 and stack.router.stats.migrations == 0
            await stack.all_free()

    asyncio.run(main())


@pytest.mark.parametrize(
    ("case", "num_decode", "options", "params", "says"),
    [
        # Long outputs (as many as the KV pool holds): the engine must still be generating when the
        # client has its 4th token and fails it (with 48 tokens an unloaded machine finished first).
        ("no_other_worker", 1, MigrationOptions(), LONG, "no other decode worker is available"),
        ("limit", 2, MigrationOptions(max_migrations=0), LONG, "already moved 0 times (limit 0)"),
        (
            "n_gt_1",
            2,
            MigrationOptions(),
            pb.SamplingParams(n=2, temperature=0.8, max_tokens=200, ignore_eos=True),
            "n = 2 samples",
        ),
    ],
)
def test_a_request_that_cannot_move_fails_clearly(
    redis_server, tiny_llama, case, num_decode, options, params, says
):
    async def main() -> None:
        async with running(redis_server, tiny_llama, options, num_decode=num_decode) as stack:
            got: list[int] = []
            req = pb.GenerateRequest(request_id=case, prompt_token_ids=PROMPT, params=params)
            call = stack.stub.Generate(req, timeout=60)
            victim = None
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for msg in call:
                    got.extend(msg.tokens.token_ids)
                    if len(got) >= 4 and victim is None:  # a message may carry several tokens
                        victim = stack.worker_of(case)
                        await _fail_engine(victim)
            # UNAVAILABLE: the ingress answers 503 "unavailable" with this message, not raw gRPC text.
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert (
                f"decode worker {victim.worker_id} lost" in err.value.details()
                and says in err.value.details()
            )
            assert stack.router.stats.migrations_refused == 1 and stack.router.stats.migrations == 0
            stack.workers.remove(victim)
            await victim.shutdown(0)
            await stack.all_free()

    asyncio.run(main())


def test_stall_deadline_follows_the_workers_steps_with_a_floor_and_an_override():
    watch = ProgressWatch(MigrationOptions(stall_floor_s=2.0, stall_step_multiple=10.0))
    assert watch.deadline_s("d0") == 2.0  # nothing heard yet: the floor
    watch._step_s["d0"] = 0.5  # a worker whose longest recent step took 0.5 s (a long prefill chunk)
    assert watch.deadline_s("d0") == 5.0 and watch.deadline_s("d1") == 2.0
    assert ProgressWatch(MigrationOptions(stall_timeout_s=0.7)).deadline_s("d0") == 0.7


def test_the_stall_watch_marks_a_silent_or_blocked_stream_and_passes_a_live_one():
    """Unit test of ``ProgressWatch.watch`` over fake decode streams: a stream silent past its
    deadline and one whose Progress says the engine is blocked past it raise ``DecodeLost``; a stream
    that keeps talking passes its tokens on, its Progress consumed."""

    def tokens(i: int) -> pb.GenerateResponse:
        return pb.GenerateResponse(tokens=pb.TokenChunk(token_ids=[i]))

    def progress(blocked_ms: float) -> pb.GenerateResponse:
        return pb.GenerateResponse(progress=pb.Progress(step_ms=1.0, blocked_ms=blocked_ms, interval_ms=10.0))

    async def silent():
        yield tokens(1)
        await asyncio.Event().wait()  # the worker stopped answering
        yield tokens(2)

    async def blocked():
        yield tokens(1)
        yield progress(blocked_ms=5000.0)  # alive, but its engine made no progress for 5 s

    async def live():
        for i in range(3):
            yield tokens(i)
            yield progress(blocked_ms=1.0)

    async def relay(stream) -> list[pb.GenerateResponse]:
        watch = ProgressWatch(MigrationOptions(stall_timeout_s=0.3))
        return [m async for m in watch.watch(stream, "d0")]

    async def main() -> None:
        with pytest.raises(DecodeLost, match="silent"):
            async with asyncio.timeout(30):  # a bound: a watch that never fires fails, not hangs
                await relay(silent())
        with pytest.raises(DecodeLost, match="no progress"):
            await relay(blocked())
        assert [m.tokens.token_ids[0] for m in await relay(live())] == [0, 1, 2]

    asyncio.run(main())


def test_the_stall_deadline_counts_only_waits_and_leaves_other_cancellations_alone():
    """A consumer slower than the deadline between messages is not a stall (the deadline runs while
    the watch waits for the worker, not while the relay is busy); a cancellation from elsewhere
    (the caller left) ends the watch as a cancellation, not as a lost worker."""

    async def steady():
        for i in range(3):
            yield pb.GenerateResponse(tokens=pb.TokenChunk(token_ids=[i]))

    async def quiet(started: asyncio.Event):
        yield pb.GenerateResponse(tokens=pb.TokenChunk(token_ids=[0]))
        started.set()
        await asyncio.Event().wait()
        yield pb.GenerateResponse(tokens=pb.TokenChunk(token_ids=[1]))

    async def main() -> None:
        got = []
        async for m in ProgressWatch(MigrationOptions(stall_timeout_s=0.2)).watch(steady(), "d0"):
            got.append(m.tokens.token_ids[0])
            await asyncio.sleep(0.5)  # the relay busy for longer than the deadline
        assert got == [0, 1, 2]

        started = asyncio.Event()

        async def relay() -> None:
            async for _ in ProgressWatch(MigrationOptions(stall_timeout_s=60)).watch(quiet(started), "d0"):
                pass

        task = asyncio.ensure_future(relay())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_a_stream_whose_last_token_was_relayed_ends_without_moving():
    """The worker was lost right after the request's last token: the router ends the stream itself
    (finish reason ``length``, usage of the caller's prompt) instead of asking for 0 more tokens."""
    res = Resumption(PROMPT, GREEDY, 1)
    res.relay(pb.GenerateResponse(tokens=pb.TokenChunk(token_ids=list(range(GREEDY.max_tokens)))))
    end = res.ended_by_itself()
    assert end.finished.finish_reason == "length"
    assert (end.finished.usage.prompt_tokens, end.finished.usage.completion_tokens) == (len(PROMPT), 48)
    short = Resumption(PROMPT, GREEDY, 1)
    short.relay(pb.GenerateResponse(tokens=pb.TokenChunk(token_ids=[1, 2])))
    assert short.ended_by_itself() is None
    short.resume(DecodeLost("d0", "gone"), MigrationOptions(), others=1, deadline=None)
    prompt, params = short.request()
    assert prompt == [*PROMPT, 1, 2] and params.max_tokens == GREEDY.max_tokens - 2


def test_a_resumed_attempts_cache_hit_counts_only_the_callers_prompt():
    """After a move the new worker's prompt is the caller's plus the tokens relayed; the hit its first
    chunk and its Finished report is capped at the caller's prompt, as usage counts it."""
    res = Resumption(PROMPT, GREEDY, 1)
    res.relay(pb.GenerateResponse(tokens=pb.TokenChunk(token_ids=[1, 2], cached_tokens=0)))
    res.resume(DecodeLost("d0", "gone"), MigrationOptions(), others=1, deadline=None)
    over = len(PROMPT) + 2
    first = res.relay(pb.GenerateResponse(tokens=pb.TokenChunk(token_ids=[3], cached_tokens=over)))
    fin = pb.Finished(finish_reason="length", usage=pb.Usage(cached_tokens=over))
    last = res.relay(pb.GenerateResponse(finished=fin))
    assert first.tokens.cached_tokens == last.finished.usage.cached_tokens == len(PROMPT)


def test_a_lost_workers_address_stays_in_the_routers_log_not_the_callers_error():
    """A connection's error names the worker's address (a pod IP on Kubernetes): the caller's
    message says which worker and why in a few words, the router's log keeps the rest."""
    import grpc.aio

    from router.migration import MigrationRefused
    from router.service import RouteFailed, caller_stream

    lost = DecodeLost("d0", "UNAVAILABLE: call stream to 10.1.2.3:5: cannot connect", cause="unavailable")
    res = Resumption(PROMPT, GREEDY, 1)
    with pytest.raises(MigrationRefused) as refused:
        res.resume(lost, MigrationOptions(), others=0, deadline=None)
    assert str(refused.value) == (
        "decode worker d0 lost (unavailable); the request cannot be resumed: no other decode worker is available"
    )

    class Failing:
        stats = type("S", (), {"fail": lambda self, code: None})()

        async def generate(self, *args, **kwargs):
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                "failed to connect to 10.1.2.3:5",
            )
            yield

    async def run() -> RouteFailed:
        with pytest.raises(RouteFailed) as failed:
            async for _ in caller_stream(Failing(), "r", [1], GREEDY, 0, None):
                pass
        return failed.value

    failed = asyncio.run(run())
    assert failed.code == grpc.StatusCode.UNAVAILABLE and "10.1.2.3" not in failed.details
    assert failed.details == "a worker could not serve the request (unavailable)"
