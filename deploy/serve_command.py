"""``pdserve serve`` and ``pdserve status``: run the application on a (local) Ray cluster, and look at it.

``serve``'s life: config validated -> Redis (the given URL, or an embedded Redis-protocol server) ->
Ray (a local cluster, or ``--address``) -> Serve application deployed, progress printed until every
replica is up -> endpoint and a curl line printed -> serving until SIGINT/SIGTERM -> draining: the
routers refuse new requests (a flag in Redis) while the running ones finish -> every worker's final
state printed (running requests, free KV blocks) -> Serve and Ray shut down -> exit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time

from deploy.config import PDServeConfig

logger = logging.getLogger(__name__)

TINY_MODEL_NAME = "pdserve-tiny-random"


def config_from_args(args: argparse.Namespace, model: str, tiny: bool) -> PDServeConfig:
    engine = {"dtype": args.dtype, "block_size": args.block_size, "max_num_seqs": args.max_num_seqs}
    if args.num_blocks is not None:
        engine["num_blocks"] = args.num_blocks
    if args.max_model_len is not None:
        engine["max_model_len"] = args.max_model_len
    if args.device:
        engine["device"] = args.device
    worker = {"num_cpus": args.worker_cpus, "num_gpus": args.worker_gpus}
    return PDServeConfig(
        model=model,
        served_model_name=args.served_model_name or (TINY_MODEL_NAME if tiny else None),
        tiny_model=tiny,
        mode=args.mode,
        engine=engine,
        prefill={**worker, "num_replicas": args.prefill},
        decode={**worker, "num_replicas": args.decode},
        router={"policy": args.policy},
        ingress={
            "host": args.host,
            "port": args.port,
            "max_concurrent_requests": args.max_concurrent_requests,
        },
    )


def config_from_file(path: str, args: argparse.Namespace) -> PDServeConfig:
    """A ``PDServeConfig`` (YAML/JSON), or a Serve config file whose first application's args are one;
    ``--host`` / ``--port`` still choose where this local run listens."""
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f)
    if isinstance(data, dict) and "applications" in data:
        data = data["applications"][0].get("args", {})
    config = PDServeConfig.model_validate(data)
    ingress = config.ingress.model_copy(update={"host": args.host, "port": args.port})
    return config.model_copy(update={"ingress": ingress})


def cmd_serve(args: argparse.Namespace) -> int:
    from deploy.cli import ensure_tiny_model

    if args.config:
        config = config_from_file(args.config, args)
    else:
        tiny = args.model is None
        config = config_from_args(args, args.model or str(ensure_tiny_model()), tiny)
    if args.api_key:
        os.environ["PDSERVE_API_KEY"] = args.api_key  # inherited by the local Ray cluster, never logged
    embedded = None
    if args.redis_url:
        os.environ["PDSERVE_REDIS_URL"] = args.redis_url  # may carry a password: environment, not config
        redis_url = args.redis_url
    else:
        from deploy.embedded_redis import EmbeddedRedis

        embedded = EmbeddedRedis().start()
        redis_url = embedded.url
        config = config.model_copy(update={"redis_url": redis_url})
        print("no --redis-url: using an embedded Redis-protocol server (fakeredis, this process only)")
    stop = threading.Event()
    _on_signals(stop)
    try:
        return _serve(args, config, redis_url, stop)
    finally:
        if embedded is not None:
            embedded.stop()


def _serve(args, config: PDServeConfig, redis_url: str, stop: threading.Event) -> int:
    import ray
    from ray import serve

    from deploy.app import build_app
    from proto.registry import connect, set_draining

    set_draining(connect(redis_url), False)  # a previous run's shutdown must not block this one
    pools = f"{config.prefill.num_replicas} prefill + " if config.mode == "disaggregated" else ""
    print(
        f"starting Ray and deploying {config.model_name} ({config.mode}: {pools}{config.decode.num_replicas} decode)"
    )
    if args.address:
        ray.init(address=args.address, logging_level=logging.WARNING, log_to_driver=args.verbose)
    else:
        ray.init(
            num_cpus=args.ray_cpus or max(os.cpu_count() or 1, _cpus_needed(config)),
            include_dashboard=False,
            logging_level=logging.WARNING,
            log_to_driver=args.verbose,
        )
    _on_signals(stop)  # NOTE: again: ray.init replaces the SIGTERM handler with a plain exit
    try:
        serve.start(http_options={"host": config.ingress.host, "port": config.ingress.port})
        if not _deploy(serve, build_app(config), config, stop):
            print("interrupted before the application was ready", file=sys.stderr)
            return 130
        base = f"http://{_display_host(config.ingress.host)}:{config.ingress.port}"
        if not _wait_healthy(base, config, stop):
            print("interrupted before the workers registered", file=sys.stderr)
            return 130
        _print_ready(config, base)
        if args.demo:
            from deploy.demo import run_demo

            run_demo(base, config.model_name, os.environ.get("PDSERVE_API_KEY"))
        else:
            while not stop.wait(0.5):
                pass
        print("\nshutting down: draining in-flight requests ...")
        set_draining(connect(redis_url), True, ttl_s=args.drain_timeout + 60)
        _report(asyncio.run(_drain(config.app_name, args.drain_timeout)))
        serve.shutdown()
    finally:
        ray.shutdown()
        with contextlib.suppress(Exception):  # an embedded server may be gone: nothing to clear then
            set_draining(connect(redis_url), False)
    print("pdserve stopped")
    return 0


def _on_signals(stop: threading.Event) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())


def _cpus_needed(config: PDServeConfig) -> int:
    pools = [config.decode, config.router, config.ingress]
    if config.mode == "disaggregated":
        pools.append(config.prefill)
    return (
        int(
            sum(p.num_cpus * (p.autoscaling.max_replicas if p.autoscaling else p.num_replicas) for p in pools)
        )
        + 1
    )


def _deploy(serve, app, config: PDServeConfig, stop: threading.Event) -> bool:
    """``serve.run`` in a thread; print replica progress until the application runs."""
    errors: list[BaseException] = []
    name = config.app_name

    def run() -> None:
        try:
            serve.run(
                app, name=name, route_prefix="/", external_scaler_enabled=config.external_scaler_enabled
            )
        except BaseException as exc:  # re-raised in the caller's thread
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t0, last = time.monotonic(), ""
    while t.is_alive():
        if stop.wait(1.0):
            return False
        line = _progress(serve, name)
        if line and line != last:
            print(f"  [{time.monotonic() - t0:5.1f}s] {line}", flush=True)
            last = line
    if errors:
        raise errors[0]
    return True


def _progress(serve, name: str) -> str:
    try:
        app = serve.status().applications.get(name)
    except Exception:  # the controller may still be starting
        return ""
    if app is None:
        return "waiting for the Serve controller"
    parts = []
    for dep_name, dep in app.deployments.items():
        counts = dep.replica_states or {}
        parts.append(f"{dep_name} {counts.get('RUNNING', 0)}/{sum(counts.values())} running")
    return ", ".join(parts) or str(app.status)


def _wait_healthy(base: str, config: PDServeConfig, stop: threading.Event, timeout_s: float = 120.0) -> bool:
    """Replicas being up is not enough: wait until the router sees the workers registered."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    want_prefill = config.mode == "disaggregated"
    while not stop.is_set():
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as resp:
                health = json.loads(resp.read())
            if health.get("decode_workers") and (health.get("prefill_workers") or not want_prefill):
                return True
        except (urllib.error.URLError, OSError, ValueError):
            pass  # 503 until a decode worker is registered
        if time.monotonic() > deadline:
            print(f"warning: workers not registered after {timeout_s:.0f}s; serving anyway", file=sys.stderr)
            return True
        stop.wait(0.25)
    return False


