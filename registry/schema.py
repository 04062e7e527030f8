"""The cluster's shared state in Redis: which workers are alive, and which KV blocks each one caches.

Schema (all keys under ``pdserve:``; the wire format both the workers and the router speak):
- ``worker:{id}`` HASH — role, address, epoch, model, block_size, num_blocks, cache_salt, load
  fields; expires ``ttl_s`` after the last heartbeat. ``workers`` SET lists registered ids (a reader
  removes an id whose record and snapshot meta have both expired: a worker that died unregistered).
- ``kv_events`` STREAM — one entry per kind of a transaction's net block events (removals before
  stores within a tier, so between two entries a reader may briefly miss a block, never see one
  the worker did not hold): ``w`` worker id, ``e``
  epoch, ``s`` sequence number (per worker and epoch, from 1, no gaps), ``k`` kind (``S`` stored,
  ``R`` removed, ``C`` cleared, ``Z`` resynced; ``s`` / ``r`` stored in / removed from the worker's
  host tier, ``d`` / ``e`` the same for its disk tier), ``h`` the 16-byte block hashes concatenated;
  a ``Z`` entry's ``x``: the host tier's, ``y``: the disk tier's.
- ``left:{id}`` STRING — set (with a TTL) when a worker deregisters on purpose: readers drop it at
  once instead of waiting out the grace period they give a record that merely vanished.
- ``draining`` STRING — present while the application is shutting down (set by ``pdserve serve``
  on SIGTERM, with a TTL): routers refuse new requests and let the running ones finish.
- ``kv:{id}`` SET of the worker's cached block hashes and ``kvmeta:{id}`` HASH {epoch, seq}: the
  snapshot a reader resynchronises from, with ``kvhost:{id}`` / ``kvdisk:{id}`` SETs the blocks in its
  host / disk tier. A
  worker updates the snapshot and appends the stream entry in one MULTI/EXEC, so a snapshot at seq N
  is exactly the state after events 1..N. Each heartbeat keeps them for ``snapshot_ttl_ms`` more:
  a worker that dies without deregistering leaves nothing behind once readers' grace has passed.
A worker that restarts registers a new epoch: its snapshot is replaced and a ``C`` event tells
readers to drop the previous incarnation's entries.

NOTE: torch-free; the router imports it.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass

import redis

from settings.environment import REGISTRY_NAMESPACE, registry_namespace

logger = logging.getLogger(__name__)


# Every key lives under one prefix; ``PDSERVE_REGISTRY_NAMESPACE`` adds a namespace to it, so that
# Ray clusters sharing one Redis (a KubeRay upgrade runs the old cluster and the new one side by
# side; the manifests set it to the RayCluster's name) keep apart registries: a router never routes
# to another cluster's workers, and a worker's KV layout is checked against its own cluster's only.
def key_prefix(namespace: str) -> str:
    if namespace and not all(c.isalnum() or c in "-_." for c in namespace):
        raise ValueError(f"{REGISTRY_NAMESPACE} takes letters, digits, '-', '_' and '.', got {namespace!r}")
    return f"pdserve:{namespace}:" if namespace else "pdserve:"


PREFIX = key_prefix(registry_namespace())
EVENTS_STREAM = PREFIX + "kv_events"
WORKERS_SET = PREFIX + "workers"
DRAINING_KEY = PREFIX + "draining"
# LoRA adapters loaded at run time (name -> path): a worker that starts later loads them too.
ADAPTERS_KEY = PREFIX + "lora_adapters"
STREAM_MAXLEN = 500_000
LEFT_MARKER_TTL_MS = 120_000  # longer than any reader's grace period for a vanished record
SNAPSHOT_TTL_MIN_MS = 60_000  # a snapshot outlives its record past readers' grace (10 s by default)


def snapshot_ttl_ms(record_ttl_ms: int) -> int:
    """How long a worker's snapshot keys live after its last heartbeat: well past its record (a
    reader keeps a vanished worker's blocks through its grace period, and resynchronises from them)."""
    return max(SNAPSHOT_TTL_MIN_MS, 6 * record_ttl_ms)


HASH_BYTES = 16

STORED, REMOVED, CLEARED, RESYNCED = "S", "R", "C", "Z"
HOST_STORED, HOST_REMOVED = "s", "r"  # the same for the worker's host tier (engine/kv_host_tier.py)
DISK_STORED, DISK_REMOVED = "d", "e"  # the same for the worker's disk tier (engine/kv_disk_tier.py)


def worker_key(worker_id: str) -> str:
    return f"{PREFIX}worker:{worker_id}"


