"""The router makes one channel and one stub per worker address and keeps them: a stub built per
request builds a callable for every method of its service each time. Its call streams go over a
worker's socket when it registered one."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from registry.schema import WorkerRecord
from router.worker_stubs import WorkerStubs


def test_a_workers_channel_and_stubs_are_made_once():
    async def run():
        stubs = WorkerStubs()
        decode, prefill = stubs.decode("127.0.0.1:1"), stubs.prefill("127.0.0.1:1")
        assert stubs.decode("127.0.0.1:1") is decode and stubs.prefill("127.0.0.1:1") is prefill
        assert stubs.channel("127.0.0.1:1") is stubs.channel("127.0.0.1:1")
        assert stubs.decode("127.0.0.1:2") is not decode
        assert stubs.channel("127.0.0.1:2") is not stubs.channel("127.0.0.1:1")
        await stubs.close()

    asyncio.run(run())


def test_call_streams_go_over_a_workers_socket_when_it_has_one_and_none_opens_once_closed():
    """A worker that registered a socket gets its calls there, one that did not on its gRPC stream;
    once the router closes, opening one fails UNAVAILABLE (a relay still running at shutdown does
    not reconnect)."""

    async def run():
        stubs = WorkerStubs()
        with_socket = WorkerRecord("d0", "decode", "127.0.0.1:1", 1, streams="127.0.0.1:2")
        grpc_only = WorkerRecord("p0", "prefill", "127.0.0.1:3", 1)
        decode, prefill = stubs.decode_stream(with_socket), stubs.prefill_stream(grpc_only)
        assert decode.address == "127.0.0.1:2" and stubs.decode_stream(with_socket) is decode
        assert prefill.address == "127.0.0.1:3" and stubs.prefill_stream(grpc_only) is prefill
        await stubs.close()
        for open_stream, worker in ((stubs.decode_stream, with_socket), (stubs.prefill_stream, grpc_only)):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                open_stream(worker)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(run())
