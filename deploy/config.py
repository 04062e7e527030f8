"""The one validated config an application is built from.

``pdserve serve`` fills it from flags, a Serve config file carries it as the application's ``args``
(``import_path: deploy.app:build_app``), and the KubeRay manifest embeds that same file; pydantic
validates it wherever it enters. It holds no secrets: the API key and a Redis URL with a password
come from the environment (PDSERVE_API_KEY, PDSERVE_REDIS_URL) or from files.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from deploy.pd_autoscaler import PDAutoscalingConfig
from deploy.pool_autoscaling import AutoscalingOptions
from engine.args import engine_options, option_type
from ingress.options import IngressOptions
from router.decode_relay import KV_STREAMING_TOKENS
from router.migration import MigrationOptions

MODES = ("disaggregated", "aggregated")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _engine_option_fields() -> dict[str, Any]:
    """Pydantic fields for every declared engine option but ``model`` (the config's top level has it)."""
    fields: dict[str, Any] = {}
    for f in engine_options():
        if f.name == "model":
            continue
        typ, optional = option_type(f)
        choices = f.metadata.get("choices")
        if choices:
            typ = Literal[choices]  # type: ignore[valid-type]
        fields[f.name] = (
            typ | None if optional else typ,
            Field(f.default, description=f.metadata.get("help")),
        )
    return fields


class _EngineOptionsBase(_Strict):
    @model_validator(mode="after")
    def _valid_engine(self):
        from engine.config import EngineConfig

        EngineConfig(model="<validation>", **self.model_dump())  # the engine's own checks, one place
        return self

    def engine_config(self, model: str):
        from engine.config import EngineConfig

        return EngineConfig(model=model, **self.model_dump())


# The ``EngineConfig`` options an operator sets, derived from their one declaration (engine/config.py).
EngineOptions = create_model(
    "EngineOptions", __base__=_EngineOptionsBase, __module__=__name__, **_engine_option_fields()
)


class ReplicaOptions(_Strict):
    """How many replicas of a deployment run, and what each one reserves."""

    # Serve autoscaling on the requests the replicas' engines report (``deploy.pool_autoscaling``).
    SCALES_ON_ENGINE_LOAD: ClassVar[bool] = False

    num_replicas: int = Field(
        1,
        ge=0,
        description="replicas to run when `autoscaling` is not set; prefill and decode counts change in "
        "place with `pdserve scale` or the P/D policy",
    )
    autoscaling: AutoscalingOptions | None = Field(
        None,
        description="Ray Serve autoscaling for this deployment instead of a fixed `num_replicas`; set on "
        "any deployment, it turns off external scaling (`pdserve scale`, the P/D policy) for the application",
    )
    num_cpus: float = Field(0.5, ge=0, description="CPUs each replica reserves in Ray")
    num_gpus: float = Field(0.0, ge=0, description="GPUs each replica reserves in Ray (fractions allowed)")
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="custom Ray resources each replica reserves, which keeps it on nodes that advertise "
        'them, e.g. `{"prefill_gpu": 1}`',
    )
    graceful_shutdown_timeout_s: float = Field(
        30.0,
        ge=0,
        description="on scale-down, redeploy or shutdown: seconds a replica has to drain (a worker leaves "
        "the registry and finishes its running requests, a router its open streams) before Serve kills it",
    )

    def ray_actor_options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"num_cpus": self.num_cpus}
        if self.num_gpus:
            opts["num_gpus"] = self.num_gpus
        if self.resources:
            opts["resources"] = dict(self.resources)
        return opts

    def deployment_options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {
            "ray_actor_options": self.ray_actor_options(),
            "graceful_shutdown_timeout_s": self.graceful_shutdown_timeout_s,
            "health_check_period_s": 5.0,
            "health_check_timeout_s": 30.0,
        }
        if self.autoscaling is not None:
            opts["autoscaling_config"] = self.autoscaling.serve_config(engine_load=self.SCALES_ON_ENGINE_LOAD)
        else:
            opts["num_replicas"] = self.num_replicas
        return opts


# Options both pools must share: the KV blocks a prefill worker ships are laid out by them, and the
# ingress checks prompts against the one context length.
SHARED_ENGINE_OPTIONS = frozenset(
    {"tokenizer", "dtype", "kv_cache_dtype", "max_model_len", "block_size", "cache_salt"}
)


