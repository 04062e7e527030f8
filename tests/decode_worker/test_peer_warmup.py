"""The decode worker warms its NIXL peers itself, the same under ``python -m decode_worker`` as in a
Serve replica: before it registers (so the router routes nothing to it before its peers are
connected) it connects to every prefill worker the registry lists, and it keeps connecting to new
ones as they register. Real Redis; the transfer is the in-process backend."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from decode_worker.engine_host import DecodeEngineRole
from decode_worker.service import serve
from decode_worker.worker import DecodeWorker, DecodeWorkerConfig
from engine import EngineConfig, EngineCore
from kv_transfer import InProcessFabric, KVCompat, RemoteKVInfo
from proto import pdserve_pb2 as pb
from registry.registration import WorkerRegistration
from registry.schema import WorkerRecord, connect, read_workers
from worker.state import transfer_info_to_proto


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
            assert set(worker._peers) == {"p0-agent", "p1-agent"}
        finally:
            await worker.shutdown(grace_s=0)

    try:
        asyncio.run(main())
    finally:
        for owner in owners.values():
            owner.close()


def test_gone_prefill_incarnations_leave_the_nixl_agent_and_a_restart_is_warmed(tiny_llama, redis_server):
    """A prefill worker restarted at the same address is a new incarnation: warmed, and the old one
    dropped from the NIXL agent. One that left the registry while its address still answers as it
    (draining) is kept until it stops answering."""
    client = connect(redis_server.url)
    fabric = InProcessFabric()
    owners = {}  # prefill address -> its backend now (stands in for its GetState); none: not listening
    asked: list[str] = []

    async def fetch_peer(address: str) -> RemoteKVInfo:
        asked.append(address)
        if address not in owners:
            raise OSError(f"connection refused: {address}")
        return owners[address].local_info()

    config = DecodeWorkerConfig(
        EngineConfig(model=str(tiny_llama), block_size=4, num_blocks=32),
        worker_id="d-gone",
        redis_url=redis_server.url,
        warm_interval_s=0.05,
    )
    worker = DecodeWorker(config, fetch_peer=fetch_peer, transfer_factory=fabric.transfer_factory)
    backends = []

    def start_prefill(wid: str, address: str, epoch: int) -> WorkerRegistration:
        owners[address] = fabric.transfer_factory(worker.core, f"{wid}-{epoch}", worker.compat)
        backends.append(owners[address])
        record = WorkerRecord(worker_id=wid, role="prefill", address=address, epoch=epoch, block_size=4)
        registration = WorkerRegistration(client, record, ttl_s=120)
        registration.register([])
        return registration

    def agents() -> tuple[set[str], set[str]]:
        """The decode worker's peers, and the ones its NIXL agent (here: the in-process backend) holds."""
        return set(worker._peers), set(worker.transfer._peers)

    async def until(cond, what: str) -> None:
        deadline = time.monotonic() + 10
        while not cond():
            assert time.monotonic() < deadline, f"timed out waiting until {what}: {agents()}"
            await asyncio.sleep(0.02)

    async def main() -> None:
        try:
            start_prefill("p0", "10.0.0.0:1", 1)
            drained = start_prefill("p1", "10.0.0.1:1", 1)
            await serve(worker)
            assert agents() == ({"p0-1", "p1-1"},) * 2
            start_prefill("p0", "10.0.0.0:1", 2)  # restarted at the same address
            await until(lambda: agents() == ({"p0-2", "p1-1"},) * 2, "the restart is warmed, the old gone")
            drained.deregister()  # draining: it left the registry, its held prompts are still read
            await until(lambda: asked.count("10.0.0.1:1") >= 3, "a few polls asked it (warmed once before)")
            assert agents() == ({"p0-2", "p1-1"},) * 2
            del owners["10.0.0.1:1"]  # it stopped
            await until(lambda: agents() == ({"p0-2"},) * 2, "the stopped one is dropped")
        finally:
            await worker.shutdown(grace_s=0)

    try:
        asyncio.run(main())
    finally:
        for backend in backends:
            backend.close()


def test_the_engine_process_drops_a_gone_peer_on_command(tiny_llama):
    """With the engine in a process of its own, the worker's ``remove_peer`` command reaches the NIXL
    agent there (``decode_worker.engine_host``), as ``add_peer`` does."""
    fabric = InProcessFabric()
    core = EngineCore(EngineConfig(model=str(tiny_llama), block_size=4, num_blocks=16))
    compat = KVCompat.from_layout("m", core.layout)
    mine = fabric.transfer_factory(core, "d-1", compat)
    theirs = fabric.transfer_factory(core, "p-1", compat)
    role = DecodeEngineRole(SimpleNamespace(core=core, publish=lambda outs: None), mine, 1.0)
    try:
        role.run(pb.EngineCommand(add_peer=transfer_info_to_proto(theirs.local_info())), pb.EngineReply())
        assert set(mine._peers) == {"p-1"}
        assert role.run(pb.EngineCommand(remove_peer="p-1"), pb.EngineReply())
        assert set(mine._peers) == set()
    finally:
        mine.close()
        theirs.close()
