"""A Ray cluster of several nodes on this machine, for the multi-node tier (tests/deploy/test_multinode.py).

Each node is a Ray node of its own (``ray.cluster_utils.Cluster``: its own raylet, object store and
agents) on 127.0.0.1, advertising the role resources by which the KubeRay Serve config places
replicas (``prefill_gpu``, ``decode_gpu``, ``pdserve_head``), with Ray's token auth on and the
secrets in its environment, as a KubeRay cluster has them.

The cluster lives in a process of its own (this file run as a script: the cluster operator), so the
test process never takes on Ray's auth settings; ``RayNodes`` drives it with one JSON line per
command on its stdin and reads one JSON line back. ``lose`` kills a node as a machine dies;
``placement`` reads where each Serve replica runs from Ray's state API. Only processes of this
cluster are ever signalled.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from bench.ports import free_port

LOOPBACK = "127.0.0.1"
REPO = Path(__file__).resolve().parents[2]


class RayNodes:
    """The test's side: the cluster operator process, and its commands."""

    def __init__(self, env: dict[str, str], head_resources: dict[str, float], head_cpus: int = 2) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, json.dumps({"resources": head_resources, "cpus": head_cpus})],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # the raylets' own logs
            text=True,
            env={**os.environ, **env, "PYTHONPATH": str(REPO)},
            start_new_session=True,
        )
        self.address = self._call(None)["address"]  # the GCS address: what ``--address`` joins

    def _call(self, command: dict | None) -> dict:
        if command is not None:
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the Ray cluster process ended (exit {self.proc.wait()})")
        reply = json.loads(line)
        if "error" in reply:
            raise AssertionError(reply["error"])
        return reply

    def add(self, name: str, resources: dict[str, float], num_cpus: int = 1) -> None:
        """A new node (its own raylet) advertising ``resources``."""
        self._call({"op": "add", "name": name, "resources": resources, "cpus": num_cpus})

    def lose(self, name: str, pids: list[int]) -> None:
        """Lose node ``name`` as a machine dies: its raylet, object store and agents SIGKILLed with no
        warning, then ``pids`` (its replicas and the processes they started) SIGKILLed too; returns
        once all of them are gone."""
        self._call({"op": "lose", "name": name, "pids": pids})

    def placement(self, app: str) -> dict[str, list[tuple[str | None, int]]]:
        """Serve deployment -> [(node name, pid)] of its live replicas (None: a node not known here)."""
        return {
            dep: [tuple(x) for x in where]
            for dep, where in self._call({"op": "placement", "app": app})["placement"].items()
        }

    def processes(self, name: str, app: str) -> list[int]:
        """The pids of ``app``'s replicas on node ``name`` and of the processes they started."""
        from bench.standalone_stack import child_pids

        pids = [pid for where in self.placement(app).values() for n, pid in where if n == name]
        return pids + [child for pid in pids for child in child_pids(pid)]

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            self._call({"op": "shutdown"})
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


# The cluster operator process ---------------------------------------------------------------------


class _Cluster:
    def __init__(self, head_resources: dict[str, float], head_cpus: int) -> None:
        from ray.cluster_utils import Cluster

        self.dashboard = f"http://{LOOPBACK}:{free_port()}"  # Ray's state API answers here
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "node_ip_address": LOOPBACK,
                "num_cpus": head_cpus,
                "resources": head_resources,
                "include_dashboard": True,
                "dashboard_host": LOOPBACK,
                "dashboard_port": int(self.dashboard.rsplit(":", 1)[1]),
                "ray_client_server_port": free_port(),
            },
        )
        self.nodes = {"head": self.cluster.head_node}

    def add(self, name: str, resources: dict[str, float], cpus: int) -> dict:
        assert name not in self.nodes, f"node {name} exists"
        self.nodes[name] = self.cluster.add_node(node_ip_address=LOOPBACK, num_cpus=cpus, resources=resources)
        return {}

    def lose(self, name: str, pids: list[int], timeout_s: float = 60) -> dict:
        self.cluster.remove_node(self.nodes.pop(name), allow_graceful=False)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout_s
        while alive := [pid for pid in pids if _alive(pid)]:
            assert time.monotonic() < deadline, f"processes of lost node {name} still run: {alive}"
            time.sleep(0.2)
        return {}

    def placement(self, app: str) -> dict:
        from ray.util.state import list_actors

        names = {node.node_id: n for n, node in self.nodes.items()}
        out: dict[str, list] = defaultdict(list)
        prefix = f"ServeReplica:{app}:"
        for actor in list_actors(address=self.dashboard, filters=[("state", "=", "ALIVE")], limit=1000):
            if actor.class_name.startswith(prefix):
                out[actor.class_name[len(prefix) :]].append((names.get(actor.node_id), actor.pid))
        return {"placement": out}


def _alive(pid: int) -> bool:
    try:  # a zombie (exited, not yet reaped by its parent) is gone for this purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _main() -> None:
    # Replies go to the original stdout; whatever Ray prints goes to stderr.
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    head = json.loads(sys.argv[1])
    cluster = _Cluster(head["resources"], head["cpus"])
    replies.write(json.dumps({"address": cluster.cluster.gcs_address}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "shutdown":
            break
        try:
            reply = getattr(cluster, op)(**cmd)
        except Exception as exc:  # the test sees it as a failed assertion
            reply = {"error": f"{op}: {type(exc).__name__}: {exc}"}
        replies.write(json.dumps(reply) + "\n")
    cluster.cluster.shutdown()
    replies.write("{}\n")


if __name__ == "__main__":
    _main()
