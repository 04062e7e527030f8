"""KV compatibility: may one engine read another engine's KV blocks byte for byte?

A block read over NIXL is raw bytes, so reader and owner must agree on everything that fixes a
block's byte layout and meaning: the model, the dtype, the block size, the layout version and the
per-block shape (layers, KV heads, head dim). ``KVCompat`` holds those fields; its ``hash()`` is
what travels in a ``KVHandle`` and in worker registrations, and ``check_compatible`` turns a
mismatch into one error that names every differing field.

NOTE: this module imports no torch, so the router may compute and compare compatibility hashes.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.kv_cache import KVLayout

LAYOUT_BLOCK_MAJOR_V1 = "block_major_v1"
# A quantized cache's blocks: the data, then a scale per token, layer, K/V and head (engine.kv_quant;
# v1 had one per block, layer, K/V and head: its blocks are not readable as these).
LAYOUT_QUANTIZED_TOKEN_SCALES_V1 = "block_major_token_scales_v1"


class KVIncompatibleError(ValueError):
    """Two engines' KV caches differ in a way that makes their blocks unreadable to each other."""


@dataclass(frozen=True, slots=True, kw_only=True)
class KVCompat:
    """Everything that fixes the byte layout of one KV block (DESIGN.md §3)."""

    model: str
    dtype: str
    block_size: int
    layout: str = LAYOUT_BLOCK_MAJOR_V1
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KVCompat.{name} must be a positive int, got {value!r}")
        for name in ("model", "dtype", "layout"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"KVCompat.{name} must be a non-empty string")

    @classmethod
    def from_layout(cls, model_name: str, layout: KVLayout) -> KVCompat:
        """The compatibility record of an engine's ``KVLayout`` (``dtype`` as ``"float32"``...)."""
        return cls(
            model=model_name,
            dtype=dtype_name(layout.storage_dtype),  # a quantized cache's blocks hold int8 / e4m3
            block_size=layout.block_size,
            layout=LAYOUT_QUANTIZED_TOKEN_SCALES_V1 if layout.kv_dtype is not None else LAYOUT_BLOCK_MAJOR_V1,
            num_layers=layout.num_layers,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
        )

    def to_dict(self) -> dict[str, str | int]:
        return asdict(self)

    def hash(self) -> str:
        """Stable hex digest: sha256 of canonical JSON (sorted keys, no spaces), same on every host.
        Computed once per distinct record (every handed-off request names it)."""
        return _digest(self)

    def mismatches(self, other: KVCompat) -> list[str]:
        """``"field mine != theirs"`` for every field that differs, in declaration order."""
        out = []
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != theirs:
                out.append(f"{f.name} {mine} != {theirs}")
        return out


@functools.lru_cache(maxsize=64)
def _digest(c: KVCompat) -> str:
    canonical = json.dumps(c.to_dict(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def dtype_name(dtype: object) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; a string passes through."""
    return str(dtype).removeprefix("torch.")


QUANTIZED_DTYPES = ("int8", "float8_e4m3fn")  # blocks of a quantized cache, scales beside the data
_SCALE_BYTES = 4


def quantized_block_bytes(c: KVCompat) -> int:
    """A quantized block's bytes: one per K/V element, then a float32 scale per token, layer, K/V and
    head."""
    return c.num_layers * 2 * c.num_kv_heads * c.block_size * (c.head_dim + _SCALE_BYTES)


def check_kv_tensor(shape: tuple[int, ...], dtype: str, c: KVCompat) -> None:
    """Raise ``ValueError`` unless a transfer backend's tensor holds ``c``'s blocks, one per row:
    ``[num_blocks, layers, 2, block_size, kv_heads, head_dim]`` of ``c.dtype``, or for a quantized
    cache its raw rows, uint8 ``[num_blocks, quantized_block_bytes]``."""
    if c.dtype in QUANTIZED_DTYPES:
        expected: tuple[int, ...] = (quantized_block_bytes(c),)
        ok = len(shape) == 2 and tuple(shape[1:]) == expected and dtype == "uint8"
        want = f"[num_blocks, {expected[0]}] uint8 (the raw rows of a {c.dtype} cache)"
    else:
        expected = (c.num_layers, 2, c.block_size, c.num_kv_heads, c.head_dim)
        ok = len(shape) == 6 and tuple(shape[1:]) == expected and dtype == c.dtype
        want = f"[num_blocks, *{expected}] {c.dtype}"
    if not ok:
        raise ValueError(f"KV tensor {tuple(shape)} {dtype} does not match its KVCompat: expected {want}")


def check_compatible(local: KVCompat, remote: KVCompat, peer: str = "") -> None:
    """Raise ``KVIncompatibleError`` naming every mismatched field (local value first)."""
    diffs = local.mismatches(remote)
    if diffs:
        who = f"worker {peer}" if peer else "the remote worker"
        raise KVIncompatibleError(f"cannot pull KV from {who}: " + ", ".join(diffs))
