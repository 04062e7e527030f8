"""The front end's router client (``router.client.RouterClient``) over a router that restarts or
refuses: a router restarted at the same gRPC address serves again through the same client (it has a
new socket port, which the client reads again when the stream breaks; it kept dialling the old one,
503 for every request until the front end restarted), and a live router's own UNAVAILABLE is its
answer, not a reason to reconnect (reconnecting closed the stream under every other request on it)."""

from __future__ import annotations

import asyncio
import itertools
import signal
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from engine.sampling_params import SamplingParams
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from proto.call_stream import MultiplexedGenerate
from proto.socket_stream import CallStreamServer
from router.client import RouterClient

ROOT = Path(__file__).resolve().parents[2]
NO_DECODE = "no decode worker"  # the router's own answer with no worker registered


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _router(port: int, redis_url: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "router", "--redis-url", redis_url, "--port", str(port)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    line = proc.stdout.readline()  # it prints LISTENING once it serves
    assert line.startswith("LISTENING"), line
    return proc


async def _answer(client: RouterClient, rid: str) -> str:
    try:
        async for _ in client.generate(rid, [1, 2, 3], SamplingParams(max_tokens=2), 0, 30.0):
            pass
        return "served"
    except grpc.aio.AioRpcError as exc:
        return f"{exc.code().name}: {exc.details()}"


def test_a_router_restarted_at_the_same_address_serves_the_same_client_again(redis_server):
    port = _free_port()
    address = f"127.0.0.1:{port}"
    procs = [_router(port, redis_server.url)]

    async def resolve() -> str:
        return address

    async def main() -> list[str]:
        client = RouterClient(resolve)
        try:
            before = await _answer(client, "before")
            first = (await client.cluster_state()).call_streams
            procs[0].send_signal(signal.SIGTERM)
            procs[0].wait(timeout=30)
            procs.append(_router(port, redis_server.url))
            after = [await _answer(client, f"after-{i}") for i in range(2)]
            return [before, first, (await client.cluster_state()).call_streams, *after]
        finally:
            await client.close()

    try:
        before, first, second, *after = asyncio.run(main())
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=30)
    assert first and second and first != second  # the socket's port changed with the restart
    for answer in (before, *after):  # the router's own answer, not "cannot connect"
        assert answer.startswith("UNAVAILABLE") and NO_DECODE in answer, answer


class _StandInRouter(MultiplexedGenerate, pb_grpc.RouterServicer):
    """Streams one token per wake-up for most requests; refuses ``refused-*`` with UNAVAILABLE at
    once, as a live router says it has no decode worker."""

    def __init__(self) -> None:
        self.call_streams, self.cancelled, self.go = "", [], asyncio.Event()

    async def GetClusterState(self, request, context):
        return pb.ClusterState(call_streams=self.call_streams)

    async def Generate(self, request, context):
        if request.request_id.startswith("refused"):
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no decode worker is registered")
        try:
            yield pb.GenerateResponse(tokens=pb.TokenChunk(token_ids=[1]))
            await self.go.wait()  # the others stream on while one is refused
            yield pb.GenerateResponse(finished=pb.Finished(finish_reason="length"))
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise


@pytest.mark.parametrize("socket_streams", [True, False], ids=["socket", "grpc"])
def test_a_live_routers_refusal_cuts_no_other_request_on_its_stream(socket_streams):
    async def start():
        svc, server = _StandInRouter(), grpc.aio.server()
        pb_grpc.add_RouterServicer_to_server(svc, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        calls = CallStreamServer(svc.Generate, "generate")
        if socket_streams:
            svc.call_streams = await calls.start("127.0.0.1")
        return svc, server, calls, f"127.0.0.1:{port}"

    async def main():
        a, b = await start(), await start()
        replicas = itertools.cycle([a[3], b[3]])  # a Serve handle spreads the lookups over replicas

        async def resolve() -> str:
            return next(replicas)

        client = RouterClient(resolve)
        firsts = asyncio.Queue()

        async def healthy(rid: str) -> str:
            try:
                async for msg in client.generate(rid, [1], SamplingParams(max_tokens=2), 0, 30.0):
                    if msg.WhichOneof("kind") == "tokens":
                        firsts.put_nowait(rid)
                return "served"
            except grpc.aio.AioRpcError as exc:
                return f"{exc.code().name}: {exc.details()}"

        running = [asyncio.create_task(healthy(f"healthy-{i}")) for i in range(3)]
        for _ in running:
            await firsts.get()  # each one streams
        refused = await _answer(client, "refused-1")
        a[0].go.set()
        done = await asyncio.gather(*running)
        await client.close()
        for _svc, server, calls, _ in (a, b):
            await calls.stop()
            await server.stop(0)
        return refused, done, a[0].cancelled

    refused, done, cancelled = asyncio.run(main())
    assert refused == "UNAVAILABLE: no decode worker is registered"
    assert done == ["served"] * 3 and cancelled == [], (done, cancelled)
