"""NixlBackend checks that need no NIXL agent: a clear error without NIXL, and KV tensor validation."""

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
