"""Ray Serve's own autoscaling of a deployment, and the load a prefill or decode pool scales on.

Serve counts a replica's ongoing requests as the calls that reach it through Serve: the router's
and the ingress's. The router reaches prefill and decode workers over their own gRPC and socket
streams instead, so Serve would see about zero ongoing requests on those pools and scale them down
under any load. Each worker replica therefore reports its engine's requests (running, waiting, or
receiving their KV) through Serve's ``record_autoscaling_stats`` hook, and ``pool_load_policy`` is
the pools' Serve autoscaling policy: replicas = reported requests / ``target_ongoing_requests``.
Serve's policy wrapper then applies the bounds and the up/down delays as for its own policy.

A pool at zero replicas has no replica to report its load, so it could never scale up again: the
pools keep ``min_replicas`` of at least 1 (``PDServeConfig`` checks it).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

# NOTE: Serve pickles this module's policy by value into its controller, which cannot import
# pdserve: ``pool_load_policy`` uses nothing but its argument and this name.
ENGINE_REQUESTS = "pdserve_engine_requests"
POOL_POLICY = f"{__name__}:pool_load_policy"


class AutoscalingOptions(BaseModel):
    """Ray Serve autoscaling bounds for one deployment (the P/D policy reads its own signals)."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(1, ge=0, description="fewest replicas Serve scales the deployment down to")
    max_replicas: int = Field(4, ge=1, description="most replicas Serve scales the deployment up to")
    initial_replicas: int | None = Field(
        None, ge=0, description="replicas at deploy time (default: `min_replicas`)"
    )
    target_ongoing_requests: float = Field(
        8.0,
        gt=0,
        description="requests in flight per replica that Serve scales toward (prefill and decode: "
        "the requests their engines run or queue)",
    )
    upscale_delay_s: float = Field(
        10.0, ge=0, description="seconds the load must ask for more replicas before Serve adds them"
    )
    downscale_delay_s: float = Field(
        120.0, ge=0, description="seconds the load must ask for fewer replicas before Serve removes them"
    )

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingOptions:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} > max_replicas {self.max_replicas}")
        initial = self.initial_replicas
        if initial is not None and not self.min_replicas <= initial <= self.max_replicas:
            raise ValueError(
                f"initial_replicas {initial} must be between min_replicas {self.min_replicas} and "
                f"max_replicas {self.max_replicas}"
            )
        return self

    def serve_config(self, *, engine_load: bool) -> dict[str, Any]:
        """Serve's ``autoscaling_config``; ``engine_load``: scale on the requests the replicas'
        engines report (prefill, decode) instead of Serve's own count of calls."""
        config = self.model_dump(exclude_none=True)
        if engine_load:
            config["policy"] = {"policy_function": POOL_POLICY}
        return config


def pool_load_policy(ctx) -> tuple[float, dict]:
    """Serve's autoscaling policy of a worker pool: as many replicas as keep the requests its
    engines reported (summed over the running replicas) at ``target_ongoing_requests`` each."""
    reported = (ctx.aggregated_metrics or {}).get(ENGINE_REQUESTS) or {}
    if not reported:  # no replica has reported yet (all starting): keep the count
        return ctx.target_num_replicas, {}
    return sum(reported.values()) / ctx.config.get_target_ongoing_requests(), {}
