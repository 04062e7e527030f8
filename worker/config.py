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
    # Run the engine core in a process of its own (``worker.engine_process``): nothing but the engine
    # on its GIL. Decode role, without KV hand-offs (aggregated serving); see worker.engine_client.
    engine_process: bool = False
    # Serve the router's Decode / Prefill call stream on a plain socket too (proto.socket_stream;
    # the router prefers it): a gRPC streamed message cost ~5x the CPU of a framed one.
    socket_streams: bool = True

    @property
    def served_model(self) -> str:
        return self.model_name or str(self.engine.model)
