"""The router end to end: worker processes registered in a real Redis, the router's gRPC service,
requests in token ids out — identical to HF; tenants routed to the worker holding their prefix;
Redis killed and restarted mid-workload with zero failed requests; a dead prefill worker retried
around; a cancelled stream freeing blocks on every worker."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest
from pd_client import state

from engine import LLM
from engine.sampling_params import SamplingParams
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from proto.convert import params_to_proto
from registry.cluster_view import ClusterView
from registry.schema import connect, set_draining
from router.router import Router
from router.service import serve

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
LONG_CONTEXT = 32768  # of the model in the cancellation test: a request can ask for thousands of tokens


class Cluster:
    def __init__(
        self,
        workers,
        redis_server,
        num_prefill: int,
        policy: str = "cache_aware",
        num_decode: int = 1,
        decode_flags: tuple[str, ...] = (),
        kv_flags: tuple[str, ...] = (),
        prefill_flags: tuple[str, ...] = (),
        **spawn_kw,
    ) -> None:
        url = redis_server.url
        # prefill_flags: every prefill worker's, or one tuple per worker
        per_prefill = prefill_flags if prefill_flags and isinstance(prefill_flags[0], tuple) else None
        self.prefills = [
            workers(
                "prefill",
                "--redis-url",
                url,
                "--worker-id",
                f"p{i}",
                "--lease-seconds",
                "5",
                *kv_flags,
                *(per_prefill[i] if per_prefill else prefill_flags),
                **spawn_kw,
            )
            for i in range(num_prefill)
        ]
        # decode_flags: every decode worker's, or one tuple per worker
        per_decode = decode_flags if decode_flags and isinstance(decode_flags[0], tuple) else None
        self.decodes = [
            workers(
                "decode",
                "--redis-url",
                url,
                "--worker-id",
                f"d{i}",
                *kv_flags,
                *(per_decode[i] if per_decode else decode_flags),
                **spawn_kw,
            )
            for i in range(num_decode)
        ]
        self.decode = self.decodes[0]
        self.view = ClusterView(url, poll_s=0.2)
        self.router = Router(self.view, policy)
        self.routes: dict[str, pb.RouteInfo] = {}
        self.usage: dict[str, pb.Usage] = {}

    async def start(self) -> None:
        self.view.start()
        deadline = time.monotonic() + 20
        while len(self.view.live_workers()) < len(self.prefills) + len(self.decodes):
            assert time.monotonic() < deadline, "workers did not register"
            await asyncio.sleep(0.1)
        self.server, address = await serve(self.router)
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = pb_grpc.RouterStub(self.channel)

    async def stop(self) -> None:
        await self.channel.close()
        await self.server.stop(0)
        await self.router.close()
        self.view.stop()

    async def generate(self, rid: str, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
        tokens = []
        req = pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, params=params_to_proto(params))
        async for msg in self.stub.Generate(req, timeout=60):
            kind = msg.WhichOneof("kind")
            assert kind != "error", msg.error
            if kind == "route":
                self.routes[rid] = msg.route
            elif kind == "finished":
                self.usage[rid] = msg.finished.usage
            tokens.extend(msg.tokens.token_ids)
        return tokens

    async def all_free(self, timeout: float = 15.0) -> None:
        await all_free([*self.prefills, *self.decodes], timeout)


async def all_free(workers, timeout: float = 15.0) -> None:
    """Until every live worker of ``workers`` is idle with all its KV blocks free."""
    deadline = time.monotonic() + timeout
    procs = [p for p in workers if p.proc.poll() is None]
    while True:
        states = [await state(w.address, w.role) for w in procs]
        if all(
            s.stats.num_free_blocks == s.stats.num_blocks
            and s.stats.num_held_requests == 0
            and s.stats.num_running == 0
            for s in states
        ):
            return
        assert time.monotonic() < deadline, [(s.worker_id, s.stats) for s in states]
        await asyncio.sleep(0.1)


def _tenant_prompts(
    seed: int, tenants: int, per_tenant: int, prefix_len: int = 48
) -> list[tuple[int, list[int]]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 1000) for _ in range(prefix_len)] for _ in range(tenants)]
    reqs = [
        (t, systems[t] + [rng.randrange(3, 1000) for _ in range(rng.randrange(3, 10))])
        for t in range(tenants)
        for _ in range(per_tenant)
    ]
    rng.shuffle(reqs)
    return reqs


def test_router_serves_hf_identical_tokens_and_routes_tenants_to_their_prefix(
    workers, redis_server, tiny_llama, hf_greedy
):
    cluster = Cluster(workers, redis_server, num_prefill=2)

    async def run():
        await cluster.start()
        try:
            await body()
        finally:
            await cluster.stop()

    async def body():
        prompt = list(range(10, 40))
        assert await cluster.generate("hf", prompt) == hf_greedy(tiny_llama, prompt, 6)
        # Tenants sharing long system prompts: one warm-up each, then the rest.
        reqs = _tenant_prompts(1, tenants=4, per_tenant=5)
        seen: dict[int, list[str]] = {}
        index = cluster.view.index
        for i, (t, p) in enumerate(reqs):
            held = {w: index.num_blocks_of(w) for w in ("p0", "p1")}
            await cluster.generate(f"t{t}-{i}", p)
            route = cluster.routes[f"t{t}-{i}"]
            seen.setdefault(t, []).append(route.prefill_worker)
            # Per request, the router's predicted prefix hit is what the prefill engine delivered,
            # and what the client's usage reports.
            assert route.predicted_hit_tokens == route.delivered_hit_tokens, route
            assert cluster.usage[f"t{t}-{i}"].cached_tokens == route.delivered_hit_tokens
            # Until the worker's KV events for the blocks it computed reach the index.
            w, bs = route.prefill_worker, 8
            computed = len(p) // bs - route.delivered_hit_tokens // bs
            while index.num_blocks_of(w) < held[w] + computed:
                await asyncio.sleep(0.02)
        # After its first request, each tenant sticks to the worker holding its prefix...
        for t, ws in seen.items():
            assert len(set(ws[1:])) == 1, (t, ws)
        # ...and tenants spread over both prefill workers.
        assert len({ws[-1] for ws in seen.values()}) == 2
        s = cluster.router.stats
        best = sum(
            48 // 8 * 8 for _ in range(len(reqs) - 4)
        )  # every non-first request hits its 48-token prefix
        assert s.delivered_hit_tokens >= 0.9 * best
        assert abs(s.predicted_hit_tokens - s.delivered_hit_tokens) <= 0.1 * best
        cs = await cluster.stub.GetClusterState(pb.ClusterStateRequest())
        assert {w.state.worker_id for w in cs.workers} == {"p0", "p1", "d0"} and not cs.degraded
        assert cs.index_entries > 0 and cs.events_applied > 0 and cs.delivered_prefix_hit_rate > 0.5
        assert sum(d.requests for d in cs.decisions if d.role == "prefill") == len(reqs) + 1
        # Asked for its prompt's logprobs, a cached prompt is computed whole where it is prefilled:
        # no hit to report, though the decode worker holds its blocks.
        t, p = reqs[-1]
        await cluster.generate("whole", p, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0))
        assert cluster.routes["whole"].delivered_hit_tokens == cluster.usage["whole"].cached_tokens == 0
        await cluster.all_free()

    asyncio.run(run())


def test_redis_outage_and_dead_prefill_lose_no_request(workers, redis_server, tiny_llama, hf_greedy):
    cluster = Cluster(workers, redis_server, num_prefill=2)

    async def run():
        await cluster.start()
        try:
            await body()
        finally:
            await cluster.stop()

    async def body():
        prompts = [list(range(5 + i, 25 + i)) for i in range(12)]
        expected = [hf_greedy(tiny_llama, p, 6) for p in prompts]
        results = []
        for i, p in enumerate(prompts):
            if i == 3:
                redis_server.kill()
            if i == 7:
                redis_server.start()
            results.append(await cluster.generate(f"r{i}", p))
        assert results == expected  # zero failed requests while Redis was away
        deadline = time.monotonic() + 15
        while cluster.view.degraded or cluster.view.index.size == 0:
            assert time.monotonic() < deadline, "index did not catch up after Redis returned"
            await asyncio.sleep(0.1)
        # A prefill worker dies; its registration lingers until its TTL: the router retries elsewhere.
        cluster.prefills[0].kill()
        more = [await cluster.generate(f"k{i}", p) for i, p in enumerate(prompts[:4])]
        assert more == expected[:4]
        await cluster.all_free()

    asyncio.run(run())


def test_cancelled_stream_frees_blocks_everywhere(workers, redis_server, tiny_model_factory):
    """Cancelled a few tokens into thousands, the request is aborted on the workers at once: all
    blocks are back long before it could have run to its end."""
    model = tiny_model_factory("llama", max_position_embeddings=LONG_CONTEXT)
    cluster = Cluster(workers, redis_server, num_prefill=1, model=model, num_blocks=LONG_CONTEXT // 8 + 16)

    async def run():
        await cluster.start()
        try:
            await body()
        finally:
            await cluster.stop()

    async def body():
        prompt = list(range(3, 40))
        params = SamplingParams(temperature=0, max_tokens=LONG_CONTEXT - len(prompt), ignore_eos=True)
        before = (await state(cluster.decode.address, "decode")).stats.generation_tokens
        call = cluster.stub.Generate(
            pb.GenerateRequest(request_id="c", prompt_token_ids=prompt, params=params_to_proto(params))
        )
        got = 0
        async for msg in call:
            got += len(msg.tokens.token_ids)
            if got >= 4:
                call.cancel()
                break
        await cluster.all_free(timeout=10)
        assert cluster.router.active == 0
        generated = (await state(cluster.decode.address, "decode")).stats.generation_tokens - before
        assert got - 1 <= generated < params.max_tokens // 2  # aborted, not run to its end
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await cluster.generate("bad", [1, 2, 99999])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    asyncio.run(run())


def test_dead_decode_worker_is_swapped_before_its_record_expires(
    workers, redis_server, tiny_llama, hf_greedy
):
    """d0 dies but stays registered until its TTL; the router, finding it unreachable before any token
    came from it, moves the Decode to d1 and avoids d0 from then on (a suspect): no request fails."""
    cluster = Cluster(workers, redis_server, num_prefill=1, num_decode=2)

    async def run():
        await cluster.start()
        try:
            cluster.decodes[0].kill()  # idle workers tie; d0 wins the tie, so requests go there first
            prompts = [list(range(7 + i, 30 + i)) for i in range(3)]
            got = [await cluster.generate(f"x{i}", p) for i, p in enumerate(prompts)]
            assert got == [hf_greedy(tiny_llama, p, 6) for p in prompts]
            assert cluster.router.stats.decode_retries == 1 and "d0" in cluster.router.suspects
            assert [cluster.routes[f"x{i}"].decode_worker for i in range(3)] == ["d0", "d1", "d1"]
            await cluster.all_free()
        finally:
            await cluster.stop()

    asyncio.run(run())


def test_draining_flag_refuses_new_requests_until_cleared(workers, redis_server, tiny_llama, hf_greedy):
    cluster = Cluster(workers, redis_server, num_prefill=1)
    prompt = list(range(9, 30))

    async def wait_view(draining: bool) -> None:
        deadline = time.monotonic() + 10
        while cluster.view.draining != draining:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)

    async def run():
        await cluster.start()
        try:
            set_draining(connect(redis_server.url), True)
            await wait_view(True)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await cluster.generate("refused", prompt)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in err.value.details()
            cs = await cluster.stub.GetClusterState(pb.ClusterStateRequest())
            assert cs.draining and cs.requests_routed == 0
            set_draining(connect(redis_server.url), False)
            await wait_view(False)
            assert await cluster.generate("after", prompt) == hf_greedy(tiny_llama, prompt, 6)
            await cluster.all_free()
        finally:
            await cluster.stop()

    asyncio.run(run())


def test_sampling_controls_equal_the_engine_alone_disaggregated_and_aggregated(
    workers, redis_server, tiny_llama
):
    """Penalties, logit_bias, min_tokens and bad words reach both workers: the prefill worker samples
    the first token under them, the decode worker the rest (with the first token counted as output);
    greedy and seeded outputs equal the engine alone, disaggregated and prefilled on the decode worker."""
    plist = [
        SamplingParams(
            temperature=0,
            max_tokens=10,
            presence_penalty=1.5,
            frequency_penalty=0.5,
            repetition_penalty=1.3,
            logit_bias={77: 3.0, 987: -5.0},
            bad_words_token_ids=[[95, 862], [881]],
            min_tokens=4,
        ),
        SamplingParams(
            temperature=0.8, seed=11, max_tokens=10, frequency_penalty=2.0, min_tokens=8, logit_bias={2: 50.0}
        ),
        SamplingParams(temperature=0, max_tokens=10, presence_penalty=-2.0, bad_words_token_ids=[[987]]),
    ]
    prompts = [[5, 9, 9, 17, 3, 3, 3, 40], list(range(100, 130)), [100, 7, 7, 250, 31, 31, 2, 8, 90, 12, 13]]
    llm = LLM(str(tiny_llama), num_blocks=128, block_size=8)
    want = [llm.generate(p, s, use_tqdm=False)[0].outputs[0].token_ids for p, s in zip(prompts, plist)]
    plain = [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert any(w[:6] != g for w, g in zip(want, plain))
    cluster = Cluster(workers, redis_server, num_prefill=1)

    async def run():
        await cluster.start()
        try:
            for mode in ("disaggregated", "aggregated"):
                cluster.router.local_prefill_tokens = 0 if mode == "disaggregated" else 10**6
                for i, (p, s) in enumerate(zip(prompts, plist)):
                    rid = f"{mode}-{i}"
                    assert await cluster.generate(rid, p, s) == want[i], (mode, i)
                    if mode == "disaggregated":
                        assert cluster.routes[rid].prefill_worker == "p0"
            assert cluster.router.stats.local_prefills == len(prompts)
            await cluster.all_free()
        finally:
            await cluster.stop()

    asyncio.run(run())


def test_structured_output_equals_the_engine_alone_disaggregated_and_aggregated(
    workers, redis_server, byte_level_model
):
    """The prefill worker samples the first token under the grammar; the decode worker rebuilds the
    grammar state from it (nothing but the spec crosses the wire) and the outputs equal the engine
    alone; a spec the workers cannot compile is refused with INVALID_ARGUMENT and the reason."""
    import json

    import jsonschema

    from engine.sampling_params import StructuredOutput

    schema = {
        "type": "object",
        "properties": {
            "pet": {"enum": ["cat", "dog"]},
            "age": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["pet", "age"],
        "additionalProperties": False,
    }
    plist = [
        SamplingParams(
            temperature=0, max_tokens=40, structured=StructuredOutput("json_schema", json.dumps(schema))
        ),
        SamplingParams(
            temperature=1.0, seed=5, max_tokens=30, structured=StructuredOutput("regex", r"[a-c]{2,5}-[0-9]")
        ),
    ]
    prompts = [list(range(10, 30)), [100, 7, 7, 250, 31, 31, 8, 90, 12, 13]]
    llm = LLM(str(byte_level_model), num_blocks=128, block_size=8)
    want = [llm.generate(p, s, use_tqdm=False)[0].outputs[0] for p, s in zip(prompts, plist)]
    jsonschema.validate(json.loads(want[0].text), schema)
    cluster = Cluster(workers, redis_server, num_prefill=1, model=byte_level_model)

    async def run():
        await cluster.start()
        try:
            for mode in ("disaggregated", "aggregated"):
                cluster.router.local_prefill_tokens = 0 if mode == "disaggregated" else 10**6
                for i, (p, s) in enumerate(zip(prompts, plist)):
                    assert await cluster.generate(f"{mode}-{i}", p, s) == want[i].token_ids, (mode, i)
            bad = SamplingParams(temperature=0, max_tokens=4, structured=StructuredOutput("regex", "([a-z"))
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await cluster.generate("bad", prompts[0], bad)
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "compile" in exc.value.details()
            await cluster.all_free()
        finally:
            await cluster.stop()

    asyncio.run(run())


@pytest.mark.parametrize("method", ["draft_model", "early_exit"])
def test_speculating_decode_worker_equals_the_engine_alone(
    workers, redis_server, tiny_llama, tiny_model_factory, method
):
    """The decode worker speculates on a prompt whose KV it pulled: the draft model recomputes the
    prompt into its own cache, early exit reads the pulled KV of the target's first layer. Greedy
    output equals the engine without speculation, seeded sampling equals the engine alone with the
    same speculation, disaggregated and aggregated; the acceptance counters reach GetState."""
    import json

    draft = tiny_model_factory("llama", num_hidden_layers=1, seed=7)
    spec = {
        "draft_model": {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3},
        "early_exit": {"method": "early_exit", "num_layers": 1, "num_speculative_tokens": 3},
    }[method]
    prompts = [[5, 9, 9, 17, 3, 3, 3, 40] * 3, list(range(100, 130)), [100, 7, 7, 250, 31]]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=20, ignore_eos=True)
    plain = LLM(str(tiny_llama), num_blocks=128, block_size=8)
    alone = LLM(str(tiny_llama), num_blocks=128, block_size=8, speculative_config=spec)
    want = [plain.generate(p, greedy, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert [alone.generate(p, greedy, use_tqdm=False)[0].outputs[0].token_ids for p in prompts] == want
    want_seeded = [alone.generate(p, seeded, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    cluster = Cluster(workers, redis_server, 1, decode_flags=("--speculative-config", json.dumps(spec)))

    async def run():
        await cluster.start()
        try:
            for mode in ("disaggregated", "aggregated"):
                cluster.router.local_prefill_tokens = 0 if mode == "disaggregated" else 10**6
                for i, p in enumerate(prompts):
                    assert await cluster.generate(f"{mode}-{i}", p, greedy) == want[i], (mode, i)
                    assert await cluster.generate(f"{mode}-s{i}", p, seeded) == want_seeded[i], (mode, i)
            stats = (await state(cluster.decode.address, "decode")).stats
            assert stats.spec_num_drafts > 0 and stats.spec_draft_tokens >= stats.spec_accepted_tokens
            assert len(stats.spec_accepted_per_position) == 3
            await cluster.all_free()
        finally:
            await cluster.stop()

    asyncio.run(run())