class _WorkerPoolOptions(ReplicaOptions):
    SCALES_ON_ENGINE_LOAD: ClassVar[bool] = True  # the router's calls reach them outside Serve
    # Each pool may tune its engine, as vLLM's prefill and decode instances take their own arguments;
    # ``PDServeConfig.engine_for`` merges and checks them.
    engine: dict[str, Any] = Field(
        default_factory=dict,
        description="engine options of this pool that differ from the shared `engine` section (e.g. a "
        "smaller KV pool on prefill GPUs, another `max_num_batched_tokens` on decode); options that shape "
        "the KV blocks or the context length must stay shared",
    )
    engine_process: Literal["auto", "on", "off"] = Field(
        "auto",
        description="run the engine and its KV transfer agent in a process of its own "
        "(worker/engine_process.py): nothing else on its GIL, the gRPC work in the replica's process; "
        "`auto`: on",
    )
    socket_streams: bool = Field(
        True,
        description="also serve the router's call stream (its Decode or Prefill calls) on a plain TCP "
        "socket beside gRPC, on the replica's host and a port of its own (proto/socket_stream.py; "
        "framed protobuf); the router prefers it: a streamed gRPC message costs ~5x the CPU. Off: "
        "gRPC only (one port per replica)",
    )


class PrefillOptions(_WorkerPoolOptions):
    lease_seconds: float = Field(
        30.0,
        gt=0,
        description="seconds a prefill worker holds a prompt's KV for its decode worker to read; "
        "freed after that if no read completed",
    )


class DecodeOptions(_WorkerPoolOptions):
    kv_failure_policy: Literal["recompute", "fail"] = Field(
        "recompute",
        description="when a KV read fails or times out: `recompute` prefills the prompt on the decode "
        "worker, `fail` ends the request with an error",
    )
    transfer_timeout_s: float = Field(10.0, gt=0, description="seconds before a KV read counts as failed")
    keepalive_s: float = Field(
        0.5,
        ge=0,
        description="seconds between Progress messages on a quiet stream, which the router's stall watch "
        "reads (0: none)",
    )
    stream_interval: int = Field(
        1,
        ge=1,
        description="tokens a stream holds before it sends them (first and last never wait): fewer "
        "messages through gRPC, the router and HTTP per token, burstier streams "
        "(decode_worker/stream_output.py)",
    )


_MIGRATION = MigrationOptions()  # its defaults are the config's


class RouterOptions(ReplicaOptions):
    SCALES_ON_ENGINE_LOAD: ClassVar[bool] = True  # its callers (an ingress, HTTP) reach it outside Serve

    policy: Literal["round_robin", "least_load", "cache_aware"] = Field(
        "cache_aware",
        description="how the router picks a request's prefill and decode workers (router/policies.py): "
        "`cache_aware` where the first token comes soonest (uncached prompt tokens plus the queue), "
        "`least_load` the least loaded, `round_robin` in turn",
    )
    local_prefill_tokens: int = Field(
        0,
        ge=0,
        description="conditional disaggregation: a prompt with at most this many tokens the decode "
        "worker has not cached is prefilled on the decode worker (0: always disaggregate)",
    )
    kv_streaming_tokens: int = Field(
        KV_STREAMING_TOKENS,
        ge=0,
        description="KV streaming: a prompt with at least this many uncached tokens has its KV read by "
        "the decode worker while it is prefilled (0: the KV moves after the prefill)",
    )
    peer_reads: bool = Field(
        True,
        description="a worker computing a prompt (a prefill worker, or a decode worker serving aggregated) may read its prefix from another worker of its role's KV tiers over NIXL when that is cheaper than computing it (cache_aware routing; needs kv_host_cache_gib)",
    )
    # Request migration (router/migration.py).
    max_migrations: int = Field(
        _MIGRATION.max_migrations,
        ge=0,
        description="times a request may move to another decode worker when its worker is lost "
        "mid-stream (0: migration off)",
    )
    stall_timeout_s: float | None = Field(
        _MIGRATION.stall_timeout_s,
        gt=0,
        description="fixed stall deadline: a stream silent this long counts its decode worker as lost "
        "(null: max(`stall_floor_s`, `stall_step_multiple` x the worker's longest recent step))",
    )
    stall_floor_s: float = Field(
        _MIGRATION.stall_floor_s, gt=0, description="shortest stall deadline derived from step times"
    )
    stall_step_multiple: float = Field(
        _MIGRATION.stall_step_multiple,
        gt=0,
        description="derived stall deadline: this x the worker's longest recent engine step",
    )
    suspect_s: float = Field(
        _MIGRATION.suspect_s,
        ge=0,
        description="seconds a worker that stalled, failed or was unreachable gets no new requests while "
        "others are live",
    )
    socket_streams: bool = Field(
        True,
        description="also serve the ingress replicas' Generate call stream on a plain TCP socket "
        "beside gRPC (proto/socket_stream.py); the ingress prefers it. Off: gRPC only",
    )

    def migration(self) -> MigrationOptions:
        return MigrationOptions(
            **self.model_dump(include={f.name for f in dataclasses.fields(MigrationOptions)})
        )

    num_cpus: float = Field(0.1, ge=0, description="CPUs each router replica reserves in Ray")


