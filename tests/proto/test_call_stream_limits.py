"""Call streams and message size (``proto.stream_limits``), over a real gRPC server and the worker's
socket: a message too large for the receiver fails its own call with RESOURCE_EXHAUSTED and the
other calls on the stream go on; a burst whose total is over the receiver's limit (opens queued
together, or answers produced together) travels in batches under the cap and every call gets all of
it; a reader that falls behind holds the handlers back instead of growing the server's outbox."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from proto import socket_stream
from proto.call_stream import MultiplexedDecode, serve_calls
from proto.stream_limits import BATCH_BYTES, MAX_MESSAGE_BYTES
from tests.proto.served_stream import TRANSPORTS, Served, collect, until

MIB = 1 << 20


def _sized(n: int, i: int = 0) -> pb.GenerateResponse:
    """A message of about ``n`` bytes, its index ``i`` in ``error.code``."""
    return pb.GenerateResponse(error=pb.StreamError(code=str(i), message="x" * n))


class SizedDecode(MultiplexedDecode, pb_grpc.DecodeWorkerServicer):
    """A call yields ``max_tokens`` messages of ``prompt_token_ids[0]`` bytes each, all at once (as
    a step that wakes many streams) after ``go`` when its prompt has a second token."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.started: list[str] = []
        self.ended: list[str] = []  # handlers whose cleanup ran (ended, refused or cancelled)

    async def Decode(self, request: pb.DecodeRequest, context):
        rid = request.request_id.partition("~")[0]  # without its padding
        self.started.append(rid)
        try:
            if len(request.prompt_token_ids) > 1:
                await self.go.wait()
            for i in range(request.params.max_tokens):
                yield _sized(request.prompt_token_ids[0], i)
        finally:
            self.ended.append(rid)


def _open(mux, rid: str, size: int, count: int = 1, wait: bool = False, pad: int = 0):
    request = pb.DecodeRequest(
        request_id=rid + "~" * pad,
        prompt_token_ids=[size, 1] if wait else [size],
        params=pb.SamplingParams(max_tokens=count),
    )
    return mux.open(request, timeout=60)