def _display_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else host


def _print_ready(config: PDServeConfig, base: str) -> None:
    auth = " -H 'Authorization: Bearer $PDSERVE_API_KEY'" if os.environ.get("PDSERVE_API_KEY") else ""
    body = json.dumps(
        {"model": config.model_name, "prompt": "the world is", "max_tokens": 16, "temperature": 0}
    )
    print(f"\npdserve is serving {config.model_name!r} at {base}/v1")
    if config.tiny_model:
        print("  NOTE: this is a tiny random-weight demo model (no --model given): its text is meaningless")
    print(f"  try:    curl {base}/v1/completions -H 'Content-Type: application/json'{auth} -d '{body}'")
    print(f"  health: {base}/health   metrics: {base}/metrics   workers: pdserve status")
    print("  Ctrl-C (or SIGTERM) drains in-flight requests and stops.\n", flush=True)


async def _router_client(app_name: str):
    from ray import serve

    from deploy.router_client import RouterClient

    handle = serve.get_deployment_handle("Router", app_name=app_name)
    address = await asyncio.to_thread(lambda: handle.get_address.remote().result(timeout_s=30))

    async def resolve() -> str:
        return address

    return RouterClient(resolve)


async def _drain(app_name: str, timeout_s: float):
    """Wait until no request runs anywhere (router streams, engines, held or moving KV) for a second."""
    client = await _router_client(app_name)
    try:
        deadline, idle_since, cluster, states = time.monotonic() + timeout_s, None, None, []
        while time.monotonic() < deadline:
            cluster, states = await client.worker_states()
            busy = cluster.active_requests + sum(_busy(w) for w in states)
            if busy == 0:
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since >= 1.0:
                    break
            else:
                idle_since = None
            await asyncio.sleep(0.2)
        else:
            print(f"drain timed out after {timeout_s:.0f}s; stopping anyway", file=sys.stderr)
        return cluster, states
    finally:
        await client.close()