class IngressDeploymentOptions(ReplicaOptions, IngressOptions):
    """The ingress's own options (``ingress.options``) plus its replica options.

    ``http_server``: ``serve_proxy`` (the default of a config file) puts Ray Serve's HTTP proxy in
    front of the replicas;
    ``direct`` has each replica serve HTTP itself on ``host:port`` (uvicorn, SO_REUSEPORT so replicas
    on one node share the port) and runs no Serve proxy: one process hop less on every token's
    path. ``router``: no ingress replicas at all; each router replica serves HTTP on ``host:port``
    and its ingress calls the router in-process, one more process hop less (the ingress's replica
    options are then unused: the router's ``num_replicas`` is the number of HTTP servers). KubeRay's
    serve Service routes to Serve's proxies (KubeRay marks a pod ready for it by its proxy's health), so
    config files and manifests keep ``serve_proxy``; ``pdserve serve``'s flags default to ``router``.
    """

    num_cpus: float = Field(0.1, ge=0, description="CPUs each ingress replica reserves in Ray")

    @property
    def SCALES_ON_ENGINE_LOAD(self) -> bool:  # ReplicaOptions' flag, here from the config
        return self.http_server == "direct"  # its HTTP reaches it outside Serve's proxy

    http_server: Literal["serve_proxy", "direct", "router"] = Field(
        "serve_proxy",
        description="what serves HTTP: `serve_proxy` Serve's proxy in front of the ingress replicas, "
        "`direct` each ingress replica on `host:port`, `router` each router replica (no ingress replicas)",
    )


