"""``pdserve serve``: run the application on a (local) Ray cluster until a signal, then drain it.

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
import signal
import sys
import threading
import time

from cli.app_client import router_client
from cli.host_share import check_port_free, usable_cores
from cli.ray_cluster import cluster_identity
from cli.ready_banner import ready_banner
from cli.serve_args import TRAINED_MODEL_NAME, add_serve_parser, config_from_args, config_from_file
from cli.service_record import claim_name, new_record, remove_record, write_record
from cli.tiny_model import ensure_tiny_model
from cli.train_lora import trained_adapters
from cli.train_tiny import trained_target
from deploy.config import PDServeConfig
from settings import environment

logger = logging.getLogger(__name__)

__all__ = ["add_parser", "config_from_args", "config_from_file", "run"]


def add_parser(sub) -> None:
    add_serve_parser(sub).set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.config:
        config = config_from_file(args.config, args)
    else:
        trained = trained_target() if args.model is None and args.demo else None
        if trained is not None:  # the demo's text reads as Python once pdserve train-tiny ran
            print(f"demo model: {TRAINED_MODEL_NAME}, trained by pdserve train-tiny ({trained})", flush=True)
            args.served_model_name = args.served_model_name or TRAINED_MODEL_NAME
            adapters = trained_adapters()  # and its LoRA adapters once pdserve train-lora ran
            if adapters:
                print(f"demo adapters, trained by pdserve train-lora: {', '.join(adapters)}", flush=True)
                args.lora_modules = {**adapters, **(args.lora_modules or {})}
            config = config_from_args(args, str(trained), False)
        else:
            tiny = args.model is None
            config = config_from_args(args, args.model or str(ensure_tiny_model()), tiny)
    if not args.address:  # a second service on a taken port would share it, or fail deep in Ray
        check_port_free(config.ingress.host, config.ingress.port)
        # Before Ray starts: a model that cannot load fails here in a line, not in a replica's log
        # after Serve gave up on it (a remote cluster's nodes may hold paths this machine lacks).
        from engine.models.loader import check_model

        check_model(config.model)
    args.name = claim_name(args.name or f"{config.app_name}-{config.ingress.port}")
    if args.api_key:
        environment.export_secret(environment.API_KEY, args.api_key)  # the local Ray cluster inherits it
    embedded = None
    redis_url, config = registry_url(args.redis_url, config)
    if redis_url is None:
        from cli.embedded_redis import EmbeddedRedis

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


def registry_url(flag: str | None, config: PDServeConfig) -> tuple[str | None, PDServeConfig]:
    """The registry's URL: ``--redis-url`` (or PDSERVE_REDIS_URL), else the config file's
    ``redis_url``, else None (an embedded server). A flag's URL may carry a password: it reaches the
    replicas through the environment, never the application's config (which Serve shows)."""
    if flag:
        environment.export_secret(environment.REDIS_URL, flag)
        return flag, config.model_copy(update={"redis_url": None})
    return config.redis_url, config