def _busy(w) -> int:
    s = w.stats
    return s.num_running + s.num_waiting + s.num_swapped + s.num_held_requests + s.num_transferring


def _report(result) -> None:
    _cluster, states = result
    for w in sorted(states, key=lambda w: (w.role, w.worker_id)):
        s = w.stats
        print(
            f"  {w.role:<8} {w.worker_id}: {s.num_running} running, {s.num_waiting} waiting, "
            f"{s.num_held_requests} held, {s.num_free_blocks}/{s.num_blocks} KV blocks free"
        )


# pdserve scale ------------------------------------------------------------------------------------


def cmd_scale(args: argparse.Namespace) -> int:
    import ray

    from deploy.scaling import set_replicas, target_replicas

    counts = {k: v for k, v in (("prefill", args.prefill), ("decode", args.decode)) if v is not None}
    if not counts:
        print("error: give --prefill N and/or --decode M", file=sys.stderr)
        return 2
    ray.init(address=args.address or "auto", logging_level=logging.ERROR, log_to_driver=False)
    try:
        before = target_replicas(args.app)
        if "Autoscaler" in before:
            print("note: the P/D autoscaler is running; it may change these counts again", file=sys.stderr)
        set_replicas(args.app, counts)
        after = target_replicas(args.app)
    finally:
        ray.shutdown()
    for name in ("Prefill", "Decode"):
        if name in before:
            print(f"{name}: {before[name]} -> {after[name]} replicas")
    print("new replicas register before taking traffic; removed ones drain first (see pdserve status)")
    return 0


# pdserve status ----------------------------------------------------------------------------------


def cmd_status(args: argparse.Namespace) -> int:
    import ray

    ray.init(address=args.address or "auto", logging_level=logging.ERROR, log_to_driver=False)
    try:
        cluster, states = asyncio.run(_status(args.app))
    finally:
        ray.shutdown()
    if args.json:
        from google.protobuf.json_format import MessageToDict

        print(json.dumps({"cluster": MessageToDict(cluster), "workers": [MessageToDict(w) for w in states]}))
        return 0
    print(format_status(cluster, states))
    return 0


async def _status(app_name: str):
    client = await _router_client(app_name)
    try:
        return await client.worker_states()
    finally:
        await client.close()


def format_status(cluster, states) -> str:
    head = (
        f"router: policy {cluster.policy}, registry {'DEGRADED' if cluster.degraded else 'ok'}"
        f"{', DRAINING' if cluster.draining else ''}; {cluster.requests_routed} requests routed, "
        f"{cluster.active_requests} active; prefix hits predicted {cluster.predicted_prefix_hit_rate:.0%} / "
        f"delivered {cluster.delivered_prefix_hit_rate:.0%}; retries {cluster.prefill_retries}, "
        f"aggregated fallbacks {cluster.aggregated_fallbacks}, failed {cluster.failed_requests}"
    )
    rows = [("ROLE", "WORKER", "ADDRESS", "PID", "RUN", "WAIT", "HELD", "KV USED", "HIT RATE", "PREEMPT")]
    for w in sorted(states, key=lambda w: (w.role, w.worker_id)):
        s = w.stats
        hit = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        used = s.num_blocks - s.num_free_blocks
        rows.append(
            (
                w.role + (" (draining)" if w.draining else ""),
                w.worker_id,
                w.address,
                str(w.pid),
                str(s.num_running),
                str(s.num_waiting),
                str(s.num_held_requests),
                f"{used}/{s.num_blocks} ({s.kv_usage:.0%})",
                f"{hit:.0%}",
                str(s.num_preemptions),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    table = "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
    return f"{head}\n{table}"
