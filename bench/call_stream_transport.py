"""What one streamed call-stream message costs over gRPC and over the worker's plain socket.

The router's Decode and Prefill calls travel on one call stream per worker (``proto.call_stream``),
one ``CallStreamBatch`` per engine step. This measures a message's CPU at each end, the worker
(sender) in a child process and the router (receiver) in this one, for both transports a worker
serves: its gRPC ``DecodeStream`` and its socket (``proto.socket_stream``). The worker's calls are
``--calls`` Decode calls that each emit one token per step, a step every ``--step-us``
microseconds (0: as fast as the reader takes them), so a batch carries ``--calls`` tokens as an
engine step's does.

    python -m bench.call_stream_transport [--messages 10000] [--calls 16] [--step-us 200]
        [--output bench/results/call_stream_transport.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import grpc

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from proto.call_stream import CallMux, MultiplexedDecode
from proto.socket_stream import CallStreamServer, SocketCall
from settings import event_loop

RESULTS = Path(__file__).resolve().parent / "results"


class StepDecode(MultiplexedDecode, pb_grpc.DecodeWorkerServicer):
    """Decode calls that each yield a token per step; the steps are one clock for every call."""

    def __init__(self, step_s: float, calls: int) -> None:
        self.step_s = step_s
        self.tick = asyncio.Event()
        self.steps = 0
        self.cpu_s = 0.0
        self.opened = 0
        self.all_open = asyncio.Event()
        self.calls = calls

    async def run_steps(self, steps: int) -> None:
        t0 = time.process_time()
        for _ in range(steps):
            await asyncio.sleep(self.step_s)  # also lets every call's task run before the next step
            self.tick.set()
            self.tick = asyncio.Event()
            self.steps += 1
        await asyncio.sleep(0.2)  # the last step's batch out
        self.cpu_s = time.process_time() - t0

    async def Decode(self, request: pb.DecodeRequest, context):
        self.opened += 1
        if self.opened == self.calls:
            self.all_open.set()
        for i in range(request.params.max_tokens):
            await self.tick.wait()
            yield pb.GenerateResponse(tokens=pb.TokenChunk(token_ids=[i % 100]))
        yield pb.GenerateResponse(finished=pb.Finished(finish_reason="length"))


async def _worker(transport: str, messages: int, step_s: float, calls: int) -> None:
    """The child: serve, print the address, run the steps once every call is open, print its CPU."""
    servicer = StepDecode(step_s, calls)
    if transport == "socket":
        calls = CallStreamServer(servicer.Decode, "decode")
        address = await calls.start("127.0.0.1")
    else:
        server = grpc.aio.server()
        pb_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
    print(address, flush=True)
    await servicer.all_open.wait()
    await servicer.run_steps(messages)
    print(json.dumps({"cpu_s": servicer.cpu_s, "steps": servicer.steps}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


async def _router(transport: str, a: argparse.Namespace) -> dict:
    flags = ["--messages", str(a.messages), "--step-us", str(a.step_us), "--calls", str(a.calls)]
    child = subprocess.Popen(
        [sys.executable, "-m", "bench.call_stream_transport", "--worker", transport, *flags],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        address = child.stdout.readline().strip()
        if transport == "socket":
            mux = CallMux(lambda: SocketCall(address), address, "decode")
        else:
            channel = grpc.aio.insecure_channel(address)
            mux = CallMux(pb_grpc.DecodeWorkerStub(channel).DecodeStream, address, "decode")
        params = pb.SamplingParams(max_tokens=a.messages)
        t0, c0 = time.perf_counter(), time.process_time()
        calls = [mux.open(pb.DecodeRequest(request_id=f"r{i}", params=params)) for i in range(a.calls)]
        tokens = 0

        async def read(call) -> None:
            nonlocal tokens
            async for msg in call:
                tokens += len(msg.tokens.token_ids)

        await asyncio.gather(*(read(c) for c in calls))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        worker = json.loads(child.stdout.readline())
        await mux.close()
        if transport == "grpc":
            await channel.close()
    finally:
        child.stdin.close()
        child.wait(10)
    n = worker["steps"]  # a batch per step (fewer, larger ones when the reader falls behind)
    return {
        "steps": n,
        "tokens": tokens,
        "receiver_cpu_us_per_step": cpu / n * 1e6,
        "sender_cpu_us_per_step": worker["cpu_s"] / n * 1e6,
        "wall_us_per_step": wall / n * 1e6,
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.call_stream_transport", description=__doc__)
    p.add_argument("--messages", type=int, default=10000, help="steps, so batches, per transport")
    p.add_argument("--calls", type=int, default=16, help="Decode calls open on the stream")
    p.add_argument("--step-us", type=float, default=200.0, help="microseconds between steps")
    p.add_argument("--output", default=str(RESULTS / "call_stream_transport.json"))
    p.add_argument("--worker", choices=("grpc", "socket"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        event_loop.run(_worker(a.worker, a.messages, a.step_us / 1e6, a.calls))
        return {}
    out = {"args": vars(a), "transports": {}}
    for transport in ("grpc", "socket"):
        r = out["transports"][transport] = event_loop.run(_router(transport, a))
        assert r["tokens"] == a.messages * a.calls, r  # every token of every call arrived
        print(
            f"{transport:6s} sender {r['sender_cpu_us_per_step']:6.1f} us CPU/step, receiver "
            f"{r['receiver_cpu_us_per_step']:6.1f}, wall {r['wall_us_per_step']:6.1f} us/step",
            flush=True,
        )
    g, s = out["transports"]["grpc"], out["transports"]["socket"]
    both = {
        t: r["sender_cpu_us_per_step"] + r["receiver_cpu_us_per_step"] for t, r in out["transports"].items()
    }
    out["grpc_over_socket_cpu"] = both["grpc"] / both["socket"]
    print(
        f"gRPC / socket, CPU per step at both ends: {out['grpc_over_socket_cpu']:.2f}x "
        f"(sender {g['sender_cpu_us_per_step'] / s['sender_cpu_us_per_step']:.2f}x, receiver "
        f"{g['receiver_cpu_us_per_step'] / s['receiver_cpu_us_per_step']:.2f}x)"
    )
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps(out, indent=1))
    print(f"wrote {a.output}")
    return out


if __name__ == "__main__":
    main()
