"""Moving KV blocks between engines: compatibility checks, the transfer interface, the NIXL backend,
and an in-process backend for unit tests.

NOTE: ``NixlBackend`` loads lazily, so ``import kv_transfer`` pulls in neither torch nor NIXL.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kv_transfer.base import (
    KVTransferBackend,
    RemoteKVInfo,
    TransferHandle,
    TransferState,
    merge_block_runs,
)
from kv_transfer.compat import KVCompat, KVIncompatibleError, check_compatible
from kv_transfer.inprocess import InProcessBackend, InProcessFabric

if TYPE_CHECKING:
    from kv_transfer.nixl_backend import NixlBackend, NixlUnavailableError

__all__ = [
    "InProcessBackend",
    "InProcessFabric",
    "KVCompat",
    "KVIncompatibleError",
    "KVTransferBackend",
    "NixlBackend",
    "NixlUnavailableError",
    "RemoteKVInfo",
    "TransferHandle",
    "TransferState",
    "check_compatible",
    "merge_block_runs",
]

_LAZY = {"NixlBackend", "NixlUnavailableError"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        from kv_transfer import nixl_backend

        return getattr(nixl_backend, name)
    raise AttributeError(f"module 'kv_transfer' has no attribute {name!r}")
