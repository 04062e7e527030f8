"""Joining a service's Ray cluster from the command line, and telling others how to join ours.

Ray (2.60) turns token auth on for every local cluster ``ray.init()`` starts: the token comes from
``RAY_AUTH_TOKEN``, the file ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``, and a client must set
``RAY_AUTH_MODE=token`` to send it — which Ray does by itself only for ``address="auto"``. So
``serve`` records the token it runs with, and ``connect`` hands it to Ray before ``ray.init``.

A failed connection is one line (``ConnectionError``): Ray's own C++ retries print a warning per
second to stderr, so stderr is captured while it connects and read for the cause.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile

from cli.service_record import address_reachable
from cli.service_target import Target
from settings import environment


def cluster_identity() -> tuple[str, str | None]:
    """(GCS address, auth token or None) of the cluster this process joined with ``ray.init``."""
    import ray
    from ray._raylet import AuthenticationMode, AuthenticationTokenLoader, get_authentication_mode

    address = ray.get_runtime_context().gcs_address
    if get_authentication_mode() != AuthenticationMode.TOKEN:
        return address, None
    return address, AuthenticationTokenLoader.instance().get_raw_token(ignore_auth_mode=True) or None


def connect(target: Target) -> None:
    """``ray.init`` into ``target``'s cluster; ConnectionError (one line, no secret) if that fails."""
    if not address_reachable(target.ray_address, timeout_s=3.0):
        raise ConnectionError(f"cannot reach {target.describe()}: nothing answers at {target.ray_address}")
    unlike = not_ray(target.ray_address)
    if unlike is not None:  # ray.init would wait for it for minutes, silently
        raise ConnectionError(
            f"{target.ray_address} is not a Ray cluster's address ({unlike}): give the Ray address "
            "`pdserve serve` printed (GCS, port 6379 by default), or the HTTP endpoint with --endpoint"
        )
    if environment.is_loopback(target.ray_address.rsplit(":", 1)[0]):
        environment.keep_ray_on_loopback()  # else Ray takes this client for another machine's
    _use_token(target.record)
    import ray

    with _captured_stderr() as captured:
        try:
            ray.init(address=target.ray_address, logging_level=logging.ERROR, log_to_driver=False)
            return
        except Exception as exc:
            error = exc
    said = captured()
    if (
        "InvalidAuthToken" in said
        or "Unauthenticated" in said
        or type(error).__name__ == "AuthenticationError"
    ):
        hint = (
            "the recorded token is not the cluster's"
            if target.record
            else "give --service NAME (its record holds the token), or set RAY_AUTH_TOKEN to the cluster's token"
        )
        raise ConnectionError(
            f"the Ray cluster at {target.ray_address} refused this client's auth token (Ray token auth "
            f"is on): {hint}"
        )
    raise ConnectionError(f"cannot connect to {target.describe()}: {_first_line(error)}")


def not_ray(address: str, timeout_s: float = 3.0) -> str | None:
    """Why ``address`` (which accepts connections) is no Ray GCS, or None when it answers as one: a
    GCS call (``GetClusterId``) over gRPC. An HTTP server (the service's endpoint, an easy mistake)
    never completes gRPC's handshake, another gRPC server does not know the method."""
    import grpc

    with grpc.insecure_channel(address) as channel:
        ask = channel.unary_unary(GCS_PROBE_METHOD)  # bytes in, bytes out: no Ray protobufs needed
        try:
            ask(b"", timeout=timeout_s)
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.UNIMPLEMENTED:
                return "a gRPC server, not Ray's"
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return "it does not answer gRPC: an HTTP port?"
    return None  # answered (or refused us as a GCS does: token auth is checked by ray.init)


GCS_PROBE_METHOD = "/ray.rpc.NodeInfoGcsService/GetClusterId"


def stdout_for_results():
    """The real stdout, for a command whose stdout is machine-readable; for the rest of this process
    ``sys.stdout`` is stderr. Ray's driver prints the cluster's error messages (``(raylet) ... lagging
    heartbeats``) to ``sys.stdout`` from a thread, at any time while connected: they must not land
    between a ``--json`` answer and the program reading it."""
    results = sys.stdout
    sys.stdout = sys.stderr
    return results


def _use_token(record) -> None:
    """Ray's auth settings for joining the cluster of ``record`` (a ``ServiceRecord``, or None for a
    bare address): its token, token mode off for a service recorded without one."""
    from ray._raylet import AuthenticationTokenLoader, Config

    loader = AuthenticationTokenLoader.instance()
    environment.use_ray_auth_token(
        record.auth_token if record else None,
        ray_has_token=loader.has_token(ignore_auth_mode=True),
        cluster_uses_tokens=None if record is None else record.auth_token is not None,
    )
    Config.initialize("")  # NOTE: Ray caches its config and the token; both must see the environment
    loader.reset_cache()


@contextlib.contextmanager
def _captured_stderr():
    """Fd 2 into a temporary file (C++ writes there directly); yields a reader of what was written."""
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        text: list[str] = []
        try:
            yield lambda: "".join(text)
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            text.append(tmp.read().decode(errors="replace"))


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
