"""Serve replicas' own gRPC server on loopback when the cluster is.

Each Ray Serve (2.60) replica starts an inter-deployment gRPC server bound to ``[::]:0`` (every
interface; ``ray/serve/_private/replica.py``, ``_on_initialized``), with no option to change it. On a
cluster kept on 127.0.0.1 (``settings.environment.keep_ray_on_loopback``) that would be the only port
of the service another machine could reach. So, in a replica's process and only on such a cluster,
the address it binds is rewritten to 127.0.0.1 (the node address its peers use there). This module is
imported with the deployments, before Serve initializes a replica; if Ray changes the call, nothing is
rewritten and tests/deploy's socket check reports the open port.
"""

from __future__ import annotations

from settings import environment


def keep_replica_grpc_on_loopback() -> bool:
    """Rewrite Serve's replica gRPC bind address when the cluster is on loopback; True if it did."""
    if not environment.ray_on_loopback():
        return False
    try:
        from ray.serve._private import replica
    except ImportError:
        return False
    bind = getattr(replica, "add_port_to_grpc_server", None)
    if bind is None or getattr(bind, "pdserve_loopback", False):
        return bind is not None

    def bind_loopback(server, address: str):
        if address.startswith("[::]:") or address.startswith("0.0.0.0:"):
            address = "127.0.0.1:" + address.rsplit(":", 1)[1]
        return bind(server, address)

    bind_loopback.pdserve_loopback = True
    replica.add_port_to_grpc_server = bind_loopback  # NOTE: a private name of Serve's: see module doc
    return True
