"""``python -m ingress --model DIR --router HOST:PORT``: the OpenAI HTTP endpoint on its own (uvicorn),
in front of a router started with ``python -m router``; no Ray needed.

``python -m ingress --model DIR --redis-url URL`` runs the router in this process instead (every
``python -m router`` flag but ``--host``/``--port``), as ``pdserve serve``'s router replicas serve
HTTP by default: no gRPC hop between the HTTP side and the router, one process fewer.

Prints ``LISTENING <host:port>`` once it serves (the port is picked when --port is 0). Every
``IngressOptions`` field is a flag; the API key comes from PDSERVE_API_KEY or --api-key-file.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from ingress.options import IngressOptions, add_ingress_flags
from router.launch import add_router_flags
from settings import event_loop, gc_policy


async def _serve(args: argparse.Namespace) -> None:
    from ingress.model_info import load_model_info
    from ingress.server import Ingress, api_key_from, serve_http

    options = IngressOptions(**{k: getattr(args, k) for k in IngressOptions.model_fields})
    info = await asyncio.to_thread(
        load_model_info, args.model, args.served_model_name or args.model, args.max_model_len, False
    )
    router, client = await asyncio.to_thread(_router_client, args)
    ingress = Ingress(
        info,
        options,
        client,
        api_key_from(options.api_key_file),
        expect_prefill=args.mode == "disaggregated",
    )
    server = await serve_http(
        ingress.http, options.host, options.port, reuse_port=False, log_level=args.log_level
    )
    host, port = server.address
    gc_policy.settle_heap()
    print(f"LISTENING {f'[{host}]' if ':' in host else host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # uvicorn takes SIGINT/SIGTERM itself in the main thread (and ends its task); a server that
    # fails ends its task too: either way, stop rather than wait for a signal that already came.
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({stopping, server.task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        await ingress.close()
        await server.stop()
        if router is not None:
            await router.close()
            await asyncio.to_thread(router.view.stop)
    if server.task.done() and not server.task.cancelled() and server.task.exception():
        raise server.task.exception()


def _router_client(args: argparse.Namespace):
    """(the router in this process or None, the client the ingress calls it through)."""
    if args.router:
        from router.client import RouterClient

        async def router_address() -> str:
            return args.router

        return None, RouterClient(router_address)
    from router.launch import build_router
    from router.local_client import LocalRouterClient

    router = build_router(args)
    return router, LocalRouterClient(router)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ingress", description=__doc__)
    p.add_argument(
        "--model", required=True, help="checkpoint directory or Hugging Face id (for the tokenizer)"
    )
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    p.add_argument(
        "--router",
        default=None,
        help="the router's gRPC address (host:port); without it, the router runs in this process "
        "over the registry at --redis-url",
    )
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--mode", default="disaggregated", choices=["disaggregated", "aggregated"])
    p.add_argument("--log-level", default="WARNING")
    add_ingress_flags(p)
    add_router_flags(p.add_argument_group("the router in this process (without --router)"), False)
    return p


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if not args.router and not args.redis_url:
        parser.error(
            "give --router HOST:PORT, or --redis-url (or PDSERVE_REDIS_URL) to route in this process"
        )
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    event_loop.run(_serve(args))


if __name__ == "__main__":
    main()
