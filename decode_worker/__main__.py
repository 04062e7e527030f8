"""``python -m decode_worker --model DIR [--port N]``: a decode worker on its own, no Ray needed.

Prints ``LISTENING <host:port>`` on stdout once it serves (the port is picked when --port is 0).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

from decode_worker.service import fetch_prefill_peer, serve
from decode_worker.worker import FAILURE_POLICIES, DecodeWorker, DecodeWorkerConfig
from engine.args import add_engine_args, engine_config_from_args


async def _main(args: argparse.Namespace) -> None:
    config = DecodeWorkerConfig(
        engine_config_from_args(args),
        worker_id=args.worker_id,
        kv_failure_policy=args.kv_failure_policy,
        transfer_timeout_s=args.transfer_timeout,
    )
    worker = DecodeWorker(config, fetch_peer=fetch_prefill_peer)
    server, address = await serve(worker, args.host, args.port)
    print(f"LISTENING {address}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=2)
    worker.stop()


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m decode_worker", description=__doc__)
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--worker-id", default="decode-0")
    p.add_argument("--kv-failure-policy", default="recompute", choices=FAILURE_POLICIES)
    p.add_argument("--transfer-timeout", type=float, default=10.0, help="seconds before a KV pull fails")
    p.add_argument(
        "--ucx-net-devices",
        default=None,
        help="network devices NIXL/UCX may use (UCX_NET_DEVICES); default: lo when bound to loopback",
    )
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args()
    devices = args.ucx_net_devices or ("lo" if args.host in ("127.0.0.1", "localhost", "::1") else None)
    if devices:  # before NIXL initialises UCX
        os.environ["UCX_NET_DEVICES"] = devices
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    asyncio.run(_main(args))


if __name__ == "__main__":
    main()
