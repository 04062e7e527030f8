"""What every worker is configured with, whatever its role."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import EngineConfig


@dataclass
class WorkerConfig:
    engine: EngineConfig
    worker_id: str = "worker-0"
    model_name: str | None = None  # the name peers check compatibility against; default: engine.model
    redis_url: str | None = None  # registry + KV events (Redis); None: standalone

    @property
    def served_model(self) -> str:
        return self.model_name or str(self.engine.model)
