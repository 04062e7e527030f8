"""Loading and unloading a LoRA adapter across the cluster: the router asks every live worker
(prefill and decode) at once, then waits until its own view of the registry shows the change, so a
request naming a just-loaded adapter is routable the moment the call returns.

A load that some workers refuse (a path missing on one machine, a malformed adapter) is undone on
the workers that took it: the cluster never serves an adapter on only part of its workers by
accident. A name already served is refused unless the load replaces it (vLLM's ``load_inplace``);
a replacement is checked on every worker first, so a refusal leaves every worker's adapter as it
was (and one that fails after that check, rarely, unloads it from those that replaced it: never two
versions under one name). An unload that a worker refuses (requests still use the adapter there) leaves the others
unloaded and says which refused; the caller may retry once those requests are done. Loads are
remembered in Redis (``registry.schema.ADAPTERS_KEY``): a worker that starts later loads them too.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import redis

from proto import pdserve_pb2 as pb
from registry.schema import connect, record_adapter

logger = logging.getLogger(__name__)

VIEW_WAIT_S = 10.0  # how long the call waits for the registry to show the change


class AdapterChangeFailed(RuntimeError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


async def change_adapter(router, req: pb.AdapterRequest) -> list[str]:
    """Apply the change on every live worker; the ids of the workers that made it."""
    name, unload = req.name, req.unload
    if not name or (not unload and not req.path):
        raise AdapterChangeFailed(
            grpc.StatusCode.INVALID_ARGUMENT, "an adapter needs a name and, to load, a path"
        )
    workers = router.view.live_workers()
    if not workers:
        raise AdapterChangeFailed(grpc.StatusCode.UNAVAILABLE, "no worker is registered")
    serving = [w for w in workers if w.lora_salt(name) is not None]
    if unload:  # the workers that serve it (an earlier, partly refused unload left it on some)
        if not serving:
            raise AdapterChangeFailed(grpc.StatusCode.NOT_FOUND, f"the model {name!r} does not exist")
        workers = serving
    elif serving and not req.replace:
        where = ", ".join(sorted(w.worker_id for w in serving))
        raise AdapterChangeFailed(
            grpc.StatusCode.ALREADY_EXISTS,
            f"the adapter {name!r} is already loaded (on {where}): unload it first, or load it with "
            "load_inplace to replace it",
        )
    elif req.replace:  # every worker checks the new one first: a refusal then changes nothing anywhere
        check = pb.AdapterRequest(name=name, path=req.path, replace=True, check=True)
        _refused(
            workers, await asyncio.gather(*(_on(router, w, check) for w in workers), return_exceptions=True)
        )
    change = pb.AdapterRequest(name=name, path=req.path, unload=unload, replace=req.replace)
    results = await asyncio.gather(*(_on(router, w, change) for w in workers), return_exceptions=True)
    done = [w for w, r in zip(workers, results) if not isinstance(r, BaseException)]
    try:
        _refused(workers, results)
    except AdapterChangeFailed as exc:
        if unload:  # those that did unload it: the view shows it before the caller hears of the refusal
            await _until_seen(router, {w.worker_id for w in done}, name, False)
        elif done:  # undo the partial load: a new name unloaded; a replacement too, as the others
            # may serve the adapter they had or none now, never two versions under one name
            undo = pb.AdapterRequest(name=name, unload=True)
            await asyncio.gather(*(_on(router, w, undo) for w in done), return_exceptions=True)
            if req.replace:
                where = ", ".join(sorted(w.worker_id for w in done))
                exc.details += f"; unloaded from {where}, which had replaced it"
                exc.args = (exc.details,)
        raise
    await asyncio.to_thread(_remember, router.view.redis_url, name, None if unload else req.path)
    await _until_seen(router, {w.worker_id for w in done}, name, not unload)
    return sorted(w.worker_id for w in done)


def _refused(workers: list, results: list) -> None:
    """Raise the first refusal among ``results`` (one per worker), naming every worker that refused."""
    failed = [(w, r) for w, r in zip(workers, results) if isinstance(r, BaseException)]
    if not failed:
        return
    exc = failed[0][1]
    code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else grpc.StatusCode.INTERNAL
    details = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
    where = ", ".join(sorted(f.worker_id for f, _ in failed))
    raise AdapterChangeFailed(code, f"{details} (refused by {where})")


def _remember(redis_url: str, name: str, path: str | None) -> None:
    """The cluster's run-time adapters in Redis, for workers that start later (best effort: a
    Redis that is away leaves them to load the adapter by hand)."""
    client = connect(redis_url)
    try:
        record_adapter(client, name, path)
    except redis.RedisError as exc:
        logger.warning("could not record adapter %r for workers that start later: %s", name, exc)
    finally:
        client.close()


async def _on(router, w, req: pb.AdapterRequest) -> pb.AdapterResponse:
    stub = router.stubs.prefill(w.address) if w.role == "prefill" else router.stubs.decode(w.address)
    return await stub.Adapter(req, timeout=60)


async def _until_seen(router, worker_ids: set[str], name: str, served: bool) -> None:
    deadline = time.monotonic() + VIEW_WAIT_S
    while time.monotonic() < deadline:
        records = {w.worker_id: w for w in router.view.live_workers()}
        if all(
            (r := records.get(wid)) is None or (r.lora_salt(name) is not None) == served for wid in worker_ids
        ):
            return
        await asyncio.sleep(0.05)
