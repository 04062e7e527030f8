"""LoRA adapters loaded or unloaded on a running worker (``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` reach here through the router's fan-out).

The change runs where the engine is: on the engine thread, or in the engine process (an
``EngineCommand``). Then the worker's registry record lists the adapters it now serves (the next
heartbeat carries it), which is how the router learns where a request of the adapter may go, and
the ingress which names a request may use. A refused change (a malformed adapter, an unknown name,
an adapter that unfinished requests use) is a ``ValueError`` with the reason; nothing changes then.
"""

from __future__ import annotations

import asyncio
import json
import logging

import redis

from proto import pdserve_pb2 as pb
from registry.schema import connect, read_adapters

logger = logging.getLogger(__name__)


def _cluster_adapters(redis_url: str) -> dict[str, str]:
    client = connect(redis_url)
    try:
        return read_adapters(client)
    finally:
        client.close()


def change_adapter(core, req: pb.AdapterRequest) -> dict[str, str]:
    """Engine side: apply the change to ``core`` (an EngineCore); the adapters served after it. A
    load replaces an adapter of that name only with ``replace``; ``check`` changes nothing."""
    try:
        if req.unload:
            core.remove_lora(req.name)
        else:
            core.add_lora(req.name, req.path, replace=req.replace, check=req.check)
    except ValueError as exc:  # AdapterError, UnknownAdapterError: a refusal, whatever its class
        raise ValueError(str(exc)) from exc
    return core.lora_salts()


class AdapterMixin:
    """``WorkerRuntime``'s adapter calls."""

    async def load_cluster_adapters(self) -> None:
        """Before registering: the adapters loaded at run time across the cluster (recorded in Redis
        by the router), so a worker that starts later serves them too. One that fails to load here
        is logged and left out: the router sends its requests to the workers that serve it."""
        if not self.config.redis_url:
            return
        try:
            wanted = await asyncio.to_thread(_cluster_adapters, self.config.redis_url)
        except (OSError, redis.RedisError) as exc:
            logger.warning("could not read the cluster's run-time adapters: %s", exc)
            return
        for name, path in wanted.items():
            if name in self.loras:
                continue
            try:
                await self.change_adapter(pb.AdapterRequest(name=name, path=path))
                logger.info("loaded the cluster's adapter %r from %s", name, path)
            except (ValueError, RuntimeError) as exc:
                logger.warning("the cluster's adapter %r is not served here: %s", name, exc)

    async def change_adapter(self, req: pb.AdapterRequest) -> dict[str, str]:
        if not req.name:
            raise ValueError("an adapter needs a name")
        if not req.unload and not req.path:
            raise ValueError("loading an adapter needs its path")
        if self.engine is not None:
            loras = dict((await self.engine.send(pb.EngineCommand(adapter=req))).loras)
        else:
            loras = await self.loop.run(lambda: change_adapter(self.core, req))
        if req.check:
            return loras
        self.loras = loras
        if self.registry is not None:  # the next heartbeat publishes it
            self.registry.publisher.record.loras = json.dumps(loras, sort_keys=True)
        return loras


async def adapter_rpc(worker, request: pb.AdapterRequest, context) -> pb.AdapterResponse:
    """A worker service's ``Adapter``: INVALID_ARGUMENT with the reason for a refused change."""
    import grpc

    try:
        loras = await worker.change_adapter(request)
    except ValueError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    return pb.AdapterResponse(loras=loras)