def left_key(worker_id: str) -> str:
    return f"{PREFIX}left:{worker_id}"


def snapshot_key(worker_id: str) -> str:
    return f"{PREFIX}kv:{worker_id}"


def host_snapshot_key(worker_id: str) -> str:
    return f"{PREFIX}kvhost:{worker_id}"


def disk_snapshot_key(worker_id: str) -> str:
    return f"{PREFIX}kvdisk:{worker_id}"


def snapshot_meta_key(worker_id: str) -> str:
    return f"{PREFIX}kvmeta:{worker_id}"


def pack_hashes(hashes: list[bytes]) -> bytes:
    return b"".join(hashes)


def unpack_hashes(blob: bytes) -> list[bytes]:
    if len(blob) % HASH_BYTES:
        raise ValueError(f"hash blob of {len(blob)} bytes is not a multiple of {HASH_BYTES}")
    return [blob[i : i + HASH_BYTES] for i in range(0, len(blob), HASH_BYTES)]


@dataclass(frozen=True, slots=True)
class KVEventRecord:
    worker_id: str
    epoch: int
    seq: int
    kind: str
    hashes: list[bytes]
    host_hashes: list[bytes] = ()  # RESYNCED: the host tier's whole set
    disk_hashes: list[bytes] = ()  # RESYNCED: the disk tier's whole set

    @classmethod
    def from_fields(cls, fields: dict[bytes, bytes]) -> KVEventRecord:
        return cls(
            worker_id=fields[b"w"].decode(),
            epoch=int(fields[b"e"]),
            seq=int(fields[b"s"]),
            kind=fields[b"k"].decode(),
            hashes=unpack_hashes(fields.get(b"h", b"")),
            host_hashes=unpack_hashes(fields.get(b"x", b"")),
            disk_hashes=unpack_hashes(fields.get(b"y", b"")),
        )


@dataclass(slots=True)
class WorkerRecord:
    worker_id: str
    role: str
    address: str
    epoch: int
    model: str = ""
    block_size: int = 16
    num_blocks: int = 0
    cache_salt: str = ""
    kv_compat: str = ""  # fingerprint of the KV block layout (kv_transfer.compat): equal within a model
    kv_layout: str = ""  # the same, for people: "int8 blocks of 16 tokens, 8 layers x 4 KV heads x 64"
    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    queued_prompt_tokens: int = 0
    beat: int = 0  # heartbeats so far: a reader sees the worker alive while it rises
    load_age_ms: int = 0  # how old the engine's last load report was at the heartbeat (a hung engine)
    step_ms: int = 0  # the engine's longest recent step (a stall deadline scales with it)
    host_hit_cost_pct: int = 100  # a host-tier hit's measured cost, in % of computing the block
    disk_hit_cost_pct: int = 100  # the same for a disk-tier hit
    peer_hit_cost_pct: int = 100  # the same for a block read from a peer's tier (100: it reads none)
    kv_handoff: int = 1  # 0: a decode worker that takes no KV hand-offs (it computes its prompts itself)
    loras: str = "{}"  # the LoRA adapters it serves, as JSON: name -> the salt suffix of its prefix hashes
    resident_loras: str = "[]"  # of those, the ones in device slots at the last heartbeat (JSON list)
    streams: str = ""  # host:port of its call stream over a socket (proto.socket_stream); "": gRPC's only
    max_model_len: int = 0  # its context length in tokens (0: not published, a worker of an older version)
    prefix_caching: int = 1  # 0: it caches no prompt prefixes (1 also for a worker of an older version)

    def resident(self, name: str) -> bool:
        """Whether adapter ``name`` was in a device slot at the last heartbeat (no swap-in to run it)."""
        return name in _names(self.resident_loras)

    def adapters(self) -> list[str]:
        """The names of the LoRA adapters it serves."""
        return list(_adapters(self.loras))

    def lora_salt(self, name: str) -> str | None:
        """The prefix-cache salt suffix of adapter ``name`` on this worker; None: it does not serve it."""
        return _adapters(self.loras).get(name)

    def to_fields(self) -> dict[str, str | int]:
        return {k: getattr(self, k) for k in self.__slots__}

    @classmethod
    def from_fields(cls, fields: dict[bytes, bytes]) -> WorkerRecord:
        d = {k.decode(): v.decode() for k, v in fields.items()}
        ints = (
            "epoch",
            "block_size",
            "num_blocks",
            "num_running",
            "num_waiting",
            "num_free_blocks",
            "queued_prompt_tokens",
            "beat",
            "load_age_ms",
            "step_ms",
            "kv_handoff",
            "host_hit_cost_pct",
            "disk_hit_cost_pct",
            "peer_hit_cost_pct",
            "max_model_len",
            "prefix_caching",
        )
        return cls(**{k: (int(v) if k in ints else v) for k, v in d.items() if k in cls.__slots__})


