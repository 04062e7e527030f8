"""``DecodeStream``: many Decode calls on one call stream (``proto.call_stream``, both ends), over a
real gRPC server and over the worker's plain socket (``proto.socket_stream``), each test run on both.
Each call sees what a Decode call of its own would: its messages in order, the status it was refused
with, its deadline, cancellation that reaches the worker, and UNAVAILABLE when the worker goes away;
messages that exist together travel together in one batch."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from proto import socket_stream
from proto.call_stream import CallMux, MultiplexedDecode, MultiplexedPrefill, serve_calls
from proto.socket_stream import CallStreamServer, SocketCall
from tests.proto.served_stream import TRANSPORTS, Served, collect, until


class SteppedDecode(MultiplexedDecode, pb_grpc.DecodeWorkerServicer):
    """Every call emits one token per ``step()``, all calls at once (as an engine step wakes its
    streams); a prompt of [0] is refused, [1] never answers."""

    def __init__(self) -> None:
        self.tick = asyncio.Event()
        self.started: list[str] = []
        self.cancelled: list[str] = []
        self.batch_sizes: list[int] = []

    def step(self) -> None:
        self.tick.set()
        self.tick = asyncio.Event()

    async def Decode(self, request: pb.DecodeRequest, context):
        rid = request.request_id
        if list(request.prompt_token_ids) == [0]:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{rid}: prompt refused")
        self.started.append(rid)
        done = False
        try:
            for i in range(request.params.max_tokens):
                await self.tick.wait()
                yield pb.GenerateResponse(tokens=pb.TokenChunk(token_ids=[i]))
            yield pb.GenerateResponse(finished=pb.Finished(finish_reason="length"))
            done = True
        finally:
            if not done:
                self.cancelled.append(rid)

    async def DecodeStream(self, request_iterator, context):
        async for batch in serve_calls(self.Decode, "decode", request_iterator):
            self.batch_sizes.append(len(batch.items))
            yield batch


async def _serve(servicer, transport: str) -> Served:
    return await Served(servicer, transport).start()


def _request(rid: str, prompt: list[int], max_tokens: int = 3) -> pb.DecodeRequest:
    return pb.DecodeRequest(
        request_id=rid, prompt_token_ids=prompt, params=pb.SamplingParams(max_tokens=max_tokens)
    )


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_step_of_many_calls_travels_as_one_batch_and_each_call_gets_its_own(transport, monkeypatch):
    servicer = SteppedDecode()
    framed = socket_stream.frame

    def counted(msg) -> bytes:  # the socket server sends its batches itself, not through DecodeStream
        if isinstance(msg, pb.CallStreamBatch):
            servicer.batch_sizes.append(len(msg.items))
        return framed(msg)

    monkeypatch.setattr(socket_stream, "frame", counted)

    async def main() -> None:
        served = await _serve(servicer, transport)
        mux = served.mux
        try:
            calls = [mux.open(_request(f"r{i}", [5, 6])) for i in range(8)]
            readers = [asyncio.ensure_future(collect(c)) for c in calls]
            await until(lambda: len(servicer.started) == 8, "all eight calls started")
            for _ in range(3):
                n = len(servicer.batch_sizes)
                servicer.step()
                await until(lambda n=n: len(servicer.batch_sizes) > n, "a step's batch went out")
            outs = await asyncio.gather(*readers)
            for out in outs:
                assert [list(m.tokens.token_ids) for m in out[:3]] == [[0], [1], [2]]
                assert out[3].finished.finish_reason == "length" and len(out) == 4
            # Each step's eight tokens left in one message; the last step's with the eight finishes
            # and the eight calls' ends.
            assert servicer.batch_sizes == [8, 8, 24], servicer.batch_sizes
        finally:
            await served.close()

    asyncio.run(main())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_refused_call_ends_with_its_status_and_the_others_go_on(transport):
    async def main() -> None:
        servicer = SteppedDecode()
        served = await _serve(servicer, transport)
        mux = served.mux
        try:
            good, bad = mux.open(_request("good", [5], 1)), mux.open(_request("bad", [0]))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(bad)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details() == "bad: prompt refused"
            reader = asyncio.ensure_future(collect(good))
            await until(lambda: servicer.started == ["good"], "the good call started")
            servicer.step()
            assert [m.WhichOneof("kind") for m in await reader] == ["tokens", "finished"]
        finally:
            await served.close()

    asyncio.run(main())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_cancel_and_deadline_end_the_call_on_the_worker(transport):
    async def main() -> None:
        servicer = SteppedDecode()
        served = await _serve(servicer, transport)
        mux = served.mux
        try:
            left, slow = mux.open(_request("left", [5])), mux.open(_request("slow", [5]), timeout=0.3)
            await until(lambda: len(servicer.started) == 2, "both calls started")
            assert left.cancel() and not left.cancel()
            await until(lambda: "left" in servicer.cancelled, "the cancel reached the worker")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(slow)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await until(lambda: "slow" in servicer.cancelled, "the expired call ended on the worker")
        finally:
            await served.close()

    asyncio.run(main())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_call_fails_unavailable_when_the_worker_goes_and_the_next_uses_a_new_stream(transport):
    async def main() -> None:
        servicer = SteppedDecode()
        served = await _serve(servicer, transport)
        mux = served.mux
        try:
            calls = [mux.open(_request(f"r{i}", [5])) for i in range(3)]
            await until(lambda: len(servicer.started) == 3, "the calls started")
            await served.stop()
            for call in calls:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await collect(call)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(grpc.aio.AioRpcError) as err:  # a new stream, to nobody
                await collect(mux.open(_request("late", [5])))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            await served.close()

    asyncio.run(main())


class HeldPrefill(MultiplexedPrefill, pb_grpc.PrefillWorkerServicer):
    """A unary Prefill whose answers wait for ``release()``; a prompt of [0] is refused."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.started: list[str] = []
        self.cancelled: list[str] = []

    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        rid = request.request_id
        if list(request.prompt_token_ids) == [0]:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{rid}: prompt refused")
        self.started.append(rid)
        try:
            await self.go.wait()
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            raise
        return pb.PrefillResponse(
            handle=pb.KVHandle(request_id=rid, first_token=len(request.prompt_token_ids))
        )


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_prefill_calls_answer_once_refuse_with_their_status_and_cancel_on_the_worker(transport):
    """``PrefillStream``: each Prefill call on the stream gets its own answer, as the unary call
    would; a refusal is the call's status; a cancel reaches the worker's handler."""

    async def main() -> None:
        servicer = HeldPrefill()
        served = await Served(servicer, transport, "prefill").start()
        mux = served.mux
        try:
            calls = {
                rid: mux.open(pb.PrefillRequest(request_id=rid, prompt_token_ids=[1] * n), timeout=60)
                for rid, n in (("a", 3), ("b", 5), ("c", 7))
            }
            refused = mux.open(pb.PrefillRequest(request_id="x", prompt_token_ids=[0]), timeout=60)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await refused.answer()
            assert (
                err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                and "x: prompt refused" in err.value.details()
            )
            await until(lambda: len(servicer.started) == 3, "the three prefills to start")
            calls["c"].cancel()
            await until(lambda: servicer.cancelled == ["c"], "the cancel to reach the worker")
            servicer.go.set()
            answers = {rid: await calls[rid].answer() for rid in ("a", "b")}
            assert {rid: (r.handle.request_id, r.handle.first_token) for rid, r in answers.items()} == {
                "a": ("a", 3),
                "b": ("b", 5),
            }
        finally:
            await served.close()

    asyncio.run(main())


