"""A replica's health check fails when its engine loop is dead or stuck, not only when it is gone."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from deploy.config import PDServeConfig
from deploy.deployments import DecodeServer, PrefillServer


@dataclass
class Loop:  # stands in for EngineLoop's two health signals
    alive: bool
    stuck: float

    def stuck_for(self) -> float:
        return self.stuck


@dataclass
class Worker:
    loop: Loop
    worker_id: str = "w-0"


@pytest.mark.parametrize("deployment", [PrefillServer, DecodeServer])
def test_health_check_fails_on_a_dead_or_stuck_engine_loop(deployment):
    # The replica class minus its draining (async) __del__, which only Serve may call.
    probe = type("Probe", (deployment.func_or_class,), {"__del__": lambda self: None})
    replica = probe.__new__(probe)
    replica.config = PDServeConfig(model="m", engine_stuck_timeout_s=30)
    replica.worker = Worker(Loop(alive=True, stuck=0.0))
    asyncio.run(replica.check_health())
    replica.worker.loop.stuck = 29.0
    asyncio.run(replica.check_health())
    replica.worker.loop.stuck = 31.0
    with pytest.raises(RuntimeError, match="no progress for 31s"):
        asyncio.run(replica.check_health())
    replica.worker.loop = Loop(alive=False, stuck=0.0)
    with pytest.raises(RuntimeError, match="not running"):
        asyncio.run(replica.check_health())
