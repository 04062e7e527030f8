"""Fixtures for KV transfer tests: NIXL agents in spawned child processes (UCX on loopback only)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from nixl_agent_server import COMPAT, NUM_BLOCKS, AgentProcess


@pytest.fixture
def spawn_agents() -> Iterator[Callable[..., AgentProcess]]:
    """``spawn(env=None)`` -> a started agent process; every one is stopped (or killed) afterwards."""
    started: list[AgentProcess] = []

    def spawn(env: dict[str, str] | None = None) -> AgentProcess:
        started.append(AgentProcess(env))
        return started[-1]

    yield spawn
    for agent in started:
        agent.stop()


@pytest.fixture
def owner_and_reader(spawn_agents) -> tuple[AgentProcess, AgentProcess, dict]:
    """An owner with patterned blocks and a reader with zeroed ones that has added the owner."""
    owner, reader = spawn_agents(), spawn_agents()
    owner_info = owner.call("init", "owner", NUM_BLOCKS, COMPAT, "pattern")
    reader.call("init", "reader", NUM_BLOCKS, COMPAT, "zeros")
    reader.call("add_peer", owner_info)
    return owner, reader, owner_info
