"""Cumulative KV-pull statistics of one worker: bytes, outcomes and a latency histogram.

Kept on the engine thread (the only place transfers are started and polled); read as a snapshot.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field

# Upper bounds in seconds: a 4 KiB block over NVLink is microseconds, a 2k-token prompt over UCX/TCP
# on a CPU host tens of milliseconds, a stalled peer hits the transfer timeout (seconds).
TRANSFER_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


@dataclass(slots=True)
class TransferStats:
    bytes: int = 0
    completed: int = 0
    failures: int = 0
    recomputed: int = 0
    waited: int = 0  # pulls that had to wait for free blocks before starting
    descriptors: int = 0  # READ descriptors posted: one per run of contiguous blocks on both sides
    expired_leases: int = 0  # prefill side: held prompts freed at lease expiry (no reader came)
    streamed: int = 0  # pulls that began while the peer still computed the prompt
    streamed_bytes: int = 0  # bytes of those read before the prefill ended (overlapped with it)
    seconds_sum: float = 0.0
    bucket_counts: list[int] = field(default_factory=lambda: [0] * (len(TRANSFER_SECONDS_BUCKETS) + 1))

    def record_done(self, seconds: float) -> None:
        self.completed += 1
        self.seconds_sum += seconds
        self.bucket_counts[bisect.bisect_left(TRANSFER_SECONDS_BUCKETS, seconds)] += 1

    def snapshot(self) -> TransferStats:
        return dataclasses.replace(self, bucket_counts=list(self.bucket_counts))
