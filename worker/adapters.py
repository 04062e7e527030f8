"""LoRA adapters loaded or unloaded on a running worker (``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` reach here through the router's fan-out).

The change runs where the engine is: on the engine thread, or in the engine process (an
``EngineCommand``). Then the worker's registry record lists the adapters it now serves (the next
heartbeat carries it), which is how the router learns where a request of the adapter may go, and
the ingress which names a request may use. A refused change (a malformed adapter, an unknown name,
an adapter that unfinished requests use) is a ``ValueError`` with the reason; nothing changes then.
"""

from __future__ import annotations

import json

from proto import pdserve_pb2 as pb


def change_adapter(core, name: str, path: str, unload: bool) -> dict[str, str]:
    """Engine side: apply the change to ``core`` (an EngineCore); the adapters served after it."""
    try:
        if unload:
            core.remove_lora(name)
        else:
            core.add_lora(name, path)
    except ValueError as exc:  # AdapterError, UnknownAdapterError: a refusal, whatever its class
        raise ValueError(str(exc)) from exc
    return core.lora_salts()


class AdapterMixin:
    """``WorkerRuntime``'s adapter calls."""

    async def change_adapter(self, name: str, path: str, unload: bool) -> dict[str, str]:
        if not name:
            raise ValueError("an adapter needs a name")
        if not unload and not path:
            raise ValueError("loading an adapter needs its path")
        if self.engine is not None:
            cmd = pb.EngineCommand(adapter=pb.AdapterRequest(name=name, path=path, unload=unload))
            loras = dict((await self.engine.send(cmd)).loras)
        else:
            loras = await self.loop.run(lambda: change_adapter(self.core, name, path, unload))
        self.loras = loras
        if self.registry is not None:  # the next heartbeat publishes it
            self.registry.publisher.record.loras = json.dumps(loras, sort_keys=True)
        return loras


async def adapter_rpc(worker, request: pb.AdapterRequest, context) -> pb.AdapterResponse:
    """A worker service's ``Adapter``: INVALID_ARGUMENT with the reason for a refused change."""
    import grpc

    try:
        loras = await worker.change_adapter(request.name, request.path, request.unload)
    except ValueError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    return pb.AdapterResponse(loras=loras)
