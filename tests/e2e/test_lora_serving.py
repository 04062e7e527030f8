"""LoRA adapters over the real path: worker processes (in-process and split engines), real NIXL moving
an adapter's KV from the prefill worker to the decode worker, the router's real gRPC and Redis.
Greedy output of every adapter equals the engine alone's (itself equal to HF transformers + peft:
tests/engine/test_lora.py); the router hashes an adapter's prompts in the adapter's namespace (a
repeat under the same adapter is a predicted hit, the same prompt under another adapter is not) and
sends a request only to workers that serve its adapter."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import grpc
import pytest
from test_router import Cluster, all_free

from engine import LLM
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [list(range(100, 140)), [5, 9, 9, 17, 3, 3, 3, 40] * 3, [7, 8, 300, 2]]
NEW = list(range(500, 540))


@pytest.fixture(scope="module")
def adapters(tiny_llama, lora_adapter_factory):
    return {
        "a": str(lora_adapter_factory(tiny_llama, seed=1)),
        "b": str(lora_adapter_factory(tiny_llama, seed=2, r=4, targets=("q_proj", "v_proj", "down_proj"))),
    }


def _alone(model, adapters, loras, prompts=PROMPTS) -> list[list[int]]:
    llm = LLM(str(model), num_blocks=128, block_size=8, lora_modules=adapters)
    names = [n for n in loras for _ in prompts]
    outs = llm.generate(prompts * len(loras), GREEDY, lora=names, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _params(lora: str | None) -> SamplingParams:
    return dataclasses.replace(GREEDY, lora=lora)


@pytest.mark.parametrize("split", [False, True], ids=["in-process", "engine-process"])
def test_adapters_disaggregated_equal_the_engine_alone(workers, redis_server, tiny_llama, adapters, split):
    loras = [None, "a", "b"]
    want = _alone(tiny_llama, adapters, loras)
    want_new = _alone(tiny_llama, adapters, ["a", "b"], [NEW])
    flags = ("--lora-modules", json.dumps(adapters), *(("--engine-process",) if split else ()))
    cluster = Cluster(workers, redis_server, 1, kv_flags=flags)

    async def run():
        await cluster.start()
        try:
            cluster.router.local_prefill_tokens = 0  # every prompt prefilled on the prefill worker
            jobs = [
                cluster.generate(f"{name}-{i}", p, _params(name))
                for name in loras
                for i, p in enumerate(PROMPTS)
            ]
            assert await asyncio.gather(*jobs) == want  # all adapters and the base in flight together
            assert all(r.prefill_worker == "p0" for r in cluster.routes.values())
            # A repeat under the same adapter is a predicted hit; under another adapter it is not.
            assert await cluster.generate("a-again", PROMPTS[0], _params("a")) == want[len(PROMPTS)]
            assert cluster.routes["a-again"].predicted_hit_tokens >= 32
            assert cluster.routes["a-again"].delivered_hit_tokens >= 32
            # A prompt only adapter a ran: its repeat hits, under adapter b it is computed afresh.
            assert await cluster.generate("new-a", NEW, _params("a")) == want_new[0]
            assert await cluster.generate("new-a2", NEW, _params("a")) == want_new[0]
            assert cluster.routes["new-a2"].predicted_hit_tokens >= 32
            assert await cluster.generate("new-b", NEW, _params("b")) == want_new[1]
            assert cluster.routes["new-b"].predicted_hit_tokens == 0
            assert cluster.routes["new-b"].delivered_hit_tokens == 0
            # Each worker's heartbeat says which adapters sit in its device slots (the router's tie-break).
            while not all(w.resident("a") and w.resident("b") for w in cluster.view.live_workers()):
                await asyncio.sleep(0.05)
            await cluster.all_free()
        finally:
            await cluster.stop()

    asyncio.run(run())


def test_requests_go_only_to_workers_that_serve_their_adapter(workers, redis_server, tiny_llama, adapters):
    # Aggregated (no prefill workers): d0 serves adapter a, d1 serves none.
    per_decode = (("--lora-modules", json.dumps({"a": adapters["a"]})), ())
    cluster = Cluster(workers, redis_server, 0, num_decode=2, decode_flags=per_decode)
    want = _alone(tiny_llama, {"a": adapters["a"]}, ["a"])

    async def run():
        await cluster.start()
        try:
            got = await asyncio.gather(
                *(cluster.generate(f"a{i}", p, _params("a")) for i, p in enumerate(PROMPTS))
            )
            assert got == want
            decided = {w: n for (role, w), n in cluster.router.decisions.items() if role == "decode" and n}
            assert decided == {"d0": len(PROMPTS)}, decided
            with pytest.raises(
                grpc.aio.AioRpcError, match="no decode worker that serves the adapter 'zz'"
            ) as err:
                await cluster.generate("zz", PROMPTS[0], _params("zz"))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND  # the edge answers 404, not 503
            await cluster.all_free()
        finally:
            await cluster.stop()

    asyncio.run(run())


def test_openai_http_selects_adapters_by_model(workers, redis_server, tiny_llama, adapters):
    """The whole path without Ray (workers, router and ingress processes), adapters given with
    ``--lora NAME=PATH``: the model names the adapter, /v1/models lists them, an unknown model is a
    404 in OpenAI's schema, and the text equals the engine alone's under the same adapter."""
    from test_standalone_stack import _get, _post, _spawn

    url = redis_server.url
    loras = [f for name, path in adapters.items() for f in ("--lora", f"{name}={path}")]
    pd = [
        workers(role, "--redis-url", url, "--worker-id", f"{role[0]}0", *loras)
        for role in ("prefill", "decode")
    ]
    router, router_address = _spawn("router", "--redis-url", url, "--local-prefill-tokens", "0")
    ingress, address = _spawn(
        "ingress", "--model", str(tiny_llama), "--router", router_address, "--port", "0"
    )
    base = f"http://{address}"
    llm = LLM(str(tiny_llama), num_blocks=128, block_size=8, lora_modules=adapters)
    try:
        code, models = _get(base, "/v1/models")
        assert code == 200 and [m["id"] for m in models["data"]] == [str(tiny_llama), "a", "b"], models
        for name in ("a", "b", str(tiny_llama)):
            lora = None if name == str(tiny_llama) else name
            want = llm.generate(PROMPTS[0], GREEDY, lora=lora, use_tqdm=False)[0].outputs[0].text
            body = {
                "model": name,
                "prompt": PROMPTS[0],
                "max_tokens": 10,
                "temperature": 0,
                "ignore_eos": True,
            }
            code, out = _post(base, "/v1/completions", body)
            assert code == 200, out
            assert out["model"] == name and out["choices"][0]["text"] == want, name
        code, out = _post(base, "/v1/completions", {"model": "c", "prompt": "hi", "max_tokens": 2})
        assert code == 404 and out["error"]["code"] == "model_not_found", out
        asyncio.run(all_free(pd))
    finally:
        for proc in (ingress, router):
            proc.terminate()
            proc.wait(15)


def test_loading_and_unloading_at_run_time_under_traffic_loses_no_request(
    workers, redis_server, tiny_llama, adapters
):
    """Workers started with no adapter (``--enable-lora``; the prefill worker's engine in a process of
    its own, the decode worker's in-process): an adapter loaded through the router while base-model
    streams run is routable the moment the call returns; unloading it while a request of it runs is
    refused with the reason where it runs, and succeeds once that request is done. Every stream
    completes with the engine alone's output."""
    from proto import pdserve_pb2 as pb
    from registry.schema import connect, read_adapters

    base_want = _alone(tiny_llama, adapters, [None])
    a_want = _alone(tiny_llama, adapters, ["a"])
    b_as_a_want = _alone(tiny_llama, {"a": adapters["b"]}, ["a"])
    long_params = dataclasses.replace(GREEDY, max_tokens=60)
    long_want = LLM(str(tiny_llama), num_blocks=128, block_size=8).generate(
        PROMPTS, long_params, use_tqdm=False
    )
    cluster = Cluster(
        workers, redis_server, 1, kv_flags=("--enable-lora",), prefill_flags=("--engine-process",)
    )

    async def run():
        await cluster.start()
        try:
            cluster.router.local_prefill_tokens = 0
            traffic = [
                asyncio.ensure_future(cluster.generate(f"bg{i}", p, long_params))
                for i, p in enumerate(PROMPTS)
            ]
            with pytest.raises(grpc.aio.AioRpcError, match="no decode worker that serves the adapter 'a'"):
                await cluster.generate("early", PROMPTS[0], _params("a"))
            loaded = await cluster.stub.Adapter(pb.AdapterRequest(name="a", path=adapters["a"]), timeout=60)
            assert sorted(loaded.workers) == ["d0", "p0"]
            client = connect(redis_server.url)
            try:
                assert read_adapters(client) == {"a": adapters["a"]}
            finally:
                client.close()
            got = [await cluster.generate(f"a{i}", p, _params("a")) for i, p in enumerate(PROMPTS)]
            assert got == a_want
            # Loaded again under its name: refused, unless the load replaces it (load_inplace).
            again = pb.AdapterRequest(name="a", path=adapters["b"])
            with pytest.raises(grpc.aio.AioRpcError, match="'a' is already loaded") as err:
                await cluster.stub.Adapter(again, timeout=60)
            assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
            again.replace = True
            assert sorted((await cluster.stub.Adapter(again, timeout=60)).workers) == ["d0", "p0"]
            got = [await cluster.generate(f"b{i}", p, _params("a")) for i, p in enumerate(PROMPTS)]
            assert got == b_as_a_want  # its new weights, none of the old one's cached prefixes
            # A decode worker that starts now loads the adapter the cluster loaded at run time.
            late = workers("decode", "--redis-url", redis_server.url, "--worker-id", "d1", "--enable-lora")
            cluster.decodes.append(late)
            while not any(w.worker_id == "d1" and w.lora_salt("a") for w in cluster.view.live_workers()):
                await asyncio.sleep(0.05)
            # Unloading while a request of the adapter runs: refused where it runs.
            held = dataclasses.replace(long_params, lora="a", max_tokens=150)  # runs while unloading
            running = asyncio.ensure_future(cluster.generate("a-long", PROMPTS[1], held))
            while "a-long" not in cluster.routes:
                await asyncio.sleep(0.01)
            with pytest.raises(
                grpc.aio.AioRpcError, match=r"in use by 1 unfinished requests \(refused by d0\)"
            ):
                await cluster.stub.Adapter(pb.AdapterRequest(name="a", unload=True), timeout=60)
            await running
            unloaded = await cluster.stub.Adapter(pb.AdapterRequest(name="a", unload=True), timeout=60)
            assert list(unloaded.workers) == ["d0"]  # the others unloaded it when first asked
            client = connect(redis_server.url)
            try:
                assert read_adapters(client) == {}  # a worker that starts now does not load it
            finally:
                client.close()
            with pytest.raises(
                grpc.aio.AioRpcError, match="no decode worker that serves the adapter 'a'"
            ) as err:
                await cluster.generate("late", PROMPTS[0], _params("a"))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            assert [await t for t in traffic] == [o.outputs[0].token_ids for o in long_want]
            await cluster.all_free()
        finally:
            await cluster.stop()

    assert base_want  # (the base outputs of the short runs: the long ones are checked above)
    asyncio.run(run())
