"""The one validated config an application is built from.

``pdserve serve`` fills it from flags, a Serve config file carries it as the application's ``args``
(``import_path: deploy.app:build_app``), and the KubeRay manifest embeds that same file; pydantic
validates it wherever it enters. It holds no secrets: the API key and a Redis URL with a password
come from the environment (PDSERVE_API_KEY, PDSERVE_REDIS_URL) or from files.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from deploy.pd_autoscaler import PDAutoscalingConfig

MODES = ("disaggregated", "aggregated")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EngineOptions(_Strict):
    """The ``EngineConfig`` fields an operator sets (the model comes from the top level)."""

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"
    block_size: int = Field(16, ge=1, le=256)
    num_blocks: int | None = Field(None, ge=1)
    kv_cache_memory_bytes: int = Field(1 << 30, ge=1)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_num_seqs: int = Field(256, ge=1)
    max_model_len: int | None = Field(None, ge=1)
    swap_space: float = Field(0.0, ge=0)
    scheduling_policy: Literal["fifo", "prefill_first", "priority"] = "fifo"
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    seed: int = 0
    cache_salt: str = ""
    cuda_graphs: bool = True  # decode steps from CUDA graphs (CUDA + Triton only)

    def engine_config(self, model: str):
        from engine.config import EngineConfig

        return EngineConfig(model=model, **self.model_dump())


class AutoscalingOptions(_Strict):
    """Ray Serve autoscaling bounds for one pool (the P/D policy reads its own signals)."""

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(4, ge=1)
    initial_replicas: int | None = Field(None, ge=0)
    target_ongoing_requests: float = Field(8.0, gt=0)
    upscale_delay_s: float = Field(10.0, ge=0)
    downscale_delay_s: float = Field(120.0, ge=0)

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingOptions:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} > max_replicas {self.max_replicas}")
        return self


class ReplicaOptions(_Strict):
    """How many replicas of a deployment run, and what each one reserves."""

    num_replicas: int = Field(1, ge=0)
    autoscaling: AutoscalingOptions | None = None
    num_cpus: float = Field(0.5, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    resources: dict[str, float] = Field(default_factory=dict)  # e.g. {"prefill_gpu": 1}
    graceful_shutdown_timeout_s: float = Field(30.0, ge=0)

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
            opts["autoscaling_config"] = self.autoscaling.model_dump(exclude_none=True)
        else:
            opts["num_replicas"] = self.num_replicas
        return opts


class PrefillOptions(ReplicaOptions):
    lease_seconds: float = Field(30.0, gt=0)


class DecodeOptions(ReplicaOptions):
    kv_failure_policy: Literal["recompute", "fail"] = "recompute"
    transfer_timeout_s: float = Field(10.0, gt=0)


class RouterOptions(ReplicaOptions):
    policy: Literal["round_robin", "least_load", "cache_aware"] = "cache_aware"
    num_cpus: float = Field(0.1, ge=0)


class IngressOptions(ReplicaOptions):
    num_cpus: float = Field(0.1, ge=0)
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    max_concurrent_requests: int = Field(256, ge=1)  # streams forwarded to the router at once
    max_queued_requests: int = Field(512, ge=0)  # waiting for a slot; beyond it: 429
    max_body_bytes: int = Field(4 << 20, ge=1024)
    max_n: int = Field(16, ge=1)
    max_logprobs: int = Field(20, ge=0)
    request_timeout_s: float = Field(600.0, gt=0)
    api_key_file: str | None = None  # else PDSERVE_API_KEY; neither: no auth


class PDServeConfig(_Strict):
    model: str
    served_model_name: str | None = None
    tiny_model: bool = False  # the model is a random-weight demo model: say so everywhere
    mode: Literal["disaggregated", "aggregated"] = "disaggregated"
    redis_url: str | None = None  # else PDSERVE_REDIS_URL (which may carry a password)
    worker_host: str = "127.0.0.1"  # gRPC/NIXL bind address of workers; "auto": the Ray node's IP
    app_name: str = "pdserve"
    engine_stuck_timeout_s: float = Field(120.0, gt=0)  # health check fails past this without progress
    engine: EngineOptions = Field(default_factory=EngineOptions)
    prefill: PrefillOptions = Field(default_factory=PrefillOptions)
    decode: DecodeOptions = Field(default_factory=DecodeOptions)
    router: RouterOptions = Field(default_factory=RouterOptions)
    ingress: IngressOptions = Field(default_factory=IngressOptions)
    # The P/D policy (deploy/pd_autoscaler.py); None: counts change only by `pdserve scale`.
    autoscaling: PDAutoscalingConfig | None = None

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("redis_url must start with redis://, rediss:// or unix://")
        return v

    @model_validator(mode="after")
    def _pools(self) -> PDServeConfig:
        if self.decode.autoscaling is None and self.decode.num_replicas < 1:
            raise ValueError("at least one decode replica is required")
        if (
            self.mode == "disaggregated"
            and self.prefill.autoscaling is None
            and self.prefill.num_replicas < 1
        ):
            raise ValueError("disaggregated mode needs at least one prefill replica (or use mode=aggregated)")
        if self.autoscaling is not None:
            if self.mode != "disaggregated":
                raise ValueError("the P/D autoscaling policy needs mode=disaggregated")
            if self.prefill.autoscaling is not None or self.decode.autoscaling is not None:
                raise ValueError(
                    "give either the P/D autoscaling policy or Serve autoscaling per pool, not both"
                )
        return self

    @property
    def external_scaler_enabled(self) -> bool:
        """Replica counts may be set from outside (``pdserve scale``, the P/D policy): Serve allows it
        only when no deployment uses Serve's own autoscaling."""
        pools = (self.prefill, self.decode, self.router, self.ingress)
        return all(p.autoscaling is None for p in pools)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model
