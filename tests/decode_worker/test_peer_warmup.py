"""The decode worker warms its NIXL peers itself, the same under ``python -m decode_worker`` as in a
Serve replica: before it registers (so the router routes nothing to it before its peers are
connected) it connects to every prefill worker the registry lists, and it keeps connecting to new
ones as they register. Real Redis; the transfer is the in-process backend."""

from __future__ import annotations

import asyncio
import time

from decode_worker.service import serve
from decode_worker.worker import DecodeWorker, DecodeWorkerConfig
from engine import EngineConfig
from kv_transfer import InProcessFabric, RemoteKVInfo
from registry.registration import WorkerRegistration
from registry.schema import WorkerRecord, connect, read_workers


def _register_prefill(client, wid: str, address: str) -> None:
    record = WorkerRecord(worker_id=wid, role="prefill", address=address, epoch=1, block_size=4, num_blocks=8)
    WorkerRegistration(client, record, ttl_s=120).register([])


def test_decode_worker_connects_to_registered_prefill_workers_before_it_registers(tiny_llama, redis_server):
    client = connect(redis_server.url)
    fabric = InProcessFabric()
    owners = {}  # prefill address -> its backend (stands in for a prefill worker's GetState)
    seen: list[tuple[str, bool]] = []  # (address fetched, was the decode worker registered then)

    async def fetch_peer(address: str) -> RemoteKVInfo:
        seen.append((address, "d-warm" in read_workers(client)))
        return owners[address].local_info()

    config = DecodeWorkerConfig(
        EngineConfig(model=str(tiny_llama), block_size=4, num_blocks=32),
        worker_id="d-warm",
        redis_url=redis_server.url,
        warm_interval_s=0.05,
    )
    worker = DecodeWorker(config, fetch_peer=fetch_peer, transfer_factory=fabric.transfer_factory)
    for i in range(2):  # nothing is read here: the owners may as well sit on the worker's own KV
        owners[f"10.0.0.{i}:1"] = fabric.transfer_factory(worker.core, f"p{i}-agent", worker.compat)
    _register_prefill(client, "p0", "10.0.0.0:1")

    async def until(cond, what: str) -> None:
        deadline = time.monotonic() + 10
        while not cond():
            assert time.monotonic() < deadline, f"timed out waiting until {what}"
            await asyncio.sleep(0.02)

    async def main() -> None:
        try:
            await serve(worker)
            assert seen == [("10.0.0.0:1", False)], "p0 was not connected before the worker registered"
            await until(lambda: "d-warm" in read_workers(client), "the decode worker registered")
            _register_prefill(client, "p1", "10.0.0.1:1")  # a prefill replica added later
            await until(lambda: len(seen) == 2, "the new prefill worker is connected")
            assert seen[1] == ("10.0.0.1:1", True)
            assert worker._peers == {"p0-agent", "p1-agent"}
        finally:
            await worker.shutdown(grace_s=0)

    try:
        asyncio.run(main())
    finally:
        for owner in owners.values():
            owner.close()
