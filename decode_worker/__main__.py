"""``python -m decode_worker --model DIR [--port N]``: a decode worker on its own, no Ray needed.

Prints ``LISTENING <host:port>`` on stdout once it serves (the port is picked when --port is 0).
"""

from __future__ import annotations

import argparse
import logging

from decode_worker.kv_pull import FAILURE_POLICIES
from decode_worker.service import serve
from decode_worker.split import build_decode_worker
from decode_worker.worker import DecodeWorkerConfig
from engine.args import add_engine_args, engine_config_from_args
from settings import event_loop
from worker.process import add_worker_args, prepare_process, serve_until_signal, transfer_factory_from_args

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m decode_worker", description=__doc__)
    add_engine_args(p)
    add_worker_args(p, "decode")
    p.add_argument("--kv-failure-policy", default="recompute", choices=FAILURE_POLICIES)
    p.add_argument("--transfer-timeout", type=float, default=10.0, help="seconds before a KV pull fails")
    p.add_argument(
        "--keepalive",
        type=float,
        default=0.5,
        help="seconds between Progress messages on a quiet Decode stream (the router's stall watch)",
    )
    p.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="tokens a Decode stream holds before it sends them (its first and last go at once)",
    )
    p.add_argument(
        "--engine-process",
        action="store_true",
        help="run the engine (and its KV pulls) in a process of its own, with nothing else on its GIL "
        "(with --kv-transfer inprocess it takes no KV hand-offs: aggregated serving only)",
    )
    return p


def main() -> None:
    args = build_parser().parse_args()
    prepare_process(args)
    config = DecodeWorkerConfig(
        engine_config_from_args(args),
        worker_id=args.worker_id,
        redis_url=args.redis_url,
        kv_failure_policy=args.kv_failure_policy,
        transfer_timeout_s=args.transfer_timeout,
        keepalive_s=args.keepalive,
        stream_interval=args.stream_interval,
        engine_process=args.engine_process,
        socket_streams=args.socket_streams,
    )
    if args.kv_transfer == "inprocess" and not args.engine_process:
        logger.warning(
            "--kv-transfer inprocess: this worker cannot pull KV from prefill workers (other processes); "
            "serve it in aggregated mode (a disaggregated request falls back to --kv-failure-policy)"
        )
    transfer = "nixl" if args.kv_transfer == "nixl" else "none"
    worker = build_decode_worker(config, transfer=transfer, transfer_factory=transfer_factory_from_args(args))
    event_loop.run(serve_until_signal(worker, serve, args.host, args.port))


if __name__ == "__main__":
    main()
