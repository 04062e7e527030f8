"""WorkerRecord's fields as Redis holds them: a field a worker of an older version does not publish
reads as its default."""

from __future__ import annotations

from registry.schema import WorkerRecord


def fields_of(record: WorkerRecord, drop: tuple[str, ...] = ()) -> dict[bytes, bytes]:
    return {k.encode(): str(v).encode() for k, v in record.to_fields().items() if k not in drop}


def test_prefix_caching_is_published_and_defaults_to_on_for_older_workers():
    off = WorkerRecord(worker_id="p0", role="prefill", address="-", epoch=1, prefix_caching=0)
    assert WorkerRecord.from_fields(fields_of(off)).prefix_caching == 0
    older = WorkerRecord.from_fields(fields_of(off, drop=("prefix_caching",)))
    assert older.prefix_caching == 1