class PDServeConfig(_Strict):
    model: str = Field(
        ..., description="checkpoint directory, Hugging Face id or built-in name (`pdserve/zero-cost`)"
    )
    served_model_name: str | None = Field(
        None, description="the model name clients send and `/v1/models` lists (default: `model`)"
    )
    tiny_model: bool = Field(
        False,
        description="the model is a random-weight demo model: `/v1/models` says its text is meaningless",
    )
    mode: Literal["disaggregated", "aggregated"] = Field(
        "disaggregated",
        description="`disaggregated`: prefill and decode pools; `aggregated`: no prefill deployment, decode "
        "replicas prefill their own prompts (the `prefill` section is unused)",
    )
    redis_url: str | None = Field(
        None,
        description="Redis holding the registry and prefix index (`redis://`, `rediss://` or `unix://`); "
        "default: PDSERVE_REDIS_URL, the place for a URL with a password",
    )
    worker_host: str = Field(
        "127.0.0.1",
        description="address the prefill, decode and router replicas bind gRPC and NIXL to; `auto`: the "
        "Ray node's IP (needed when replicas run on several nodes)",
    )
    app_name: str = Field(
        "pdserve",
        description="the Serve application's name (what `--app` of `pdserve status` / `scale` names)",
    )
    engine_stuck_timeout_s: float = Field(
        120.0,
        gt=0,
        description="a prefill or decode replica fails its health check (and Serve replaces it) when its "
        "engine loop has had work this many seconds without finishing a step",
    )
    engine: EngineOptions = Field(
        default_factory=EngineOptions,
        description="engine options of both pools (`prefill.engine` / `decode.engine` override some)",
    )
    prefill: PrefillOptions = Field(default_factory=PrefillOptions, description="the prefill pool")
    decode: DecodeOptions = Field(default_factory=DecodeOptions, description="the decode pool")
    router: RouterOptions = Field(default_factory=RouterOptions, description="the router deployment")
    ingress: IngressDeploymentOptions = Field(
        default_factory=IngressDeploymentOptions, description="the HTTP ingress deployment"
    )
    autoscaling: PDAutoscalingConfig | None = Field(
        None,
        description="the P/D autoscaling policy (deploy/pd_autoscaler.py); null: prefill and decode counts "
        "change only by `pdserve scale`",
    )

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("redis_url must start with redis://, rediss:// or unix://")
        return v

    def engine_process(self, role: str) -> bool:
        """Whether ``role``'s replicas (prefill, decode) run their engine in a process of their own;
        auto: on for both pools in either mode (bench/README.md, the served path)."""
        choice = (self.prefill if role == "prefill" else self.decode).engine_process
        return choice != "off"

    @model_validator(mode="after")
    def _pools(self) -> PDServeConfig:
        pools = ("decode", "prefill") if self.mode == "disaggregated" else ("decode",)
        for role in pools:
            pool = getattr(self, role)
            if pool.autoscaling is None and pool.num_replicas < 1:
                raise ValueError(
                    "at least one decode replica is required"
                    if role == "decode"
                    else "disaggregated mode needs at least one prefill replica (or use mode=aggregated)"
                )
            if pool.autoscaling is not None and pool.autoscaling.min_replicas < 1:
                raise ValueError(
                    f"{role}.autoscaling.min_replicas must be at least 1: Serve scales the {role} pool on "
                    "the load its replicas report, and at 0 replicas none would report it"
                )
        for name in ("router", "ingress"):
            section = getattr(self, name)
            if (
                section.autoscaling is not None
                and section.SCALES_ON_ENGINE_LOAD
                and section.autoscaling.min_replicas < 1
            ):
                raise ValueError(
                    f"{name}.autoscaling.min_replicas must be at least 1: Serve scales the {name} on the "
                    "requests its replicas report (their callers reach them outside Serve), and at 0 "
                    "replicas none would report them"
                )
        if self.mode == "disaggregated" and self.prefill.lease_seconds <= self.decode.transfer_timeout_s:
            raise ValueError(
                f"prefill.lease_seconds ({self.prefill.lease_seconds:g}) must be longer than "
                f"decode.transfer_timeout_s ({self.decode.transfer_timeout_s:g}): a lease that lapses while "
                "a decode worker's KV read is in flight lets the prefill worker reuse the blocks being read"
            )
        if self.autoscaling is not None:
            if self.mode != "disaggregated":
                raise ValueError("the P/D autoscaling policy needs mode=disaggregated")
            if self.prefill.autoscaling is not None or self.decode.autoscaling is not None:
                raise ValueError(
                    "give either the P/D autoscaling policy or Serve autoscaling per pool, not both"
                )
            if not self.external_scaler_enabled:  # Serve would refuse every count the policy sets
                raise ValueError(
                    "the P/D autoscaling policy sets replica counts, which Serve refuses while any "
                    "deployment (router, ingress) uses Serve autoscaling: drop one of them"
                )
        return self

    @model_validator(mode="after")
    def _pool_engines(self) -> PDServeConfig:
        for role in ("prefill", "decode"):
            try:
                engine = self.engine_for(role)
            except ValueError as exc:  # pydantic's ValidationError is one
                raise ValueError(f"{role}.engine: {exc}") from None
            if self.model_name in (engine.lora_modules or {}):  # a request could never name it
                raise ValueError(
                    f"{role}.engine.lora_modules: the LoRA adapter {self.model_name!r} has the served "
                    "model's name; give it another"
                )
        return self

    def engine_for(self, role: Literal["prefill", "decode"]) -> EngineOptions:
        """The engine options of a worker pool: the shared section with the pool's overrides."""
        overrides = getattr(self, role).engine
        if role == "prefill" and self.engine.speculative_config is not None:
            # A prefill worker stops after the first token: it never speculates, so it loads no draft.
            overrides = {**overrides, "speculative_config": None}
        if not overrides:
            return self.engine
        shared = sorted(SHARED_ENGINE_OPTIONS & overrides.keys())
        if shared:
            raise ValueError(
                f"{', '.join(shared)} must be the same for prefill and decode (their KV and the ingress's "
                "limits depend on it): set it in the shared engine section"
            )
        return EngineOptions(**{**self.engine.model_dump(), **overrides})

    @property
    def external_scaler_enabled(self) -> bool:
        """Replica counts may be set from outside (``pdserve scale``, the P/D policy): Serve allows it
        only when no deployment uses Serve's own autoscaling."""
        pools = (self.prefill, self.decode, self.router, self.ingress)
        return all(p.autoscaling is None for p in pools)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model


def validation_message(exc: ValidationError) -> str:
    """A config's validation errors as ``field.path: message``, one after another (without pydantic's
    documentation links): what ``pdserve`` prints for a bad config or values file."""
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or 'the file'}: {e['msg'].removeprefix('Value error, ')}"
        for e in exc.errors()
    )
