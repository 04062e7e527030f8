"""Changing a running application's prefill and decode replica counts in place.

Serve's external-scaling API (the application runs with ``external_scaler_enabled``) sets a
deployment's target replica count without redeploying: running replicas are untouched, new ones
start (load the model, register in Redis, then take traffic), and removed ones drain first (they
leave the registry, finish their running requests, then exit — see ``deploy.deployments``).
``pdserve scale`` and the P/D autoscaler (``AutoscalerLoop``) both go through here.
"""

from __future__ import annotations

import asyncio
import logging
import time

from deploy.pd_autoscaler import ClusterSignals, PDAutoscaler, PDAutoscalingConfig

logger = logging.getLogger(__name__)

POOLS = {"prefill": "Prefill", "decode": "Decode"}


def _controller():
    from ray.serve.context import _get_global_client

    # NOTE: the controller handle is what Serve's own REST scale endpoint calls; there is no public
    # Python wrapper for the external-scaling API yet.
    return _get_global_client()._controller


def target_replicas(app_name: str) -> dict[str, int]:
    """Deployment name -> its current target replica count."""
    from ray.serve.context import _get_global_client

    details = _get_global_client().get_serve_details()
    app = details.get("applications", {}).get(app_name)
    if app is None:
        raise ValueError(f"no Serve application named {app_name!r} is running")
    return {name: d["target_num_replicas"] for name, d in app["deployments"].items()}


def replica_resources(app_name: str) -> dict[str, dict[str, float]]:
    """Deployment name -> what one of its replicas reserves ({"CPU": 1.0, "GPU": 0.5, ...})."""
    from ray.serve.context import _get_global_client

    app = _get_global_client().get_serve_details().get("applications", {}).get(app_name) or {}
    out = {}
    for name, d in app.get("deployments", {}).items():
        opts = (d.get("deployment_config") or {}).get("ray_actor_options") or {}
        need = {"CPU": float(opts.get("num_cpus") or 0.0), "GPU": float(opts.get("num_gpus") or 0.0)}
        need.update({k: float(v) for k, v in (opts.get("resources") or {}).items()})
        out[name] = {k: v for k, v in need.items() if v > 0}
    return out


def replica_states(app_name: str) -> dict[str, tuple[int, int]]:
    """Deployment name -> (running replicas, target replicas)."""
    from ray.serve.context import _get_global_client

    app = _get_global_client().get_serve_details().get("applications", {}).get(app_name) or {}
    return {
        name: (sum(1 for r in d.get("replicas", []) if r.get("state") == "RUNNING"), d["target_num_replicas"])
        for name, d in app.get("deployments", {}).items()
    }


def describe_replicas(
    states: dict[str, tuple[int, int]], per: dict[str, dict[str, float]], available: dict[str, float]
) -> str:
    """One line for ``pdserve status``: each deployment's running / target replicas, and for those
    still waiting, whether the cluster has room for them (else Ray leaves them unscheduled) and the fix."""
    parts, left = [], dict(available)
    for name, (running, target) in sorted(states.items()):
        part = f"{name} {running}/{target}"
        waiting = target - running
        if waiting > 0:
            short = shortfall(per.get(name, {}), waiting, left)
            if short:
                what = ", ".join(f"{need:g} {res} (free: {free:g})" for res, (need, free) in short.items())
                part += f" ({waiting} pending, unschedulable: they need {what})"
            else:
                part += f" ({waiting} starting)"
                for res, amount in per.get(name, {}).items():
                    left[res] = left.get(res, 0.0) - amount * waiting
        parts.append(part)
    line = "replicas running/target: " + ", ".join(parts)
    if "unschedulable" in line:
        line += "; give the cluster room (pdserve serve --ray-cpus N) or scale down (pdserve scale)"
    return line


def shortfall(
    per_replica: dict[str, float], added: int, available: dict[str, float]
) -> dict[str, tuple[float, float]]:
    """Resource -> (needed, free) for each resource ``added`` more replicas need beyond what is free."""
    out = {}
    for res, amount in per_replica.items():
        need = amount * added
        if need > available.get(res, 0.0) + 1e-9:
            out[res] = (need, available.get(res, 0.0))
    return out