async def _outcome(call) -> list[int] | str:
    """The sizes of the call's messages, or its error's status."""
    try:
        return [len(m.error.message) for m in await collect(call)]
    except grpc.aio.AioRpcError as exc:
        return f"{exc.code().name}: {exc.details()}"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_message_too_large_for_the_stream_fails_its_own_call_and_the_others_finish(transport):
    """An answer, or an open, over the receiver's limit ends only its own call, RESOURCE_EXHAUSTED;
    a message over the batch cap but under the limit travels alone; the stream stays up."""

    async def main() -> None:
        servicer = SizedDecode()
        served = await Served(servicer, transport).start()
        mux = served.mux
        try:
            others = [_open(mux, f"other-{i}", 1000, 3, wait=True) for i in range(3)]
            large = _open(mux, "large", BATCH_BYTES + MIB, wait=True)  # over the cap, under the limit
            huge = _open(mux, "huge", MAX_MESSAGE_BYTES + 1)  # an answer the receiver would refuse
            huge_open = _open(mux, "huge-open", 1000, pad=MAX_MESSAGE_BYTES)  # an open it would refuse
            huge_end = await _outcome(huge)
            assert huge_end.startswith("RESOURCE_EXHAUSTED") and "limit" in huge_end, huge_end
            assert (await _outcome(huge_open)).startswith("RESOURCE_EXHAUSTED")
            assert "huge" in servicer.ended  # its handler was closed: its request aborted
            assert "huge-open" not in servicer.started  # never sent
            await until(lambda: len(servicer.started) == 5, "the other calls started")
            servicer.go.set()
            outcomes = await asyncio.gather(*map(_outcome, [*others, large]))
            assert outcomes == [[1000] * 3] * 3 + [[BATCH_BYTES + MIB]], [str(o)[:200] for o in outcomes]
            assert await _outcome(_open(mux, "after", 10)) == [10]  # the same stream goes on
        finally:
            await served.close()

    asyncio.run(main())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_burst_of_opens_larger_than_the_limit_travels_in_batches_and_every_call_succeeds(transport):
    """Opens queued together (a burst of long prompts) whose total is over the receiver's limit:
    each is fine alone, so each gets its answer."""

    async def main() -> None:
        servicer = SizedDecode()
        served = await Served(servicer, transport).start()
        try:
            n = MAX_MESSAGE_BYTES // (4 * MIB) + 4
            calls = [_open(served.mux, f"r{i}", 100, pad=4 * MIB) for i in range(n)]
            outcomes = await asyncio.gather(*map(_outcome, calls))
            assert outcomes == [[100]] * n, [str(o)[:200] for o in outcomes if o != [100]][:3]
        finally:
            await served.close()

    asyncio.run(main())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_answers_produced_together_larger_than_the_limit_travel_in_batches_under_the_cap(
    transport, monkeypatch
):
    """Many calls' messages produced at once (a step, or a reader that was behind), over the
    receiver's limit in total: every call gets all of its messages, in batches under the cap."""
    sizes: list[int] = []
    framed = socket_stream.frame

    def counted(msg) -> bytes:
        if isinstance(msg, pb.CallStreamBatch):
            sizes.append(msg.ByteSize())
        return framed(msg)

    monkeypatch.setattr(socket_stream, "frame", counted)

    async def main() -> None:
        servicer = SizedDecode()
        served = await Served(servicer, transport).start()
        try:
            per_call = 8
            n = MAX_MESSAGE_BYTES // (per_call * MIB // 2) + 4
            calls = [_open(served.mux, f"r{i}", MIB // 2, per_call, wait=True) for i in range(n)]
            await until(lambda: len(servicer.started) == n, "every call started")
            servicer.go.set()
            outcomes = await asyncio.gather(*map(_outcome, calls))
            assert outcomes == [[MIB // 2] * per_call] * n, [str(o)[:200] for o in outcomes][:3]
            assert all(s <= BATCH_BYTES for s in sizes), max(sizes)  # the socket's batches
        finally:
            await served.close()

    asyncio.run(main())


def test_a_reader_that_falls_behind_holds_the_handlers_back():
    """While the stream's reader takes nothing, the handlers' unsent messages stay within the cap
    (one message over it at most); as it reads, the rest comes, in order, in batches under it."""
    message = 64 << 10
    count = 16 * BATCH_BYTES // message
    produced = [0]
    go = asyncio.Event()

    async def handler(request, context):
        yield _sized(10)
        await go.wait()
        for i in range(count):  # no await between them: a step's worth produced at once
            produced[0] += 1
            yield _sized(message, i)

    async def main() -> None:
        done = asyncio.Event()

        async def requests():
            yield pb.CallStreamRequestBatch(
                requests=[pb.CallStreamRequest(call_id=1, decode=pb.DecodeRequest(request_id="r"))]
            )
            await done.wait()

        batches = serve_calls(handler, "decode", requests())
        first = await anext(batches)  # the call started: its first message came
        assert [len(item.message.error.message) for item in first.items] == [10]
        go.set()
        await until(lambda: produced[0] * message >= BATCH_BYTES, "the handler produced a batch's worth")
        received: list[int] = []
        while True:
            unsent = (produced[0] - len(received)) * message
            assert unsent <= BATCH_BYTES + message, f"{unsent} bytes unsent, the cap is {BATCH_BYTES}"
            batch = await anext(batches)
            assert batch.ByteSize() <= BATCH_BYTES, batch.ByteSize()
            received += [int(item.message.error.code) for item in batch.items if item.HasField("message")]
            if batch.items[-1].HasField("end"):
                break
        assert received == list(range(count))
        done.set()
        assert [b async for b in batches] == []

    asyncio.run(main())
