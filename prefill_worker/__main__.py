"""``python -m prefill_worker --model DIR [--port N]``: a prefill worker on its own, no Ray needed.

Prints ``LISTENING <host:port>`` on stdout once it serves (the port is picked when --port is 0).
"""

from __future__ import annotations

import argparse

from engine.args import add_engine_args, engine_config_from_args
from prefill_worker.service import serve
from prefill_worker.split import build_prefill_worker
from prefill_worker.worker import PrefillWorkerConfig
from settings import event_loop
from worker.process import add_worker_args, prepare_process, serve_until_signal, transfer_factory_from_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m prefill_worker", description=__doc__)
    add_engine_args(p)
    add_worker_args(p, "prefill")
    p.add_argument("--lease-seconds", type=float, default=30.0, help="held KV is freed after this long")
    p.add_argument(
        "--engine-process",
        action="store_true",
        help="run the engine, its NIXL agent and the held prompts' leases in a process of its own, with "
        "nothing else on its GIL",
    )
    return p


def main() -> None:
    p = build_parser()
    args = p.parse_args()
    if args.kv_transfer == "inprocess":
        # The in-process fabric joins engines of one process; a prefill worker's KV is read by decode
        # workers in other processes, so every handoff would fail.
        p.error(
            "--kv-transfer inprocess cannot hand KV to decode workers in other processes; "
            "use nixl (or serve aggregated decode workers alone)"
        )
    prepare_process(args)
    config = PrefillWorkerConfig(
        engine_config_from_args(args),
        worker_id=args.worker_id,
        redis_url=args.redis_url,
        lease_seconds=args.lease_seconds,
        engine_process=args.engine_process,
        socket_streams=args.socket_streams,
    )
    worker = build_prefill_worker(config, transfer_factory=transfer_factory_from_args(args))
    event_loop.run(serve_until_signal(worker, serve, args.host, args.port))


if __name__ == "__main__":
    main()