def check_room(app_name: str, counts: dict[str, int], available: dict[str, float]) -> None:
    """ValueError saying why and what to do when the cluster has no room for the added replicas:
    Serve would leave them pending, unscheduled, without a word."""
    current, per = target_replicas(app_name), replica_resources(app_name)
    left = dict(available)
    for pool, n in counts.items():
        name = POOLS[pool]
        added = n - current.get(name, 0)
        if added <= 0:
            continue
        short = shortfall(per.get(name, {}), added, left)
        if short:
            what = ", ".join(f"{need:g} {res} (free: {free:g})" for res, (need, free) in short.items())
            raise ValueError(
                f"{name}: {current.get(name, 0)} -> {n} replicas needs {what}: the new replicas would wait "
                "unscheduled. Give the cluster room (pdserve serve --ray-cpus N, or fewer per replica "
                "with --worker-cpus), or pass --allow-pending on a cluster that adds nodes itself"
            )
        for res, amount in per.get(name, {}).items():
            left[res] = left.get(res, 0.0) - amount * added


def set_replicas(app_name: str, counts: dict[str, int]) -> None:
    """``counts``: pool ("prefill" / "decode") -> replicas. Raises ValueError with the reason."""
    import ray
    from ray.serve._private.common import DeploymentID

    current = target_replicas(app_name)
    for pool, n in counts.items():
        name = POOLS[pool]
        if name not in current:
            raise ValueError(f"application {app_name!r} has no {name} deployment (aggregated mode?)")
        if n < (1 if pool == "decode" else 0):
            raise ValueError(f"{pool} replicas must be >= {1 if pool == 'decode' else 0}, got {n}")
    for pool, n in counts.items():
        try:
            ray.get(_controller().update_deployment_replicas.remote(DeploymentID(POOLS[pool], app_name), n))
        except Exception as exc:  # the controller's refusal (e.g. external scaling disabled), verbatim
            raise ValueError(str(exc).strip().splitlines()[-1]) from exc


def signals_from_cluster(cluster, counts: dict[str, int]) -> ClusterSignals:
    """The policy's inputs from the router's cluster state (registry records plus its in-flight work)."""
    prefill = [w for w in cluster.workers if w.state.role == "prefill"]
    decode = [w for w in cluster.workers if w.state.role == "decode"]
    usage = [w.state.stats.kv_usage for w in decode]
    return ClusterSignals(
        prefill_replicas=counts.get(POOLS["prefill"], 0),
        decode_replicas=counts.get(POOLS["decode"], 0),
        pending_prompt_tokens=sum(w.queued_prompt_tokens for w in prefill),
        decode_kv_usage=sum(usage) / len(usage) if usage else 0.0,
        decode_running=sum(w.state.stats.num_running + w.state.stats.num_waiting for w in decode),
    )


class AutoscalerLoop:
    """Every ``interval_s``: read the cluster, ask the policy, apply a changed count."""

    def __init__(self, app_name: str, config: PDAutoscalingConfig, router_client) -> None:
        self.app_name = app_name
        self.policy = PDAutoscaler(config)
        self.router = router_client
        self.interval_s = config.interval_s
        self.decisions: list[tuple[float, int, int]] = []

    async def run(self) -> None:
        while True:
            try:
                await self.step(time.monotonic())
            except Exception as exc:  # a missed evaluation is retried at the next interval
                logger.warning("autoscaler step failed: %s", exc)
            await asyncio.sleep(self.interval_s)

    async def step(self, now: float) -> None:
        counts = await asyncio.to_thread(target_replicas, self.app_name)
        signals = signals_from_cluster(await self.router.cluster_state(), counts)
        p, d = self.policy.decide(signals, now)
        if (p, d) != (signals.prefill_replicas, signals.decode_replicas):
            logger.info(
                "autoscaler: prefill %d -> %d, decode %d -> %d (%s)",
                signals.prefill_replicas,
                p,
                signals.decode_replicas,
                d,
                signals,
            )
            self.decisions.append((now, p, d))
            await asyncio.to_thread(set_replicas, self.app_name, {"prefill": p, "decode": d})
