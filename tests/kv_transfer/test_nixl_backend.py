"""NixlBackend checks without a second process: a clear error without NIXL, KV tensor validation, and
when the progress thread polls."""

from __future__ import annotations

import sys

import pytest
import torch
from nixl_agent_server import COMPAT

from kv_transfer import KVCompat, KVTransferBackend, NixlBackend, NixlUnavailableError

compat = KVCompat(**COMPAT)
SHAPE = (4, compat.num_layers, 2, compat.block_size, compat.num_kv_heads, compat.head_dim)


def test_missing_nixl_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "nixl", None)  # makes `import nixl` raise ImportError
    with pytest.raises(NixlUnavailableError, match=r"NIXL is required for KV transfer .*pip install nixl"):
        NixlBackend("a", torch.zeros(SHAPE), compat)


@pytest.mark.parametrize(
    "kv,problem",
    [
        (torch.zeros(SHAPE, dtype=torch.bfloat16), "bfloat16 does not match"),
        (torch.zeros(4, 3, 2, 4, 2, 8), "does not match its KVCompat"),
        (torch.zeros(4, 2 * 2 * 4 * 2 * 8), "does not match its KVCompat"),
        (torch.zeros(SHAPE).transpose(0, 1).contiguous().transpose(0, 1), "must be contiguous"),
    ],
    ids=["dtype", "shape", "flat", "strided"],
)
def test_kv_tensor_must_match_its_compat(kv, problem):
    with pytest.raises(ValueError, match=problem):
        NixlBackend("a", kv, compat)


def test_nixl_backend_implements_the_interface():
    assert issubclass(NixlBackend, KVTransferBackend)


class _Stop(BaseException):
    """Ends the progress loop run in the test's thread (the loop logs and swallows Exceptions)."""


class _Clock:
    """``time`` for the progress loop, run in the test's own thread: each ``sleep`` advances the
    clock; with ``engine_polls`` the owner's engine polls halfway through it (between its steps)."""

    def __init__(self, backend: NixlBackend, engine_polls: bool, sleeps: int) -> None:
        self.backend, self.engine_polls, self.left = backend, engine_polls, sleeps
        self.now = 100.0
        self.thread_polls = 0
        self.in_engine = False

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.left -= 1
        if self.left < 0:
            raise _Stop
        self.now += seconds / 2
        if self.engine_polls:
            self.in_engine = True
            self.backend.get_notifications()
            self.in_engine = False
        self.now += seconds / 2

    def counting(self, get_new_notifs):
        def wrapped():
            if not self.in_engine:
                self.thread_polls += 1
            return get_new_notifs()

        return wrapped


@pytest.mark.parametrize("engine_polls", [False, True])
def test_the_progress_thread_polls_only_in_an_interval_its_engine_did_not(monkeypatch, engine_polls):
    """A held prompt keeps the owner's progress thread polling every interval (its readers' bytes
    move only while the owner progresses UCX); an engine that polls between its steps within that
    interval spares the thread its polls."""
    import kv_transfer.nixl_backend as nixl_backend

    backend = NixlBackend("owner", torch.zeros(SHAPE), compat, progress_thread=False)
    try:
        clock = _Clock(backend, engine_polls, sleeps=20)
        monkeypatch.setattr(nixl_backend, "time", clock)
        monkeypatch.setattr(backend._agent, "get_new_notifs", clock.counting(backend._agent.get_new_notifs))
        backend._needed.append(lambda: True)  # as keep_progressing(needed) registers it, without a thread
        with pytest.raises(_Stop):
            backend._keep_progressing(0.001)
        assert clock.thread_polls == (1 if engine_polls else 21)  # the first poll, and one per interval
    finally:
        backend.close()