def connect(url: str) -> redis.Redis:
    """A client for ``redis://`` or ``rediss://`` (TLS) URLs, with AUTH from the URL if any.

    Short timeouts: a Redis outage must never stall a worker's engine loop or a routing decision.
    """
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"unsupported Redis URL {url!r}: use redis://, rediss:// or unix://")
    return redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0, health_check_interval=10)


def read_snapshot(client: redis.Redis, worker_id: str) -> tuple[int, int, set[bytes], set[bytes], set[bytes]]:
    """(epoch, seq, cached hashes, host-tier hashes, disk-tier hashes) of a worker, read atomically."""
    pipe = client.pipeline(transaction=True)
    pipe.hgetall(snapshot_meta_key(worker_id))
    pipe.smembers(snapshot_key(worker_id))
    pipe.smembers(host_snapshot_key(worker_id))
    pipe.smembers(disk_snapshot_key(worker_id))
    meta, members, host, disk = pipe.execute()
    return int(meta.get(b"epoch", 0)), int(meta.get(b"seq", 0)), set(members), set(host), set(disk)


def read_adapters(client: redis.Redis) -> dict[str, str]:
    """The LoRA adapters loaded at run time across the cluster: name -> path."""
    return {k.decode(): v.decode() for k, v in client.hgetall(ADAPTERS_KEY).items()}


def record_adapter(client: redis.Redis, name: str, path: str | None) -> None:
    """Remember a run-time load (``path``) for workers that start later, or forget it (None)."""
    if path is None:
        client.hdel(ADAPTERS_KEY, name)
    else:
        client.hset(ADAPTERS_KEY, name, path)


def read_workers(client: redis.Redis, prune: bool = False) -> dict[str, WorkerRecord]:
    """Live workers (their record has not expired). ``prune``: ids listed with neither a record nor
    a snapshot meta (both expired: a worker that died without deregistering) leave the set, so it
    does not grow with every crash nor cost every poll a read per dead id."""
    ids = sorted(i.decode() for i in client.smembers(WORKERS_SET))
    pipe = client.pipeline(transaction=False)
    for wid in ids:
        pipe.hgetall(worker_key(wid))
    out, gone = {}, []
    for wid, fields in zip(ids, pipe.execute()):
        if fields:
            out[wid] = WorkerRecord.from_fields(fields)
        else:
            gone.append(wid)
    if prune and gone:
        pipe = client.pipeline(transaction=False)
        for wid in gone:
            pipe.exists(snapshot_meta_key(wid))
        for wid, meta in zip(gone, pipe.execute()):
            if not meta:
                _unlist(client, wid)
    return out


def _unlist(client: redis.Redis, worker_id: str) -> None:
    """Remove ``worker_id`` from the set if its record and snapshot meta are still both gone (a
    registration in between, one transaction, makes this one fail: the id stays listed)."""
    keys = (worker_key(worker_id), snapshot_meta_key(worker_id))
    with client.pipeline(transaction=True) as pipe:
        try:
            pipe.watch(*keys)
            if pipe.exists(*keys):
                return
            pipe.multi()
            pipe.srem(WORKERS_SET, worker_id)
            pipe.execute()
            logger.info("worker %s: its registration expired; unlisted", worker_id)
        except redis.WatchError:
            pass


def read_departed(client: redis.Redis, worker_ids: list[str]) -> set[str]:
    """Which of these workers deregistered on purpose (recently)."""
    if not worker_ids:
        return set()
    found = client.mget([left_key(w) for w in worker_ids])
    return {w for w, v in zip(worker_ids, found) if v is not None}


def set_draining(client: redis.Redis, on: bool, ttl_s: float = 300.0) -> None:
    """Tell every router to stop taking new requests (``on``), or to take them again."""
    if on:
        client.set(DRAINING_KEY, b"1", px=int(ttl_s * 1000))
    else:
        client.delete(DRAINING_KEY)


@functools.lru_cache(maxsize=256)
def _adapters(loras: str) -> dict[str, str]:
    """A record's ``loras`` field parsed (cached: records of one worker repeat the same text)."""
    try:
        value = json.loads(loras or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


@functools.lru_cache(maxsize=256)
def _names(text: str) -> frozenset[str]:
    try:
        value = json.loads(text or "[]")
    except ValueError:
        return frozenset()
    return frozenset(value) if isinstance(value, list) else frozenset()
