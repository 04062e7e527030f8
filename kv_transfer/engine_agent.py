"""A worker's NIXL agent over its engine's KV cache: one per worker incarnation."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kv_transfer.compat import KVCompat

if TYPE_CHECKING:
    from engine.engine_core import EngineCore
    from kv_transfer.nixl_backend import NixlBackend


def engine_agent(
    core: EngineCore, worker_id: str, epoch: int, model_name: str
) -> tuple[KVCompat, NixlBackend]:
    """The engine's compatibility fingerprint and a NIXL backend registered over its KV tensor.

    The agent is named after the worker and its epoch, so a restarted worker is a new peer. It runs
    without NIXL's progress thread: the engine loop ticks every few ms and drives progress (a
    progress thread spins a whole core even when idle).
    """
    from kv_transfer.nixl_backend import NixlBackend

    compat = KVCompat.from_layout(model_name, core.layout)
    return compat, NixlBackend(f"{worker_id}-{epoch}", core.runner.kv_cache, compat, progress_thread=False)
