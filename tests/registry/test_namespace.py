"""Registries kept apart in one Redis (``PDSERVE_REGISTRY_NAMESPACE``): a KubeRay upgrade runs the
new Ray cluster beside the old one on the same Redis, and each must see only its own workers. The
namespace is read when ``registry.schema`` is imported, so each side runs in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SIDE = """
import sys
from registry.schema import WorkerRecord, connect, read_workers
from registry.registration import WorkerRegistration
client = connect(sys.argv[1])
if len(sys.argv) > 2:
    WorkerRegistration(client, WorkerRecord(worker_id=sys.argv[2], role="decode", address="-", epoch=1)).register([])
print(",".join(sorted(read_workers(client))))
"""


def _side(url: str, namespace: str | None, *register: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_REGISTRY_NAMESPACE"}
    if namespace is not None:
        env["PDSERVE_REGISTRY_NAMESPACE"] = namespace
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "-c", SIDE, url, *register], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_clusters_in_their_own_namespaces_see_only_their_own_workers(redis_server):
    url = redis_server.url
    assert _side(url, "raycluster-old", "d-old") == "d-old"
    assert _side(url, "raycluster-new", "d-new") == "d-new"
    assert _side(url, "raycluster-old") == "d-old"
    assert _side(url, None, "d-plain") == "d-plain"  # no namespace: the keys as before, apart too


def test_a_namespace_is_a_plain_name():
    from registry.schema import key_prefix

    assert key_prefix("") == "pdserve:" and key_prefix("pd-serve.v2") == "pdserve:pd-serve.v2:"
    with pytest.raises(ValueError, match="PDSERVE_REGISTRY_NAMESPACE takes letters"):
        key_prefix("a:b")