def _serve(args, config: PDServeConfig, redis_url: str, stop: threading.Event) -> int:
    if _loopback_cluster(args, config):
        environment.keep_ray_on_loopback()
    import ray
    from ray import serve

    from deploy.app import build_app
    from registry.schema import connect, set_draining

    set_draining(connect(redis_url), False)  # a previous run's shutdown must not block this one
    pools = f"{config.prefill.num_replicas} prefill + " if config.mode == "disaggregated" else ""
    print(
        f"starting Ray and deploying {config.model_name} ({config.mode}: {pools}{config.decode.num_replicas} decode)"
    )
    if args.address:
        ray.init(address=args.address, logging_level=logging.WARNING, log_to_driver=args.verbose)
    else:
        ray.init(
            num_cpus=args.ray_cpus or max(usable_cores(), _cpus_needed(config)),
            include_dashboard=False,
            logging_level=logging.WARNING,
            log_to_driver=args.verbose,
        )
    _on_signals(stop)  # NOTE: again: ray.init replaces the SIGTERM handler with a plain exit
    if not args.verbose:  # Serve's own INFO lines name its proxy's default port, not the endpoint
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
    base = f"http://{_display_host(config.ingress.host)}:{config.ingress.port}"
    record = new_record(args.name, config.app_name, base, *cluster_identity())
    write_record(record)  # from now on `pdserve status --service NAME` finds this cluster
    try:
        if config.ingress.http_server != "serve_proxy":  # the ingress (or router) replicas serve HTTP
            serve.start(proxy_location="Disabled")
        else:
            # One proxy, on the head node, as the KubeRay Serve config has it (every node's own proxy
            # would claim the same port where several nodes share a host).
            serve.start(
                proxy_location="HeadOnly",
                http_options={"host": config.ingress.host, "port": config.ingress.port},
            )
        if not _deploy(serve, build_app(config), config, stop):
            print("interrupted before the application was ready", file=sys.stderr)
            return 130
        if not _wait_healthy(base, config, stop):
            print("interrupted before the workers registered", file=sys.stderr)
            return 130
        print(ready_banner(config, record, api_key_from_flag=bool(args.api_key)), flush=True)
        if args.demo:
            from cli.demo import run_demo

            adapters = sorted(config.engine.lora_modules or {})
            run_demo(base, config.model_name, environment.api_key(), adapters=adapters)
        else:
            while not stop.wait(0.5):
                pass
        print("\nshutting down: draining in-flight requests ...")
        set_draining(connect(redis_url), True, ttl_s=args.drain_timeout + 60)
        _report(asyncio.run(_drain(config.app_name, args.drain_timeout)))
        _stop_serve(serve, config, joined=bool(args.address))
    finally:
        ray.shutdown()
        remove_record(record.name, pid=record.pid)
        with contextlib.suppress(Exception):  # an embedded server may be gone: nothing to clear then
            set_draining(connect(redis_url), False)
    print("pdserve stopped")
    return 0


def _loopback_cluster(args, config: PDServeConfig) -> bool:
    """A local cluster listens on 127.0.0.1 unless the endpoint is for other machines (``--host``);
    a joined one (``--address``) is reached as it is (on loopback if its address is)."""
    if args.address:
        return environment.is_loopback(args.address.rsplit(":", 1)[0])
    return environment.is_loopback(config.ingress.host)


def _stop_serve(serve, config: PDServeConfig, joined: bool) -> None:
    """Delete the application (its replicas stop gracefully). On a cluster of our own, Serve's
    controller and proxy then go with ``ray.shutdown``: ``serve.shutdown()`` would kill the controller
    under the driver's in-flight calls to it, and Ray prints each as a failed task ("Task
    ServeController.graceful_shutdown failed ...") on an otherwise clean exit."""
    serve.delete(config.app_name)
    if joined:  # someone else's cluster: leave nothing of ours running there
        serve.shutdown()


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
    """Replicas being up is not enough: wait until the router sees every starting worker registered."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    want_prefill = _starting_replicas(config.prefill) if config.mode == "disaggregated" else 0
    want_decode = _starting_replicas(config.decode)
    health: dict = {}
    while not stop.is_set():
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as resp:
                health = json.loads(resp.read())
            if (
                health.get("decode_workers", 0) >= want_decode
                and health.get("prefill_workers", 0) >= want_prefill
            ):
                return True
        except (urllib.error.URLError, OSError, ValueError):
            pass  # 503 until a decode worker is registered
        if time.monotonic() > deadline:
            print(
                f"warning: {health.get('prefill_workers', 0)}/{want_prefill} prefill and "
                f"{health.get('decode_workers', 0)}/{want_decode} decode workers registered after "
                f"{timeout_s:.0f}s; serving anyway",
                file=sys.stderr,
            )
            return True
        stop.wait(0.25)
    return False


def _starting_replicas(pool) -> int:
    """Replicas a pool starts with (at least one: the service needs a worker of each role)."""
    if pool.autoscaling is None:
        return max(1, pool.num_replicas)
    initial = pool.autoscaling.initial_replicas
    return max(1, pool.autoscaling.min_replicas if initial is None else initial)


def _display_host(host: str) -> str:
    """The host to print in the ready banner's URL (binding stays as asked: 127.0.0.1 by default)."""
    return "127.0.0.1" if host in ("0.0.0.0", "") else host


async def _drain(app_name: str, timeout_s: float):
    """Wait until no request runs anywhere (router streams, engines, held or moving KV) for a second."""
    client = await router_client(app_name)
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
