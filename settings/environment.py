"""Every environment variable pdserve reads or sets, in one place.

Environment variables carry only secrets and standard tool settings (STYLE.md): everything else
flows through config objects and flags. Secrets come from here or from files, never from code, a
config file or a log line.

- ``PDSERVE_REDIS_URL``: the registry's Redis URL (may carry a password).
- ``PDSERVE_API_KEY``: the bearer key ``/v1`` requires, when set.
- ``UCX_NET_DEVICES``: UCX's network devices (read by UCX itself when NIXL initialises it).
- ``PYTHONPATH``: a worker's engine process imports this checkout first (``python_path_env``).
- ``PDSERVE_REGISTRY_NAMESPACE``: the registry's key namespace in Redis (``registry.schema``). The
  one setting here that is no secret: the KubeRay manifests set it from the pod's RayCluster label,
  an identity only the pod knows (the Serve config is the same text in an upgrade's old and new
  clusters).
- ``RAY_AUTH_MODE``, ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``: Ray's token auth (read by Ray when
  a client connects); ``pdserve status`` / ``scale`` set them to a service's recorded token.

NOTE: imports nothing of the project, so every layer may use it.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

REDIS_URL = "PDSERVE_REDIS_URL"
API_KEY = "PDSERVE_API_KEY"
UCX_NET_DEVICES = "UCX_NET_DEVICES"
RAY_AUTH_MODE = "RAY_AUTH_MODE"
RAY_AUTH_TOKEN = "RAY_AUTH_TOKEN"
RAY_AUTH_TOKEN_PATH = "RAY_AUTH_TOKEN_PATH"

PYTHONPATH = "PYTHONPATH"
REGISTRY_NAMESPACE = "PDSERVE_REGISTRY_NAMESPACE"

LOOPBACK = ("127.0.0.1", "localhost", "::1")
# Ray (2.60) has no bind-address option: its processes listen on the node's address, which it resolves
# to the host's routable IP even when told 127.0.0.1 -- unless "clusters" are off, as on macOS and
# Windows. Off, the node address is 127.0.0.1 and the GCS, raylet, workers and agents all listen on
# loopback only (read when ray is imported, inherited by every process of the cluster).
RAY_CLUSTERS = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def ray_on_loopback() -> bool:
    """Whether this process's Ray cluster is kept on 127.0.0.1 (``keep_ray_on_loopback``, inherited)."""
    return os.environ.get(RAY_CLUSTERS) == "0"


SUPERVISOR_PID = "PDSERVE_SUPERVISOR_PID"  # in a supervised ``pdserve serve``: the supervisor's pid


def take_supervisor_pid() -> int | None:
    """The pid of the supervisor this process runs under (cli/supervise.py), once: it is removed from
    the environment so the processes this one starts do not take it for theirs."""
    pid = os.environ.pop(SUPERVISOR_PID, None)
    return int(pid) if pid else None


def keep_ray_on_loopback() -> None:
    """A Ray cluster this process starts or joins lives on 127.0.0.1 (before ``ray.init``)."""
    os.environ[RAY_CLUSTERS] = "0"
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:  # NOTE: ray read the variable when imported: tell it what it missed
        constants.ENABLE_RAY_CLUSTER = False


def is_loopback(host: str) -> bool:
    """``host`` (a name or address, IPv6 bracketed or not) is this machine's loopback."""
    host = host.strip("[]")
    return host in LOOPBACK or host.startswith("127.")


def redis_url() -> str | None:
    return os.environ.get(REDIS_URL) or None


def require_redis_url(configured: str | None = None) -> str:
    """``configured`` if given, else ``PDSERVE_REDIS_URL``; a clear error when neither is set."""
    url = configured or redis_url()
    if not url:
        raise ValueError(f"no Redis: set redis_url in the config or {REDIS_URL} in the environment")
    return url


def registry_namespace() -> str:
    return os.environ.get(REGISTRY_NAMESPACE, "")


def api_key() -> str | None:
    return os.environ.get(API_KEY) or None


def export_secret(name: str, value: str) -> None:
    """Hand a secret to child processes (a local Ray cluster inherits the environment); never logged."""
    if name not in (REDIS_URL, API_KEY):
        raise ValueError(f"{name} is not a pdserve secret")
    os.environ[name] = value


def python_path_env(root: str) -> dict[str, str]:
    """This process's environment for a Python child that must import the project at ``root``
    first (the checkout this process runs, wherever the child starts)."""
    env = dict(os.environ)
    env[PYTHONPATH] = os.pathsep.join(p for p in (root, env.get(PYTHONPATH)) if p)
    return env


def use_ucx_devices(devices: str | None, host: str, *, override: bool = True) -> None:
    """Choose UCX's network devices before NIXL initialises UCX: ``devices`` when given, else ``lo``
    for a loopback-bound worker (so its KV traffic stays on loopback too); with ``override=False``
    an operator's own ``UCX_NET_DEVICES`` wins."""
    chosen = devices or ("lo" if host in LOOPBACK else None)
    if chosen and (override or UCX_NET_DEVICES not in os.environ):
        os.environ[UCX_NET_DEVICES] = chosen


def use_ray_auth_token(
    token: str | None, ray_has_token: bool, cluster_uses_tokens: bool | None = None
) -> None:
    """Make this process's Ray client send ``token`` to the cluster it joins. A cluster known to run
    without token auth (``cluster_uses_tokens`` False: its service record has no token) is joined
    with token mode off, even when Ray has a token file of its own (a client sending a token there
    waits until it times out). Otherwise, without a token, token mode goes on when Ray has one of its
    own and no mode was chosen: what ``ray.init("auto")`` does by itself, and an explicit address
    does not."""
    if token:
        os.environ[RAY_AUTH_MODE] = "token"
        os.environ[RAY_AUTH_TOKEN] = token
        os.environ.pop(RAY_AUTH_TOKEN_PATH, None)
    elif RAY_AUTH_MODE in os.environ:
        return  # the user's choice
    elif cluster_uses_tokens is False:
        os.environ[RAY_AUTH_MODE] = "disabled"
    elif ray_has_token:
        os.environ[RAY_AUTH_MODE] = "token"


@contextlib.contextmanager
def without(*names: str) -> Iterator[None]:
    """The environment without ``names`` for the block (a parser whose defaults read them, rendered
    the same on every machine: ``cli.docs_reference``)."""
    saved = {k: os.environ.pop(k) for k in names if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)
