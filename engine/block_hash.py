"""Chained, process-stable block hashes for prefix caching.

h_0 = H(root(salt), tokens of block 0), h_i = H(h_{i-1}, tokens of block i), where H is blake2b
(16-byte digest) over a canonical little-endian int64 encoding of the token ids. Identical on
every process and machine, unlike Python's ``hash()``.

NOTE: this module must not import torch (or anything heavy): the router imports it to compute the
same keys as the engines' prefix caches.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Iterator, Sequence

BlockHash = bytes

_DIGEST_SIZE = 16
_PACK_CHUNK_BLOCKS = 32
_VERSION = b"pdserve-kv-v1"
# Packings by token count, compiled structs (half an array's cost for 16 tokens): one block's, and
# a steady batch's blocks at once (``hash_next_blocks``; a multiple of the block size up to the batch).
_BLOCK_PACKERS: dict[int, struct.Struct] = {}


def root_hash(salt: str = "") -> BlockHash:
    """The parent of a sequence's first block; ``salt`` namespaces a model (and its KV layout)."""
    return hashlib.blake2b(_VERSION + salt.encode(), digest_size=_DIGEST_SIZE).digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    h = hashlib.blake2b(parent, digest_size=_DIGEST_SIZE)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def hash_next_block(parent: BlockHash | None, token_ids: Sequence[int], salt: str = "") -> BlockHash:
    """The hash of the block of ``token_ids`` after the one hashed ``parent`` (None: the first):
    ``hash_blocks`` of one block, without its chunking (a decode fills one block at a time)."""
    prev = parent if parent is not None else root_hash(salt)
    n = len(token_ids)
    packer = _BLOCK_PACKERS.get(n) or _BLOCK_PACKERS.setdefault(n, struct.Struct(f"<{n}q"))
    return hashlib.blake2b(prev + packer.pack(*token_ids), digest_size=_DIGEST_SIZE).digest()


def hash_next_blocks(
    parents: Sequence[BlockHash], token_ids: Sequence[int], block_size: int
) -> list[BlockHash]:
    """``hash_next_block`` of many sequences' next blocks at once: block ``i`` is
    ``token_ids[i * block_size : (i + 1) * block_size]``, after the block hashed ``parents[i]``. One
    packing for them all (a steady decode batch fills hundreds of blocks in one step: half the cost
    of packing each)."""
    n = len(parents) * block_size
    if len(token_ids) != n:
        raise ValueError(f"{len(parents)} blocks of {block_size} tokens, got {len(token_ids)} tokens")
    packer = _BLOCK_PACKERS.get(n) or _BLOCK_PACKERS.setdefault(n, struct.Struct(f"<{n}q"))
    packed, width, blake2b = packer.pack(*token_ids), 8 * block_size, hashlib.blake2b
    return [
        blake2b(prev + packed[i : i + width], digest_size=_DIGEST_SIZE).digest()
        for prev, i in zip(parents, range(0, len(packed), width))
    ]


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    salt: str = "",
    parent: BlockHash | None = None,
    start_block: int = 0,
) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids`` from ``start_block`` on.

    ``parent`` is the hash of block ``start_block - 1`` (or None to start at the root), so a caller
    can extend an existing chain as tokens arrive without rehashing its prefix.
    """
    return list(iter_block_hashes(token_ids, block_size, salt, parent, start_block))


def iter_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    salt: str = "",
    parent: BlockHash | None = None,
    start_block: int = 0,
) -> Iterator[BlockHash]:
    """``hash_blocks`` lazily: a consumer that stops at the first unknown block (the router's
    longest-prefix lookup) never pays for hashing the rest of a long prompt."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    prev = parent if parent is not None else root_hash(salt)
    end = len(token_ids) // block_size
    if end <= start_block:
        return
    # Tokens are packed a chunk of blocks at a time and hashed per block slice: the same bytes
    # hash_block() feeds (parent || tokens), far cheaper than packing block by block, and a
    # consumer that stops early never packs the rest.
    step = block_size * 8
    blake2b = hashlib.blake2b
    for chunk in range(start_block, end, _PACK_CHUNK_BLOCKS):
        data = _pack(token_ids[chunk * block_size : min(end, chunk + _PACK_CHUNK_BLOCKS) * block_size])
        for off in range(0, len(data), step):
            prev = blake2b(prev + data[off : off + step], digest_size=_DIGEST_SIZE).digest()
            yield prev


def _pack(token_ids: Sequence[int]) -> bytes:
    """Canonical little-endian int64 encoding."""
    if sys.byteorder == "little":
        return array("q", token_ids).tobytes()
    return struct.pack(f"<{len(token_ids)}q", *token_ids)
