"""Build the pdserve Ray Serve application from one validated config.

``build_app`` is also the Serve config's ``import_path`` (``deploy.app:build_app``), so
``serve deploy`` / KubeRay build exactly what ``pdserve serve`` builds: its ``args`` are a
``PDServeConfig``. Deployments: Ingress (HTTP) -> Router -> Prefill + Decode; in aggregated mode
there is no Prefill deployment and decode replicas prefill locally; with ``autoscaling`` set, an
Autoscaler deployment runs the P/D policy; with ``ingress.http_server: router`` the router replicas
serve HTTP and there is no Ingress deployment. Deploy with ``external_scaler_enabled`` set to
``config.external_scaler_enabled`` so ``pdserve scale`` and the policy can change replica counts.
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from deploy.config import PDServeConfig
from deploy.deployments import AutoscalerServer, DecodeServer, IngressServer, PrefillServer, RouterServer

# Serve-level request cap for the ingress; pdserve's own admission control (429) acts well before.
_INGRESS_MAX_ONGOING = 100_000


def build_app(args: PDServeConfig | dict[str, Any]) -> Application:
    config = args if isinstance(args, PDServeConfig) else PDServeConfig.model_validate(args)
    # Replicas get the config without the replica counts: a new count then changes no replica's
    # constructor arguments, so Serve applies it in place instead of restarting every replica.
    counts = {"num_replicas": 1}
    shared = config.model_copy(
        update={
            name: getattr(config, name).model_copy(update=counts)
            for name in ("prefill", "decode", "router", "ingress")
        }
    )
    decode = DecodeServer.options(**config.decode.deployment_options()).bind(shared)
    prefill = None
    if config.mode == "disaggregated":
        prefill = PrefillServer.options(**config.prefill.deployment_options()).bind(shared)
    # The router finds workers through Redis, not through Serve; binding them here makes Serve start
    # and stop them as parts of this one application.
    router = RouterServer.options(**config.router.deployment_options()).bind(shared, [decode, prefill])
    autoscaler = None
    if config.autoscaling is not None:  # where the router runs (on Kubernetes the head, which stays)
        placement = {"num_cpus": 0, "resources": dict(config.router.resources or {})}
        autoscaler = AutoscalerServer.options(ray_actor_options=placement).bind(shared, router)
    if config.ingress.http_server == "router":
        # The router replicas serve HTTP themselves: no Ingress deployment. Serve needs one root that
        # reaches every deployment: the autoscaler (it holds the router) when there is one.
        return autoscaler or router
    ingress_opts = config.ingress.deployment_options() | {"max_ongoing_requests": _INGRESS_MAX_ONGOING}
    companions = [autoscaler] if autoscaler is not None else []
    return IngressServer.options(**ingress_opts).bind(shared, router, companions)