def test_a_caller_leaving_the_socket_cancels_its_calls_and_a_bad_frame_ends_only_its_connection():
    """Over the socket: the caller's connection closing cancels every call it had open on the worker
    (as a cancelled gRPC stream does); a frame over the limit, or bytes that are no request batch,
    end that connection alone, and the server keeps serving others."""

    async def main() -> None:
        servicer = SteppedDecode()
        served = await _serve(servicer, "socket")
        try:
            calls = [served.mux.open(_request(f"r{i}", [5])) for i in range(3)]
            await until(lambda: len(servicer.started) == 3, "the calls started")
            await served.mux.close()
            await until(lambda: sorted(servicer.cancelled) == ["r0", "r1", "r2"], "the calls cancelled")
            for call in calls:
                with pytest.raises(grpc.aio.AioRpcError):
                    await collect(call)
            host, _, port = served.calls.address.rpartition(":")
            for junk in (
                socket_stream._LEN.pack(socket_stream.MAX_FRAME_BYTES + 1),
                b"\x05\x00\x00\x00\xff\xff\xff\xff\xff",
            ):
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(junk)
                await writer.drain()
                assert await reader.read() == b""  # the server closed it
                writer.close()
            mux = CallMux(lambda: SocketCall(served.calls.address), served.calls.address, "decode")
            try:
                call = mux.open(_request("after", [5], 1))
                await until(lambda: "after" in servicer.started, "a new caller's call started")
                servicer.step()
                assert [m.WhichOneof("kind") for m in await collect(call)] == ["tokens", "finished"]
            finally:
                await mux.close()
        finally:
            await served.close()

    asyncio.run(main())


def test_a_socket_nobody_serves_fails_its_calls_unavailable_at_once():
    """A worker that registered a socket and is gone (or an address that cannot be one): every call
    opened to it fails UNAVAILABLE, as over gRPC, rather than waiting for its deadline."""

    async def main() -> None:
        gone = CallStreamServer(SteppedDecode().Decode, "decode")
        address = await gone.start("127.0.0.1")
        await gone.stop()
        for addr in (address, "no-port-here"):
            mux = CallMux(lambda addr=addr: SocketCall(addr), addr, "decode")
            try:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await asyncio.wait_for(collect(mux.open(_request("r", [5]), timeout=60)), 10)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
            finally:
                await mux.close()

    asyncio.run(main())


@pytest.mark.parametrize("reply", ["cut inside a frame", "not a batch"])
def test_a_worker_that_breaks_the_framing_fails_its_calls_unavailable_and_the_next_open_reconnects(reply):
    """A worker (or whatever answers on its port) that dies mid-frame or sends bytes that are no
    batch: every call on that stream fails UNAVAILABLE at once (so the router retries or migrates),
    and the next call opens a new stream instead of joining the dead one."""

    async def main() -> None:
        connections = []

        async def bad_worker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            connections.append(writer)
            await socket_stream.read_frame(reader, pb.CallStreamRequestBatch)  # the call's open
            if reply == "cut inside a frame":
                writer.write(socket_stream._LEN.pack(100) + b"\x0a" * 10)
                await writer.drain()
                writer.transport.abort()
            else:
                writer.write(socket_stream._LEN.pack(4) + b"\xff\xff\xff\xff")
                await writer.drain()

        server = await asyncio.start_server(bad_worker, "127.0.0.1", 0)
        address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        mux = CallMux(lambda: SocketCall(address), address, "decode")
        try:
            first = mux.open(_request("first", [5]), timeout=60)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await asyncio.wait_for(collect(first), 10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
            second = mux.open(_request("second", [5]), timeout=60)
            with pytest.raises(grpc.aio.AioRpcError):
                await asyncio.wait_for(collect(second), 10)
            assert len(connections) == 2  # the second call came on a connection of its own
        finally:
            await mux.close()
            for w in connections:
                w.transport.abort()
            server.close()

    asyncio.run(main())
