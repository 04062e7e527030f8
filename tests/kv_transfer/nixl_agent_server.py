"""A ``NixlBackend`` in a child process, driven by commands over a pipe (a test helper).

Only plain values cross the pipe: a ``RemoteKVInfo`` travels as a dict of bytes, ints and strings,
as it would inside protobuf; no NIXL object is ever pickled. Children are spawned (never forked:
a forked NIXL/UCX state is unusable) and bind UCX to loopback only.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from dataclasses import asdict
from multiprocessing.connection import Connection
from typing import Any

LOOPBACK_ENV = {"UCX_NET_DEVICES": "lo"}
# Small blocks keep every value unique: 2 layers x K/V x 4 tokens x 2 heads x 8 dims = 256 floats.
COMPAT = {
    "model": "tiny-llama",
    "dtype": "float32",
    "block_size": 4,
    "layout": "block_major_v1",
    "num_layers": 2,
    "num_kv_heads": 2,
    "head_dim": 8,
}
NUM_BLOCKS = 16
TERMINAL = ("done", "failed")


class RemoteError(Exception):
    """A command failed in the child; ``kind`` is the exception's class name there."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind, self.message = kind, message


def info_to_wire(info: Any) -> dict[str, Any]:
    return {
        "agent_name": info.agent_name,
        "agent_metadata": bytes(info.agent_metadata),
        "base_addr": int(info.base_addr),
        "block_bytes": int(info.block_bytes),
        "num_blocks": int(info.num_blocks),
        "compat": asdict(info.compat),
        "mem_type": info.mem_type,
        "device_id": int(info.device_id),
    }


def info_from_wire(wire: dict[str, Any]) -> Any:
    from kv_transfer import KVCompat, RemoteKVInfo

    return RemoteKVInfo(**{**wire, "compat": KVCompat(**wire["compat"])})


def block_pattern(num_blocks: int, block_numel: int) -> Any:
    """Block ``b`` holds ``b * 1000 + i`` at flat element ``i`` (exact in float32)."""
    import torch

    return torch.arange(block_numel, dtype=torch.float32) + 1000.0 * torch.arange(num_blocks)[:, None]


def serve(conn: Connection, env: dict[str, str]) -> None:
    os.environ.update(env)  # before UCX reads its configuration
    import torch

    from kv_transfer import KVCompat, NixlBackend, TransferState

    backend: NixlBackend | None = None
    kv: torch.Tensor | None = None
    handles: dict[int, Any] = {}

    def summary(h: Any) -> dict[str, Any]:
        elapsed = (h.finished_at or time.monotonic()) - h.started_at
        return {
            "state": h.state.value,
            "error": h.error,
            "reusable": h.local_blocks_reusable,
            "elapsed": elapsed,
        }

    def wait(h: Any, until: str, limit_s: float) -> dict[str, Any]:
        end = time.monotonic() + limit_s
        while time.monotonic() < end:
            state = backend.poll(h)
            if (state is not TransferState.IN_PROGRESS) if until == "terminal" else h.local_blocks_reusable:
                break
            time.sleep(0.001)
        return summary(h)

    while True:
        cmd, *args = conn.recv()
        try:
            if cmd == "init":
                name, num_blocks, compat_fields, fill, *options = args
                compat = KVCompat(**compat_fields)
                shape = (
                    num_blocks,
                    compat.num_layers,
                    2,
                    compat.block_size,
                    compat.num_kv_heads,
                    compat.head_dim,
                )
                kv = torch.zeros(shape, dtype=torch.float32)
                if fill == "pattern":
                    kv.view(num_blocks, -1).copy_(block_pattern(num_blocks, kv[0].numel()))
                backend = NixlBackend(name, kv, compat, **(options[0] if options else {}))
                result: Any = info_to_wire(backend.local_info())
            elif cmd == "add_peer":
                result = backend.add_peer(info_from_wire(args[0]))
            elif cmd == "remove_peer":
                result = backend.remove_peer(args[0])
            elif cmd == "start_read":
                h = backend.start_read(*args)
                handles[h.transfer_id] = h
                result = h.transfer_id
            elif cmd == "wait":
                result = wait(handles[args[0]], args[1], args[2])
            elif cmd == "release":
                backend.release(handles[args[0]])
                result = summary(handles[args[0]])
            elif cmd == "read":
                *read_args, limit_s = args
                h = backend.start_read(*read_args)
                handles[h.transfer_id] = h
                result = {"id": h.transfer_id, **wait(h, "terminal", limit_s)}
            elif cmd == "blocks":
                result = kv.view(kv.shape[0], -1)[list(args[0])].numpy().tobytes()
            elif cmd == "notifications":
                expect, limit_s = args
                got: list[tuple[str, bytes]] = []
                end = time.monotonic() + limit_s
                while len(got) < expect and time.monotonic() < end:
                    got += backend.get_notifications()
                    time.sleep(0.001)
                result = got
            elif cmd == "keep_progressing":  # as if prompts were held for readers from now on
                backend.keep_progressing(lambda: True)
                result = None
            elif cmd in ("close", "exit"):
                if backend is not None:
                    backend.close()
                result = None
            else:
                raise ValueError(f"unknown command {cmd!r}")
        except Exception as e:
            conn.send(("err", type(e).__name__, str(e)))
        else:
            conn.send(("ok", result))
        if cmd == "exit":
            return


class AgentProcess:
    """Parent-side handle of one ``serve`` child."""

    def __init__(self, env: dict[str, str] | None = None):
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(
            target=serve, args=(child_conn, {**LOOPBACK_ENV, **(env or {})}), daemon=True
        )
        self.process.start()
        child_conn.close()

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    def call(self, *cmd: Any, timeout: float = 30.0) -> Any:
        self._conn.send(cmd)
        if not self._conn.poll(timeout):
            raise TimeoutError(f"agent process did not answer {cmd[0]!r} within {timeout}s")
        status, *reply = self._conn.recv()
        if status == "err":
            raise RemoteError(*reply)
        return reply[0]

    def stop(self) -> None:
        try:
            if self.process.is_alive():
                self.call("exit", timeout=5)
        except (TimeoutError, OSError, EOFError, RemoteError):
            pass
        finally:
            self.process.join(5)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(5)
            self._conn.close()
