"""The config's checks of worker pools, made where the config enters (not when Serve deploys it): Serve
autoscaling bounds, pools Serve scales on their engines' load, and the prefill lease against the
decode side's KV read timeout."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from deploy.app import build_app
from deploy.config import PDServeConfig, validation_message
from deploy.pool_autoscaling import ENGINE_REQUESTS, POOL_POLICY, pool_load_policy


def refusal(**config) -> str:
    with pytest.raises(ValidationError) as info:
        PDServeConfig(model="m", **config)
    return validation_message(info.value)


@pytest.mark.parametrize(
    ("bounds", "message"),
    [
        ({"min_replicas": 1, "max_replicas": 2, "initial_replicas": 5}, "initial_replicas 5 must be between"),
        ({"min_replicas": 2, "max_replicas": 4, "initial_replicas": 1}, "initial_replicas 1 must be between"),
    ],
)
@pytest.mark.parametrize("pool", ["decode", "router", "ingress"])
def test_initial_replicas_outside_the_bounds_is_refused_before_deploying(pool, bounds, message):
    assert message in refusal(**{pool: {"autoscaling": bounds}})
    fine = PDServeConfig(model="m", **{pool: {"autoscaling": {**bounds, "initial_replicas": 2}}})
    build_app(fine)  # Serve's own checks pass too


@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_a_worker_pool_serve_scales_keeps_a_replica_and_scales_on_its_engines(pool):
    assert f"{pool}.autoscaling.min_replicas must be at least 1" in refusal(
        **{pool: {"autoscaling": {"min_replicas": 0, "max_replicas": 2}}}
    )
    config = PDServeConfig(model="m", **{pool: {"autoscaling": {"min_replicas": 1, "max_replicas": 3}}})
    options = getattr(config, pool).deployment_options()
    assert options["autoscaling_config"]["policy"] == {"policy_function": POOL_POLICY}
    # Aggregated mode has no prefill deployment: its section is not checked.
    PDServeConfig(model="m", mode="aggregated", prefill={"autoscaling": {"min_replicas": 0}})


def test_the_router_and_a_direct_ingress_scale_on_the_requests_they_report():
    """Their callers reach them outside Serve (an ingress calls its router over gRPC or a socket, HTTP
    reaches a router or a ``direct`` ingress on its own port): Serve counted no requests there, and
    scaled them down under load. Behind Serve's proxy the ingress is called through Serve."""
    bounds = {"min_replicas": 1, "max_replicas": 3}
    config = PDServeConfig(model="m", router={"autoscaling": bounds}, ingress={"autoscaling": bounds})
    assert config.router.deployment_options()["autoscaling_config"]["policy"] == {
        "policy_function": POOL_POLICY
    }
    assert "policy" not in config.ingress.deployment_options()["autoscaling_config"]  # serve_proxy
    direct = PDServeConfig(model="m", ingress={"autoscaling": bounds, "http_server": "direct"})
    assert direct.ingress.deployment_options()["autoscaling_config"]["policy"] == {
        "policy_function": POOL_POLICY
    }
    zero = {"min_replicas": 0, "max_replicas": 2}
    assert "router.autoscaling.min_replicas must be at least 1" in refusal(router={"autoscaling": zero})
    assert "ingress.autoscaling.min_replicas must be at least 1" in refusal(
        ingress={"autoscaling": zero, "http_server": "direct"}
    )
    PDServeConfig(model="m", ingress={"autoscaling": zero})  # behind Serve's proxy: Serve counts its calls


class _Context:  # the part of Serve's AutoscalingContext the policy reads
    def __init__(self, reported: dict, target: int = 2, per_replica: float = 4.0) -> None:
        self.aggregated_metrics = {ENGINE_REQUESTS: reported} if reported else {}
        self.target_num_replicas = target

        class _Config:
            def get_target_ongoing_requests(self) -> float:
                return per_replica

        self.config = _Config()


def test_the_pool_policy_asks_for_replicas_by_the_requests_its_engines_report():
    assert pool_load_policy(_Context({"r1": 10.0, "r2": 8.0}))[0] == 18.0 / 4.0
    assert pool_load_policy(_Context({"r1": 0.0, "r2": 0.0}))[0] == 0.0  # idle: down to min_replicas
    assert pool_load_policy(_Context({}, target=3))[0] == 3  # nothing reported yet: keep the count


def test_a_prefill_lease_must_outlast_the_decode_kv_read_timeout():
    message = refusal(prefill={"lease_seconds": 10}, decode={"transfer_timeout_s": 10})
    assert "prefill.lease_seconds (10) must be longer than decode.transfer_timeout_s (10)" in message
    assert "reuse the blocks being read" in message
    assert refusal(prefill={"lease_seconds": 5})  # the default timeout is 10 s
    PDServeConfig(model="m", prefill={"lease_seconds": 11}, decode={"transfer_timeout_s": 10})
    PDServeConfig(model="m", mode="aggregated", prefill={"lease_seconds": 5})  # no prefill pool


def test_the_router_and_the_ingress_report_the_requests_streaming_through_them():
    """What their replicas hand Serve's hook: the router's open Generate streams, the ingress's
    requests admitted or queued (a ``direct`` one's HTTP reaches it outside Serve)."""
    import asyncio
    from types import SimpleNamespace

    from deploy.deployments import IngressServer, RouterServer

    def probe(deployment, **attrs):
        cls = type("Probe", (deployment.func_or_class,), {"__del__": lambda self: None})
        replica = cls.__new__(cls)
        replica.__dict__.update(attrs)
        return replica

    router = probe(RouterServer, router=SimpleNamespace(active=3))
    assert asyncio.run(router.record_autoscaling_stats()) == {ENGINE_REQUESTS: 3}
    admission = SimpleNamespace(running=2, waiting=5)
    ingress = probe(IngressServer, ingress=SimpleNamespace(serving=SimpleNamespace(admission=admission)))
    assert asyncio.run(ingress.record_autoscaling_stats()) == {ENGINE_REQUESTS: 7}
