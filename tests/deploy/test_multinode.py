"""The multi-node tier: pdserve on a Ray cluster of several nodes, deployed as a cluster operator does.

A head node (``pdserve_head``: the router, the ingress, Serve's controller and proxy) and worker nodes
that advertise ``prefill_gpu`` or ``decode_gpu``, as the KubeRay manifests' worker groups do; each is a
Ray node of its own (its own raylet) on this machine (``ray_nodes.RayNodes``). The application is the
Serve config of ``deploy/kuberay/`` with only the model and the sizes changed for a CPU, started by
``pdserve serve --address <the cluster> --config <it>``; Redis is a real ``redis-server``. In order:

1. replicas land on the nodes their role asks for; KV moves over NIXL from a prefill node to a decode
   node; greedy output equals the engine alone's;
2. a new prefill node joins and ``pdserve scale --prefill 2`` puts the new replica on it;
3. a decode node is lost mid-stream (its raylet killed, its processes gone): every stream completes
   with the same text (migrated to the other decode worker), the router's index drops the lost
   worker's blocks, and when a new decode node joins the replica comes back there;
4. a prefill node is lost with prefills routed to it (its processes frozen first, so that they wait
   there): the prefills retry on the other one, the output is unchanged.

After each test every worker is idle with all its KV blocks free. Run the tier alone with
``bash scripts/test.sh -m multinode`` (about 3 minutes here).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import secrets
import signal
import threading
import time
from pathlib import Path

import openai
import pytest
import yaml
from conftest import API_KEY, ServeProcess, make_serve_model
from ray_nodes import RayNodes

from engine import LLM, SamplingParams

pytestmark = [pytest.mark.multinode, pytest.mark.ray, pytest.mark.slow, pytest.mark.reliability]

APP = "pdserve"
SERVE_CONFIG = Path(__file__).parents[2] / "deploy" / "kuberay" / "serve_config.yaml"
PROMPT_LEN, MAX_TOKENS = 96, 40
# Streams still running seconds after their first token, when a node is lost (320 tokens took ~1 s:
# under a loaded full-suite run every stream had ended before the test reacted to the first token).
LONG_TOKENS = 1200
CONTEXT = 2048
BLOCK_SIZE = 16  # the engine's default
# 6 requests of up to 81 blocks each: a lost decode worker's streams fit on the other one.
DECODE_BLOCKS = 6 * -(-(PROMPT_LEN + LONG_TOKENS) // BLOCK_SIZE) + 32


def operator_config(model: Path, tmp_path: Path) -> Path:
    """The KubeRay Serve config with a CPU's sizes: the tiny model, no GPUs, fixed replica counts (no
    autoscaler, so ``pdserve scale`` decides); placement resources and everything else as shipped."""
    serve_config = yaml.safe_load(SERVE_CONFIG.read_text())
    args = serve_config["applications"][0]["args"]
    assert args["prefill"]["resources"] == {"prefill_gpu": 1.0}, "the test follows the shipped placement"
    assert args["decode"]["resources"] == {"decode_gpu": 1.0}
    assert args["router"]["resources"] == args["ingress"]["resources"] == {"pdserve_head": 0.01}
    args.update(model=str(model), served_model_name="tiny", tiny_model=True)
    args["engine"] = {"num_blocks": DECODE_BLOCKS}
    for role, count in (("prefill", 1), ("decode", 2)):
        args[role].update(num_replicas=count, num_gpus=0.0, num_cpus=0.5)
    args.pop("autoscaling", None)
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump(serve_config))
    return path


@pytest.fixture(scope="module")
def serve_model(tmp_path_factory) -> Path:
    """conftest's tiny random Llama with a context long enough for ``LONG_TOKENS``."""
    return make_serve_model(tmp_path_factory, "serve-model-long", max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def ray_auth() -> dict[str, str]:
    """Ray's token auth, on as in the KubeRay manifests: the cluster and ``pdserve serve`` share it."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}


@pytest.fixture(scope="module")
def nodes(module_redis_server, ray_auth):
    env = {"PDSERVE_REDIS_URL": module_redis_server.url, "PDSERVE_API_KEY": API_KEY, **ray_auth}
    cluster = RayNodes(env, head_resources={"pdserve_head": 1.0})
    try:
        cluster.add("prefill-1", {"prefill_gpu": 1.0})
        cluster.add("decode-1", {"decode_gpu": 1.0})
        cluster.add("decode-2", {"decode_gpu": 1.0})
        yield cluster
    finally:
        cluster.shutdown()


@pytest.fixture(scope="module")
def service(serve_model, module_redis_server, nodes, ray_auth, tmp_path_factory):
    config = operator_config(serve_model, tmp_path_factory.mktemp("operator"))
    svc = ServeProcess(
        serve_model,
        module_redis_server.url,
        *("--address", nodes.address, "--config", str(config)),
        env=ray_auth,
    )
    yield svc
    svc.kill()


@pytest.fixture(autouse=True)
def blocks_back(service):
    yield
    service.wait_idle(timeout_s=120)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(11)
    return [[rng.randrange(10, 1000) for _ in range(PROMPT_LEN)] for _ in range(6)]


def engine_alone(model: Path, prompts, max_tokens: int = MAX_TOKENS) -> list[str]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].text for o in LLM(str(model), num_blocks=512).generate(prompts, params)]


@pytest.fixture(scope="module")
def references(serve_model, prompts):
    return engine_alone(serve_model, prompts)


def roles_by_node(nodes: RayNodes) -> dict[str, set[str]]:
    """Serve deployment -> the names of the nodes its replicas run on."""
    return {dep: {name for name, _ in where} for dep, where in nodes.placement(APP).items()}


def node_of(nodes: RayNodes, deployment: str, pid: int) -> str:
    return next(name for name, p in nodes.placement(APP)[deployment] if p == pid)


def wait_for(cond, what: str, timeout_s: float = 180):
    deadline = time.monotonic() + timeout_s
    while not (value := cond()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f}s waiting until {what}"
        time.sleep(0.5)
    return value


async def stream_all(
    svc: ServeProcess, prompts, during=None, max_tokens: int = MAX_TOKENS, after: int | None = None
) -> list[str]:
    """Stream greedy completions of ``prompts``; ``during()`` runs (in a thread) once ``after`` of the
    streams (default: all) have had their first token. The thread waits on a ``threading.Event``, so it
    runs at once rather than when this event loop, busy reading six streams, gets to it (a second or
    more on a loaded machine)."""
    client = openai.AsyncOpenAI(base_url=svc.base + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
    started, abandoned = threading.Event(), threading.Event()
    first = 0

    def when_started() -> None:
        assert started.wait(240), "no stream had its first token within 240 s"
        if not abandoned.is_set():
            during()

    async def one(prompt) -> str:
        nonlocal first
        stream = await client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        parts: list[str] = []
        async for chunk in stream:
            if not parts:
                first += 1
                if first == (after or len(prompts)):
                    started.set()
            parts.append(chunk.choices[0].text)
        return "".join(parts)

    try:
        runs = [asyncio.to_thread(when_started)] if during is not None else []
        out = await asyncio.gather(*(one(p) for p in prompts), *runs)
        return out[: len(prompts)]
    finally:
        abandoned.set()  # (a stream failed: the thread neither runs ``during`` nor waits out its 240 s)
        started.set()
        await client.close()


def decode_idle(status: dict) -> bool:
    """Whether the router's view (the workers' heartbeats) shows every decode worker with nothing
    running or waiting (a protobuf field at zero is left out of the JSON)."""
    decodes = [w["state"] for w in status["cluster"]["workers"] if w["state"]["role"] == "decode"]
    return all(not s["stats"].get("numRunning") and not s["stats"].get("numWaiting") for s in decodes)


def decode_decisions(status: dict) -> dict[str, int]:
    """Decode worker -> the Decode calls the router opened there so far."""
    return {
        d["workerId"]: int(d["requests"]) for d in status["cluster"]["decisions"] if d["role"] == "decode"
    }


def workers_of(status: dict, role: str) -> list[dict]:
    return [w for w in status["workers"] if w["role"] == role]


def test_replicas_land_on_their_role_nodes_and_kv_crosses_nodes(service, nodes, prompts, references):
    placed = roles_by_node(nodes)
    status = service.status()
    assert len(workers_of(status, "prefill")) == 1 and len(workers_of(status, "decode")) == 2, status
    assert placed["Prefill"] == {"prefill-1"}, placed
    assert placed["Decode"] == {"decode-1", "decode-2"}, placed
    assert placed["Router"] == placed["Ingress"] == {"head"}, placed
    assert asyncio.run(stream_all(service, prompts)) == references
    moved = {
        dict(labels)["worker"]: value
        for (name, labels), value in service.metrics().items()
        if name == "pdserve_kv_transfer_bytes_total"
    }
    # Every request's KV went from the prefill node to a decode node over NIXL (UCX between nodes).
    assert sum(v for w, v in moved.items() if w.startswith("decode-")) > 0, moved


def test_scale_puts_a_new_prefill_replica_on_a_joining_node(service, nodes, prompts, references):
    nodes.add("prefill-2", {"prefill_gpu": 1.0})
    service.cli("scale", "--prefill", "2")
    service.wait_workers(prefill=2, decode=2)
    assert roles_by_node(nodes)["Prefill"] == {"prefill-1", "prefill-2"}
    assert asyncio.run(stream_all(service, prompts)) == references


def test_losing_a_decode_node_mid_stream_loses_no_request(service, nodes, prompts, serve_model):
    expected = engine_alone(serve_model, prompts, LONG_TOKENS)  # streams long enough to be cut
    status = service.status()
    node_of_worker = {w["workerId"]: node_of(nodes, "Decode", w["pid"]) for w in workers_of(status, "decode")}
    worker = min(node_of_worker)
    lost = {"worker": worker, "node": node_of_worker[worker]}
    pids = nodes.processes(lost["node"], APP)
    before = decode_decisions(status)
    # The router weighs each decode worker's load by its own count and by what the worker's last
    # heartbeat showed: the burst starts once those show the last test's streams gone.
    wait_for(lambda: decode_idle(service.status()), "the decode workers' heartbeats show them idle")

    def lose_a_decode_node() -> None:
        # The first stream has just had its first token, so no stream is near its end (each needs
        # LONG_TOKENS tokens): whatever the worker holds now, or is sent after the freeze, must move.
        # The node's processes freeze at once, then the node is lost (taking it down takes a while,
        # and a fast engine finished every stream meanwhile; so did one frozen only after its state
        # was read over /metrics, which under load took longer than the streams).
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        nodes.lose(lost["node"], pids)

    out = asyncio.run(
        stream_all(service, prompts, during=lose_a_decode_node, max_tokens=LONG_TOKENS, after=1)
    )
    assert out == expected
    cluster = service.status()["cluster"]
    # Its streams moved to the other decode worker: mid-stream (a migration), or before their first
    # decode step (a Decode call retried elsewhere).
    counts = {k: cluster.get(k) for k in ("migrations", "decodeRetries", "failedRequests", "stalls")}
    assert cluster["failedRequests"] == 0, counts
    opened = decode_decisions(service.status())
    if opened.get(lost["worker"], 0) > before.get(lost["worker"], 0):
        # The router sent it streams (before the freeze or after): each moved to the other decode
        # worker, mid-stream (a migration) or before its first decode step (a Decode call retried).
        assert cluster["migrations"] + cluster["decodeRetries"] >= 1, (before, opened, counts)
    else:  # the router sent them all to the other one: it served them all
        survivor = next(w for w in opened if w != lost["worker"])
        assert opened[survivor] - before.get(survivor, 0) >= len(prompts), (before, opened)
    # The router's index drops the lost worker's blocks (once its record's grace period is over).
    wait_for(
        lambda: lost["worker"] not in {w["workerId"] for w in service.status()["cluster"]["indexed"]},
        f"the index drops {lost['worker']}",
    )
    # A node with the role's resource joins: Serve starts the lost replica again, there.
    nodes.add("decode-3", {"decode_gpu": 1.0})
    service.wait_workers(prefill=2, decode=2)
    assert roles_by_node(nodes)["Decode"] == {"decode-1", "decode-2", "decode-3"} - {lost["node"]}
    assert asyncio.run(stream_all(service, prompts, max_tokens=LONG_TOKENS)) == expected


def test_losing_a_prefill_node_with_prefills_on_it_loses_no_request(service, nodes, serve_model):
    rng = random.Random(5)  # new prompts: nothing cached, every request needs its prefill
    prompts = [[rng.randrange(10, 1000) for _ in range(3 * PROMPT_LEN)] for _ in range(6)]
    expected = engine_alone(serve_model, prompts)
    before = service.status()
    victim = workers_of(before, "prefill")[-1]
    node = node_of(nodes, "Prefill", victim["pid"])
    pids = nodes.processes(node, APP)
    routed = {d["workerId"]: d["requests"] for d in before["cluster"]["decisions"] if d["role"] == "prefill"}

    def routed_to_victim() -> int:
        decisions = service.status()["cluster"]["decisions"]
        return next((d["requests"] for d in decisions if d["workerId"] == victim["workerId"]), 0)

    def lose_once_prefills_wait_there() -> None:
        wait_for(lambda: routed_to_victim() > routed.get(victim["workerId"], 0), "a prefill is routed there")
        nodes.lose(node, pids)

    async def run() -> list[str]:
        for pid in pids:  # frozen: the prefills routed to it wait there until the node is lost
            os.kill(pid, signal.SIGSTOP)
        loser = asyncio.create_task(asyncio.to_thread(lose_once_prefills_wait_there))
        try:
            return await stream_all(service, prompts)
        finally:
            await loser

    assert asyncio.run(run()) == expected
    cluster = service.status()["cluster"]
    assert cluster["prefillRetries"] + cluster["stalls"] > 0 and cluster["failedRequests"] == 0, cluster
