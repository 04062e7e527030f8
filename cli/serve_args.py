"""``pdserve serve``'s flags, and the ``PDServeConfig`` they (or a config file) make."""

from __future__ import annotations

import argparse
import json

from pydantic import ValidationError

from cli.host_share import frontend_count, local_cpu_threads, positive_int
from deploy.config import PDServeConfig, validation_message
from engine.args import add_engine_args, engine_kwargs_from_args
from ingress.options import add_ingress_flags
from router.decode_relay import KV_STREAMING_TOKENS
from settings import environment

TINY_MODEL_NAME = "pdserve-tiny-random"
TRAINED_MODEL_NAME = "pdserve-tiny-python"
# The ingress options that are flags of ``serve`` (their default and help from ``IngressOptions``):
# the request limits, and run-time LoRA loading (the README's `pdserve serve ... --allow-runtime-lora`
# was refused as an unknown flag: only a config file could turn it on).
REQUEST_LIMITS = (
    "max_body_bytes",
    "max_n",
    "max_prompt_chars",
    "max_logprobs",
    "request_timeout_s",
    "allow_runtime_lora",
)


def add_serve_parser(sub) -> argparse.ArgumentParser:
    s = sub.add_parser("serve", help="serve the OpenAI-compatible API on Ray Serve (prefill, decode, router)")
    s.add_argument(
        "--config",
        help="the application config (YAML/JSON PDServeConfig, or a Serve config file); "
        "replaces the model, engine and pool flags",
    )
    s.add_argument("--served-model-name", help="the model name clients use (default: --model)")
    s.add_argument(
        "--name",
        help="this service's name, for pdserve status/scale --service (default: <app>-<port>, e.g. pdserve-8000)",
    )
    s.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default: loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--prefill", type=int, default=1, help="prefill replicas")
    s.add_argument("--decode", type=int, default=1, help="decode replicas")
    s.add_argument("--mode", default="disaggregated", choices=["disaggregated", "aggregated"])
    s.add_argument("--policy", default="cache_aware", choices=["cache_aware", "least_load", "round_robin"])
    s.add_argument(
        "--stream-interval", type=int, default=1, help="tokens a stream holds before it sends them"
    )
    s.add_argument(
        "--engine-process",
        default="auto",
        choices=["auto", "on", "off"],
        help="prefill and decode replicas run their engine and its KV transfer agent in a process of their "
        "own, with nothing else on its GIL (auto: on)",
    )
    s.add_argument(
        "--local-prefill-tokens",
        type=int,
        default=0,
        help="conditional disaggregation: prefill on the decode worker when the prompt part it has not "
        "cached is at most this many tokens (0: always disaggregate)",
    )
    s.add_argument(
        "--peer-reads",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a worker computing a prompt (a prefill worker, or a decode worker serving aggregated) may read its prefix from another worker of its role's KV tiers over NIXL when that is cheaper than computing it (cache_aware routing; needs kv_host_cache_gib)",
    )
    s.add_argument(
        "--kv-streaming-tokens",
        type=int,
        default=KV_STREAMING_TOKENS,
        help="KV streaming: the decode worker reads a prompt's KV while it is prefilled when at least "
        "this many of its tokens are uncached (0: the KV moves after the prefill)",
    )
    s.add_argument(
        "--max-migrations",
        type=int,
        default=3,
        help="times a request may move to another decode worker when its own is lost mid-stream (0: never)",
    )
    s.add_argument(
        "--stall-timeout",
        type=float,
        default=None,
        help="seconds a decode stream may stay silent before the router gives up on its worker and "
        "moves the request (default: max(5 s, 20 x the worker's step budget))",
    )
    s.add_argument(
        "--redis-url",
        default=environment.redis_url(),
        help="registry Redis (env PDSERVE_REDIS_URL; default: an embedded Redis-protocol server)",
    )
    s.add_argument(
        "--api-key", default=None, help="require this bearer key on /v1 (prefer env PDSERVE_API_KEY)"
    )
    s.add_argument("--address", default=None, help="join this Ray cluster instead of starting a local one")
    s.add_argument(
        "--max-concurrent-requests", type=int, default=256, help="beyond it requests queue, then 429"
    )
    s.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="requests that may wait (default: twice the above)",
    )
    add_ingress_flags(s, only=REQUEST_LIMITS)
    s.add_argument(
        "--http-server",
        default="router",
        choices=["serve_proxy", "direct", "router"],
        help="router (default, the fastest measured): the router replicas serve HTTP, their ingress "
        "calling the router in-process; direct: ingress replicas serve HTTP themselves (one process "
        "hop more per token); serve_proxy: Ray Serve's HTTP proxy in front of the ingress (two more; "
        "what KubeRay's serve Service routes to)",
    )
    s.add_argument(
        "--frontends",
        type=positive_int,
        help="HTTP processes sharing the port (router or ingress replicas); default: 1 per 8 cores",
    )
    s.add_argument(
        "--worker-cpus", type=float, default=1.0, help="Ray CPUs reserved per prefill/decode replica"
    )
    for role in ("prefill", "decode"):
        s.add_argument(
            f"--{role}-engine",
            type=_json_object,
            default={},
            metavar="JSON",
            help=f"engine options of the {role} workers that differ from the shared ones, "
            "e.g. '{\"num_blocks\": 512}'",
        )
    s.add_argument("--worker-gpus", type=float, default=0.0, help="GPUs per prefill/decode replica")
    s.add_argument("--ray-cpus", type=int, default=None, help="CPUs of the local Ray cluster")
    s.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds to let requests finish on shutdown"
    )
    s.add_argument("--demo", action="store_true", help="send a few requests through the service, then exit")
    add_engine_args(
        s,
        model_required=False,
        model_help="checkpoint directory or Hugging Face id (default: a tiny random Llama)",
    )
    return s


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def config_from_args(args: argparse.Namespace, model: str, tiny: bool) -> PDServeConfig:
    worker = {"num_cpus": args.worker_cpus, "num_gpus": args.worker_gpus}
    frontends = frontend_count(args)
    return PDServeConfig(
        model=model,
        served_model_name=args.served_model_name or (TINY_MODEL_NAME if tiny else None),
        tiny_model=tiny,
        mode=args.mode,
        engine=engine_kwargs_from_args(args) | {"cpu_threads": local_cpu_threads(args)},
        prefill={
            **worker,
            "num_replicas": args.prefill,
            "engine": args.prefill_engine,
            "engine_process": args.engine_process,
        },
        decode={
            **worker,
            "num_replicas": args.decode,
            "engine": args.decode_engine,
            "stream_interval": args.stream_interval,
            "engine_process": args.engine_process,
        },
        router={
            "num_replicas": frontends if args.http_server == "router" else 1,
            "policy": args.policy,
            "local_prefill_tokens": args.local_prefill_tokens,
            "kv_streaming_tokens": args.kv_streaming_tokens,
            "peer_reads": args.peer_reads,
            "max_migrations": args.max_migrations,
            "stall_timeout_s": args.stall_timeout,
        },
        ingress={
            "num_replicas": 1 if args.http_server == "router" else frontends,
            "host": args.host,
            "port": args.port,
            "max_concurrent_requests": args.max_concurrent_requests,
            "max_queued_requests": args.max_queued_requests,
            **{name: getattr(args, name) for name in REQUEST_LIMITS},
            "http_server": args.http_server,
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
    try:
        config = PDServeConfig.model_validate(data)
    except ValidationError as exc:
        raise ValueError(f"invalid config file {path}: {validation_message(exc)}") from None
    ingress = config.ingress.model_copy(update={"host": args.host, "port": args.port})
    return config.model_copy(update={"ingress": ingress})
