"""The end-to-end tier: ``pdserve serve`` really running (Ray, Serve, workers, router, NIXL, Redis).

``ServeProcess`` starts the CLI as a user would, in its own session (so every process it leaves
behind can be found), under a name of its own (``--name``: ``status`` and ``scale`` are always asked
about this service, never whichever runs), waits for it to print its endpoint, and reads the
cluster's state from the service's own ``/metrics`` or ``pdserve status``. A test kills only worker
processes of its own service: ``worker_pids`` checks each is in the session of the ``serve`` it
started.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.ports import free_port
from bench.standalone_stack import child_pids

API_KEY = "test-key-0123456789"  # a test credential, given through the environment as in production


class ServeProcess:
    def __init__(
        self, model: Path, redis_url: str, *extra: str, api_key: str | None = API_KEY, env: dict | None = None
    ) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.name = f"test-{self.port}-{os.getpid()}"
        self.api_key = api_key
        env = dict(os.environ, **(env or {}), PDSERVE_REDIS_URL=redis_url, PYTHONUNBUFFERED="1")
        env.pop("PDSERVE_API_KEY", None)
        if api_key:
            env["PDSERVE_API_KEY"] = api_key
        cmd = [
            sys.executable,
            "-m",
            "cli",
            "serve",
            "--model",
            str(model),
            "--port",
            str(self.port),
            "--name",
            self.name,
        ]
        self.proc = subprocess.Popen(
            [*cmd, "--num-blocks", "64", "--drain-timeout", "60", *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()
        deadline = time.monotonic() + 240
        self.sessions = {self.proc.pid}  # the CLI's, and its supervised child's (cli/supervise.py)
        while not self._ready.wait(0.5):
            self.sessions.update(child_pids(self.proc.pid))
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                pytest.fail("pdserve serve did not come up:\n" + "".join(self.lines[-60:]))
        self.sessions.update(child_pids(self.proc.pid))
        if len(self.sessions) != 2:
            self.kill()
            pytest.fail(f"pdserve serve should run the service as one supervised child: {self.sessions}")

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if "pdserve is serving" in line:
                self._ready.set()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    # HTTP -------------------------------------------------------------------------------------

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        """(status, headers, parsed JSON or raw bytes) of one HTTP call, authenticated by default."""
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        h.update(headers or {})
        req = urllib.request.Request(self.base + path, data=body, method=method, headers=h)
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                status, hdrs, raw = resp.status, dict(resp.headers), resp.read()
        except urllib.error.HTTPError as err:
            status, hdrs, raw = err.code, dict(err.headers), err.read()
        try:
            return status, hdrs, json.loads(raw)
        except ValueError:
            return status, hdrs, raw

    def metrics(self) -> dict[tuple[str, tuple], float]:
        _, _, raw = self.request("GET", "/metrics")
        out: dict[tuple[str, tuple], float] = {}
        for fam in text_string_to_metric_families(raw.decode()):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
                if "router" in s.labels:  # also summed over the router replicas, by its other labels
                    rest = tuple(sorted((k, v) for k, v in s.labels.items() if k != "router"))
                    out[(s.name, rest)] = out.get((s.name, rest), 0.0) + s.value
        return out

    def workers(self) -> dict[str, dict[str, float]]:
        """worker id -> {running, waiting, free, total} from /metrics (each worker's own GetState)."""
        m = self.metrics()
        out: dict[str, dict[str, float]] = {}
        names = {
            "pdserve_requests_running": "running",
            "pdserve_requests_waiting": "waiting",
            "pdserve_kv_blocks_free": "free",
            "pdserve_kv_blocks": "total",
        }
        for (name, labels), v in m.items():
            lab = dict(labels)
            if name in names and lab.get("role") in ("prefill", "decode"):
                out.setdefault(lab["worker"], {})[names[name]] = v
        return out

    def wait_idle(self, timeout_s: float = 60) -> dict[str, dict[str, float]]:
        """Poll until no worker runs anything and every KV block is free; fail with the last state."""
        deadline = time.monotonic() + timeout_s
        while True:
            w = self.workers()
            m = self.metrics()
            active = m.get(("pdserve_router_active_requests", ()), 0)
            if (
                w
                and not active
                and all(
                    s["running"] == 0 and s["waiting"] == 0 and s["free"] == s["total"] for s in w.values()
                )
            ):
                return w
            if time.monotonic() > deadline:
                pytest.fail(
                    f"workers not idle with all blocks free after {timeout_s}s: {w}, router active {active}"
                )
            time.sleep(0.25)

    # The CLI on this service ----------------------------------------------------------------------

    def cli(self, command: str, *args: str) -> str:
        """``pdserve <command> --service <this one> ...``: its stdout; fails the test on an error."""
        out = subprocess.run(
            [sys.executable, "-m", "cli", command, "--service", self.name, *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        return out.stdout

    def status(self) -> dict:
        return json.loads(self.cli("status", "--json").strip().splitlines()[-1])

    def worker_pids(self, role: str) -> dict[str, int]:
        """worker id -> pid of this service's ``role`` workers, each checked to be a process this
        test's ``serve`` started (in its session), so a test never signals another service's."""
        status = self.status()
        assert status["service"]["name"] == self.name, status["service"]
        pids = {w["workerId"]: w["pid"] for w in status["workers"] if w["role"] == role}
        for worker, pid in pids.items():
            try:
                own = os.getsid(pid) in self.sessions
            except ProcessLookupError:
                own = False
            assert own, (
                f"{worker} (pid {pid}) is not a process of this test's service (sessions {self.sessions})"
            )
        return pids

    def wait_workers(self, prefill: int, decode: int, timeout_s: float = 240) -> dict[str, dict[str, float]]:
        """Until exactly ``prefill`` + ``decode`` workers are registered (a busy machine starts them slowly)."""
        deadline = time.monotonic() + timeout_s
        while True:
            w = self.workers()
            roles = [name.split("-")[0] for name in w]
            if roles.count("prefill") == prefill and roles.count("decode") == decode:
                return w
            if time.monotonic() > deadline:
                pytest.fail(
                    f"expected {prefill} prefill + {decode} decode workers after {timeout_s}s: {sorted(w)}"
                )
            time.sleep(0.5)

    def record_path(self) -> Path:
        from cli.service_record import record_path

        return record_path(self.name)

    # Lifecycle --------------------------------------------------------------------------------

    def terminate(self, timeout_s: float = 120) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail("pdserve serve did not stop after SIGTERM:\n" + self.output[-4000:])

    def leftover_processes(self) -> list[str]:
        """Processes still running in the service's sessions (Ray's raylet, GCS, workers would be here),
        as "pid sid args". A zombie has ended: it is left out (one whose parent ended before reaping
        it waits for this machine's init, which may be slow to reap it or never do)."""
        out = subprocess.run(["ps", "-ww", "-eo", "pid,sid,stat,args"], capture_output=True, text=True).stdout
        sids = {str(sid) for sid in self.sessions}
        found = []
        for line in out.splitlines()[1:]:
            pid, sid, stat, args = line.split(None, 3)
            if sid in sids and not stat.startswith("Z"):
                found.append(f"{pid} {sid} {args}")
        return found

    def listening_sockets(self) -> list[tuple[str, str]]:
        """(local address, process) of every TCP socket a process of the service listens on."""
        listening: dict[str, str] = {}  # socket inode -> address
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for row in Path(table).read_text().splitlines()[1:]:
                fields = row.split()
                if fields[3] == "0A":  # LISTEN
                    listening[fields[9]] = _address(fields[1])
        found = []
        for line in self.leftover_processes():
            pid, _, args = line.split(None, 2)
            with contextlib.suppress(OSError):  # a process that just ended
                for fd in Path(f"/proc/{pid}/fd").iterdir():
                    link = os.readlink(fd)
                    if link.startswith("socket:[") and link[8:-1] in listening:
                        program, _, rest = args.partition(" ")
                        found.append((listening[link[8:-1]], f"{Path(program).name} {rest}"[:80]))
        return found

    def kill(self) -> None:
        """SIGKILL every process of the service's sessions (Serve replicas lead process groups of their
        own, so a group kill would miss them)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for line in self.leftover_processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line.split()[0]), signal.SIGKILL)
        with contextlib.suppress(OSError):  # its serve cannot remove the record any more
            self.record_path().unlink()


def _address(hex_address: str) -> str:
    """``/proc/net/tcp{,6}``'s ``0100007F:1F90`` (little-endian words) as ``127.0.0.1:8080``."""
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(words)
    mapped = getattr(ip, "ipv4_mapped", None)  # a dual-stack socket's IPv4 address
    return f"{mapped or ip}:{int(port, 16)}"


def make_serve_model(tmp_path_factory, name: str = "serve-model", **overrides) -> Path:
    """A tiny random Llama with a chat template, large enough to stream a few hundred tokens;
    ``overrides`` change its config (a longer ``max_position_embeddings``)."""
    from engine.tiny_model import create_tiny_model

    return create_tiny_model(
        tmp_path_factory.mktemp(name), "llama", weight_scale=4.0, randomize_all=True, **overrides
    )


@pytest.fixture(scope="module")
def serve_model(tmp_path_factory) -> Path:
    return make_serve_model(tmp_path_factory)


# One service per module, shared by its tests in file order (test_serve_api.py, test_serve_faults.py).

PROMPTS = [
    "the world is",
    "there was a man who",
    "in the first years of the new state",
    "what people know about",
]
MAX_TOKENS = 12
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def serve_flags() -> tuple[str, ...]:
    """Extra ``pdserve serve`` flags of the module's ``service``; a module overrides it."""
    return ()


@pytest.fixture(scope="module")
def service(serve_model, module_redis_server, serve_flags):
    svc = ServeProcess(serve_model, module_redis_server.url, *serve_flags)
    yield svc
    svc.kill()


@pytest.fixture
def blocks_back_after_each_test(service):
    """The invariant of every serving test: afterwards, no worker runs anything and all blocks are free."""
    yield
    if service.proc.poll() is None:  # the last test stops the service and checks its final report
        service.wait_idle()


@pytest.fixture(scope="module")
def tokenizer(serve_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(serve_model)


@pytest.fixture(scope="module")
def client(service):
    import openai

    return openai.OpenAI(base_url=service.base + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def reference(serve_model, tokenizer, hf_greedy):
    """prompt ids -> (HF greedy continuation text, its token count), as a client would see it."""

    def ref(ids: list[int], max_tokens: int = MAX_TOKENS) -> tuple[str, int]:
        out = hf_greedy(serve_model, ids, max_tokens)
        full = tokenizer.decode(ids + out, skip_special_tokens=True)
        return full[len(tokenizer.decode(ids, skip_special_tokens=True)) :], len(out)

    return ref
