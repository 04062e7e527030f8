"""The application ``build_app`` makes for each HTTP server choice: which deployments it holds and
which one is its root (``http_server: router`` has no Ingress deployment)."""

from __future__ import annotations

import pytest
from ray.serve import Application

from deploy.app import build_app


def _graph(app: Application) -> list[str]:
    """Deployment names reachable from the root, root first."""
    names: list[str] = []

    def walk(a: Application) -> None:
        d = a._bound_deployment
        if d.name not in names:
            names.append(d.name)
        for arg in (*d.init_args, *d.init_kwargs.values()):
            for item in arg if isinstance(arg, list) else [arg]:
                if isinstance(item, Application):
                    walk(item)

    walk(app)
    return names


@pytest.mark.parametrize(
    ("http_server", "autoscaling", "root", "others"),
    [
        ("serve_proxy", False, "Ingress", {"Router", "Decode", "Prefill"}),
        ("direct", True, "Ingress", {"Router", "Decode", "Prefill", "Autoscaler"}),
        ("router", False, "Router", {"Decode", "Prefill"}),
        ("router", True, "Autoscaler", {"Router", "Decode", "Prefill"}),
    ],
)
def test_each_http_server_builds_its_graph(http_server, autoscaling, root, others):
    args = {"model": "m", "ingress": {"http_server": http_server}}
    if autoscaling:
        args["autoscaling"] = {}
    names = _graph(build_app(args))
    assert names[0] == root and set(names[1:]) == others


def test_the_autoscaler_runs_where_the_router_runs():
    """On Kubernetes the router is pinned to the head (``pdserve_head``), which KubeRay never
    removes; the policy's one replica goes there too, not onto a GPU pod that may go away."""
    args = {"model": "m", "autoscaling": {}, "router": {"resources": {"pdserve_head": 0.01}}}
    app = build_app(args)

    def find(a: Application):
        d = a._bound_deployment
        if d.name == "Autoscaler":
            return d
        for arg in (*d.init_args, *d.init_kwargs.values()):
            for item in arg if isinstance(arg, list) else [arg]:
                if isinstance(item, Application) and (found := find(item)) is not None:
                    return found
        return None

    options = find(app).ray_actor_options
    assert options["resources"] == {"pdserve_head": 0.01} and options["num_cpus"] == 0
