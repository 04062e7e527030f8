"""Reaching a running pdserve application from the command line: its router, through Serve."""

from __future__ import annotations

import asyncio
import logging


async def router_client(app_name: str):
    from ray import serve

    from router.client import RouterClient

    if not logging.getLogger().isEnabledFor(logging.DEBUG):  # -v keeps Serve's INFO lines
        logging.getLogger("ray.serve").setLevel(logging.WARNING)  # "Started <...LongPollClient>"
    handle = serve.get_deployment_handle("Router", app_name=app_name)
    address = await asyncio.to_thread(lambda: handle.get_address.remote().result(timeout_s=30))

    async def resolve() -> str:
        return address

    return RouterClient(resolve)
